"""Pools of registered host buffers (Mooncake's ``BufferPool``): memory a zero-copy call can use
at once, reused instead of allocated and registered for every transfer.

A pool hands out leases of a requested size. Behind each lease is a region of a size class:
requests up to ``min_size_class`` share that class; larger ones up to ``alignment`` take the
next power of two; larger still, the next multiple of ``alignment``. Regions are page-aligned
host memory registered with the store (``register_buffer``), kept on a free list per class
when released and reused. A request above ``max_size_class`` is *oversize*: its region is
allocated for it and unregistered and freed on release. The pool holds at most its capacity in
regions (leased and free); when a new region would not fit, free regions of other classes are
let go first, then the request waits (``block``), up to ``timeout`` seconds, for a release.

Errors are ``RuntimeError`` with Mooncake's messages; ``RegisteredBufferPool`` and its lease
types are the same classes, as in Mooncake's module.
"""

import ctypes
import threading
import time
import weakref

from ._extras import _HOST_ALIGN, _libc

_POINTER_SIZE = ctypes.sizeof(ctypes.c_void_p)


def _next_pow2(n):
    return 1 << (n - 1).bit_length()


class _Region:
    __slots__ = ("ptr", "size", "cls")

    def __init__(self, ptr, size, cls):
        self.ptr, self.size, self.cls = ptr, size, cls


class BufferLeaseView:
    """What a lease's ``buffer`` is a view of, with its own ``buffer`` property (Mooncake's
    lease views). The memory under it stays the lease's while any view of it is alive."""

    def __init__(self, array):
        self._array = array

    @property
    def buffer(self):
        return memoryview(self._array).cast("B")


class BufferLease:
    """``size`` bytes at ``ptr`` inside a registered region, until ``release()`` (or the end of
    a ``with`` block, or garbage collection once no view of it is left)."""

    def __init__(self, pool, region, size):
        self._pool = pool
        self._region = region
        self._size = size
        # The ctypes arrays behind this lease's views. Each holds the lease (so the region
        # cannot go back to the pool under a live view, even if the lease object is dropped);
        # the lease holds them weakly, to refuse release() while one lives.
        self._arrays = []

    @property
    def size(self):
        return self._size

    def _open_region(self):
        if self._region is None:
            raise RuntimeError("buffer lease is closed")
        return self._region

    @property
    def ptr(self):
        return self._open_region().ptr

    @property
    def buffer(self):
        """A writable ``memoryview`` of the lease's ``size`` bytes."""
        region = self._open_region()
        array = (ctypes.c_ubyte * self._size).from_address(region.ptr)
        array._lease = self
        self._arrays = [a for a in self._arrays if a() is not None]
        self._arrays.append(weakref.ref(array))
        return BufferLeaseView(array).buffer

    def _views_alive(self):
        return any(a() is not None for a in self._arrays)

    def release(self):
        """Gives the region back to the pool; a second call does nothing. Refused while a
        ``memoryview`` from ``buffer`` is alive (release it, or drop it, first)."""
        if self._region is None:
            return
        if self._views_alive():
            raise RuntimeError("cannot release buffer while exported views exist")
        region, self._region = self._region, None
        self._pool._give_back(region)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        region, self._region = getattr(self, "_region", None), None
        if region is not None:
            self._pool._give_back(region)

    def __repr__(self):
        state = "closed" if self._region is None else f"ptr={self._region.ptr:#x}"
        return f"<BufferLease size={self._size} {state}>"


class BufferPool:
    """Registered host buffers for zero-copy calls of ``store`` (see the module's docstring).

    ``max_bytes`` is the pool's capacity (0: twice the store's local buffer size; never less
    than that buffer); ``max_size_class`` (default: the capacity) the largest pooled request;
    ``max_regions`` caps the leases out at once; ``prewarm_size`` and ``prewarm_count``
    register that many regions at construction."""

    def __init__(self, store, max_bytes=0, min_size_class=65536, max_size_class=None,
                 alignment=8388608, block_on_exhaustion=True, default_timeout=None, max_regions=None,
                 prewarm_size=None, prewarm_count=0):
        if not hasattr(store, "register_buffer") or not hasattr(store, "unregister_buffer"):
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if alignment <= 0 or alignment & (alignment - 1) or alignment < _POINTER_SIZE:
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        if min_size_class <= 0:
            raise RuntimeError("min_size_class must be positive")
        local = int(getattr(store, "_local_buffer_size", 0) or 0)
        capacity = max(int(max_bytes), local) if max_bytes else 2 * local
        if capacity <= 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        if default_timeout is not None and default_timeout < 0:
            raise RuntimeError("timeout must be non-negative")
        self._store = store
        self._capacity = capacity
        self._min_class = int(min_size_class)
        self._max_class = capacity if max_size_class is None else min(int(max_size_class), capacity)
        self._alignment = int(alignment)
        self._block = bool(block_on_exhaustion)
        self._timeout = default_timeout
        self._max_regions = max_regions
        self._lock = threading.Condition()
        self._free = {}  # size class -> [region]
        self._held = 0  # bytes in regions, leased or free
        self._leased = 0  # leases out
        self._closed = False
        if prewarm_count:
            self.prewarm(prewarm_size if prewarm_size is not None else self._min_class, prewarm_count)

    def _class_of(self, size):
        if size <= self._min_class:
            return self._min_class
        if size <= self._alignment:
            return _next_pow2(size)
        return -(-size // self._alignment) * self._alignment

    def _new_region(self, cls):
        """Allocates and registers a region of ``cls`` bytes (called without the lock)."""
        ptr = ctypes.c_void_p()
        align = max(_HOST_ALIGN, min(self._alignment, _next_pow2(cls)))
        if _libc.posix_memalign(ctypes.byref(ptr), align, cls) != 0 or not ptr.value:
            raise RuntimeError(f"cannot allocate a buffer of {cls} bytes")
        rc = self._store.register_buffer(ptr.value, cls)
        if rc != 0:
            _libc.free(ptr.value)
            raise RuntimeError(f"buffer registration failed ({rc})")
        return _Region(ptr.value, cls, cls)

    def _drop_region(self, region):
        self._store.unregister_buffer(region.ptr)
        _libc.free(region.ptr)

    def _room_for(self, cls):
        """Under the lock: takes idle regions off the free lists until ``cls`` more bytes fit.
        Returns whether they do, and the regions taken, for the caller to drop outside it."""
        dropped = []
        for other in list(self._free):
            while self._held + cls > self._capacity and self._free[other]:
                r = self._free[other].pop()
                self._held -= r.size
                dropped.append(r)
        return self._held + cls <= self._capacity, dropped

    def acquire(self, size, block=None, timeout=None):
        """A lease of ``size`` bytes (see the class docstring for waiting)."""
        size = int(size)
        if size < 0:
            raise RuntimeError("buffer size must be non-negative")
        block = self._block if block is None else bool(block)
        timeout = self._timeout if timeout is None else timeout
        if timeout is not None and timeout < 0:
            raise RuntimeError("timeout must be non-negative")
        cls = self._class_of(max(size, 1))
        if cls > self._capacity:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        oversize = size > self._max_class
        deadline = None if timeout is None else time.monotonic() + timeout
        dropped = []  # idle regions let go to make room: unregistered outside the lock
        try:
            with self._lock:
                while True:
                    if self._closed:
                        raise RuntimeError("buffer pool is closed")
                    if self._max_regions is None or self._leased < self._max_regions:
                        if not oversize and self._free.get(cls):
                            region = self._free[cls].pop()
                            self._leased += 1
                            return BufferLease(self, region, size)
                        fits, let_go = self._room_for(cls)
                        dropped.extend(let_go)
                        if fits:
                            self._held += cls
                            self._leased += 1
                            break
                    if not block:
                        raise RuntimeError("buffer pool is exhausted")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise RuntimeError("timed out waiting for buffer")
                    self._lock.wait(left)
        finally:
            for r in dropped:
                self._drop_region(r)
        try:
            region = self._new_region(cls)
        except BaseException:
            with self._lock:
                self._held -= cls
                self._leased -= 1
                self._lock.notify_all()
            raise
        if oversize:
            region.cls = None
        return BufferLease(self, region, size)

    def buffer(self, size, block=None, timeout=None):
        """``acquire``, for ``with pool.buffer(n) as lease:``."""
        return self.acquire(size, block, timeout)

    def _give_back(self, region):
        drop = None
        with self._lock:
            self._leased -= 1
            if region.cls is None or self._closed:
                self._held -= region.size
                drop = region
            else:
                self._free.setdefault(region.cls, []).append(region)
            self._lock.notify_all()
        if drop is not None:
            self._drop_region(drop)

    def prewarm(self, size, count):
        """Registers ``count`` free regions of ``size``'s class now."""
        cls = self._class_of(max(int(size), 1))
        if int(size) > self._max_class:
            raise RuntimeError("cannot prewarm oversize buffers")
        for _ in range(int(count)):
            with self._lock:
                if self._closed:
                    raise RuntimeError("buffer pool is closed")
                if self._held + cls > self._capacity:
                    raise RuntimeError("registered buffer pool capacity exceeded")
                self._held += cls
            try:
                region = self._new_region(cls)
            except BaseException:
                with self._lock:
                    self._held -= cls
                raise
            with self._lock:
                closed = self._closed
                if not closed:
                    self._free.setdefault(cls, []).append(region)
            if closed:
                self._drop_region(region)
                raise RuntimeError("buffer pool is closed")

    def close(self):
        """Unregisters and frees every region; refused while leases are out. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._leased:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            regions = [r for rs in self._free.values() for r in rs]
            self._free.clear()
            self._held = 0
            self._lock.notify_all()
        for r in regions:
            self._drop_region(r)

    def __repr__(self):
        return f"<BufferPool capacity={self._capacity} held={self._held} leased={self._leased}>"


# Mooncake's module gives the registered variants as the same classes.
RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView
