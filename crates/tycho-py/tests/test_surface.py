"""The rest of Mooncake's surface against a real master: extra segments (memory and file
backed), the dummy client attached to a real `tycho node`, host memory, buffer pools, and the
torch-free tensor header."""

import ctypes
import hashlib
import os
import socket
import struct
import subprocess
import threading
import time

import pytest

from tycho import _tensors
from tycho.store import (
    BufferPool,
    Descriptor,
    DiskDescriptor,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    RegisteredBufferPool,
    get_alloc_func_addr,
    get_free_func_addr,
)

from conftest import _tycho_bin, lines_of, wait_line


def _wait(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segments_of(store, key):
    return {r.segment_id for r in store.get_replica_desc(key)}


def test_allocated_segments_take_objects_and_unmount(make_store):
    s = make_store(segment=0)
    r = s.allocate_and_mount_segment(32 << 20)
    assert r["ret"] == 0 and r["allocated_size"] == 32 << 20 and len(r["segment_ids"]) == 1
    [seg] = r["segment_ids"]
    assert s.put("on-extra", b"x" * 1000) == 0
    assert _segments_of(s, "on-extra") == {seg}, "the only segment there is takes the object"
    assert s.get("on-extra") == b"x" * 1000
    assert s.unmount_segment([seg]) == 0
    assert s.is_exist("on-extra") == 0, "its objects went with the segment"
    # Unknown, repeated and malformed ids: -1, and every other id is still handled.
    assert s.unmount_segment([seg]) == -1
    assert s.unmount_segment(["not-an-id"]) == -1
    r2 = s.allocate_and_mount_segment(8 << 20)
    assert s.unmount_and_free_segment(["nope", r2["segment_ids"][0]]) == -1
    assert s.allocate_and_mount_segment(8 << 20)["ret"] == 0, "the freed segment no longer counts"
    bad = s.allocate_and_mount_segment(0)
    assert bad == {"ret": -1, "segment_ids": [], "allocated_size": 0}
    assert s.unmount_segment([]) == 0


def _stable_id(name):
    digest = hashlib.sha256(b"tycho stable segment v1\0" + name.encode()).digest()
    return f"{int.from_bytes(digest[:16], 'little'):032x}"


def test_a_stable_segment_keeps_its_id_across_stores(make_store, tmp_path):
    first = make_store(segment=0)
    r = first.allocate_and_mount_segment(8 << 20, stable_id="py-node-1.dram")
    assert r["ret"] == 0 and r["segment_ids"] == [_stable_id("py-node-1.dram")]
    # The same name again while it is mounted: -102, nothing more mounted.
    assert first.allocate_and_mount_segment(8 << 20, stable_id="py-node-1.dram")["ret"] == -102
    assert first.allocate_and_mount_segment(8 << 20, stable_id="no spaces")["ret"] == -600
    assert first.put("on-stable", b"s" * 100) == 0 and first.get("on-stable") == b"s" * 100
    assert first.unmount_segment(r["segment_ids"]) == 0
    # Another process-like store mounts the same name: the same segment id, empty.
    second = make_store(segment=0)
    path = tmp_path / "stable.bin"
    with open(path, "wb") as f:
        f.truncate(8 << 20)
    m = second.mount_segment(str(path), 8 << 20, 0, "tcp", "", stable_id="py-node-1.dram")
    assert m == {"ret": 0, "segment_ids": [_stable_id("py-node-1.dram")]}
    assert second.is_exist("on-stable") == 0
    assert second.unmount_segment(m["segment_ids"]) == 0


def test_a_segment_over_a_file_stores_into_the_file(make_store, tmp_path):
    path = tmp_path / "segment.bin"
    with open(path, "wb") as f:
        f.truncate(8192 + (16 << 20))
    holder = make_store(segment=0)
    m = holder.mount_segment(str(path), 16 << 20, 8192)
    assert m["ret"] == 0 and len(m["segment_ids"]) == 1
    value = os.urandom(64 << 10)
    assert holder.put("in-file", value) == 0
    with open(path, "rb") as f:
        data = f.read()
    at = data.find(value)
    assert at >= 8192, "the bytes are in the file, past the offset"
    # Another client on this host reads it (the holder serves it over TCP: never mapped).
    reader = make_store(segment=0)
    assert reader.get("in-file") == value
    # What cannot be mounted: beyond the file, an offset off a page, no such file.
    assert holder.mount_segment(str(path), 32 << 20, 0) == {"ret": -1, "segment_ids": []}
    assert holder.mount_segment(str(path), 4096, 100)["ret"] == -1
    assert holder.mount_segment(str(tmp_path / "missing"), 4096, 0)["ret"] == -1
    assert holder.unmount_segment(m["segment_ids"]) == 0


def test_a_grace_period_delays_the_unmount(make_store):
    s = make_store(segment=0)
    [seg] = s.allocate_and_mount_segment(8 << 20)["segment_ids"]
    assert s.put("graced", b"y" * 100) == 0
    assert s.unmount_segment([seg], 5) == 0
    assert s.get("graced") == b"y" * 100, "still served during the grace period"
    assert _wait(lambda: s.is_exist("graced") == 0), "unmounted once the grace period passed"


class Node:
    """A `tycho node` listening for attaching processes on `port`."""

    def __init__(self, master_addr, port, segment="64MB"):
        self.port = port
        self.proc = subprocess.Popen([_tycho_bin(), "node", "--master", master_addr, "--segment-size", segment,
                                      "--port", str(port)], stdout=subprocess.PIPE, text=True)
        lines = lines_of(self.proc)
        serving = wait_line(lines, "tycho node serving")
        if serving is None or wait_line(lines, "tycho node: processes of this user attach") is None:
            self.stop()
            raise RuntimeError("tycho node did not start")
        self.endpoint = serving.split(" at ", 1)[1].split(" ", 1)[0]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def node(master):
    n = Node(master.addr, _free_port())
    yield n
    n.stop()


def test_a_dummy_client_works_through_a_tycho_node(node):
    """SGLang's standalone-storage flow: host memory from MooncakeHostMemAllocator, registered,
    then zero-copy batch puts and gets, through a store attached to a node."""
    s = MooncakeDistributedStore()
    try:
        assert s.setup_dummy(64 << 20, 16 << 20, f"127.0.0.1:{node.port}") == 0
        alloc = MooncakeHostMemAllocator()
        size = 4 << 20
        ptr = alloc.alloc(size)
        assert ptr
        assert s.register_buffer(ptr, size) == 0
        pages = [os.urandom(64 << 10) for _ in range(8)]
        for i, p in enumerate(pages):
            ctypes.memmove(ptr + i * len(p), p, len(p))
        keys = [f"page-{i}" for i in range(len(pages))]
        ptrs = [ptr + i * (64 << 10) for i in range(len(pages))]
        assert s.batch_put_from(keys, ptrs, [64 << 10] * len(pages)) == [0] * len(pages)
        # The values sit in the node's segment: the dummy contributes none.
        assert all(r.memory.buffer_descriptor.transport_endpoint == node.endpoint
                   for k in keys for r in s.get_replica_desc(k))
        ctypes.memset(ptr, 0, size)
        assert s.batch_get_into(keys, ptrs, [64 << 10] * len(pages)) == [64 << 10] * len(pages)
        assert [ctypes.string_at(p, 64 << 10) for p in ptrs] == pages
        assert s.get("page-3") == pages[3]
        # The pool handed out by alloc_from_mem_pool stops at mem_pool_size.
        a = s.alloc_from_mem_pool(48 << 20)
        assert a and a % 4096 == 0
        assert s.alloc_from_mem_pool(32 << 20) == 0
        assert s.unregister_buffer(ptr) == 0
        assert alloc.free(ptr) == 0
    finally:
        s.close()


def test_setup_dummy_without_a_node_fails():
    s = MooncakeDistributedStore()
    assert s.setup_dummy(0, 16 << 20, f"127.0.0.1:{_free_port()}") == -1
    assert s.setup_dummy(0, 16 << 20, "10.1.2.3:50052") == -1, "only a node on this host"
    assert s.setup_dummy(0, 16 << 20, "127.0.0.1:notaport") == -1


def test_memory_helpers_and_constants(make_store):
    s = make_store()
    assert s.get_offload_rpc_read_count() == 0
    assert s.unmount_local_disk_segment() == 0
    assert s.init_all("tcp", "", 16 << 20) == -600, "already set up"
    p = s.alloc_from_mem_pool(1 << 20)
    assert p and p % 4096 == 0 and s.register_buffer(p, 1 << 20) == 0
    ctypes.memset(p, 7, 1 << 20)
    assert s.put_from("pooled", p, 1 << 20) == 0
    assert s.get("pooled") == b"\x07" * (1 << 20)
    assert s.alloc_from_mem_pool(0) == 0
    assert MooncakeDistributedStore().alloc_from_mem_pool(10) == 0, "not set up"
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(get_free_func_addr())
    q = alloc(10000)
    assert q and q % 4096 == 0
    free(q)
    d = Descriptor()
    assert (d.buffer_address, d.size, d.transport_endpoint) == (0, 0, "")
    d.size = 5
    assert d.size == 5
    with pytest.raises(TypeError):
        DiskDescriptor()


def test_buffer_pools_reuse_registered_regions(make_store):
    s = make_store(buffer="4MB")
    assert RegisteredBufferPool is BufferPool
    pool = BufferPool(s, max_bytes=4 << 20, block_on_exhaustion=False)
    with pool.acquire(100) as lease:
        assert lease.size == 100 and len(lease.buffer) == 100
        first = lease.ptr
        view = lease.buffer
        view[:5] = b"hello"
        with pytest.raises(RuntimeError, match="exported views"):
            lease.release()
        view.release()
        assert s.put_from("leased", lease.ptr, 5) == 0, "the region is registered"
    assert s.get("leased") == b"hello"
    with pytest.raises(RuntimeError, match="closed"):
        lease.ptr
    # A view holds its region even when the lease object is gone, and a slice of it too.
    view = pool.acquire(100).buffer
    part = view[10:20]
    at = ctypes.addressof((ctypes.c_ubyte * len(view)).from_buffer(view))
    del view
    other = pool.acquire(100)
    assert other.ptr != at, "the region of a live view is not handed out again"
    other.release()
    del part
    reused = pool.acquire(100)
    assert reused.ptr in (at, first), "once the views are gone the region is free again"
    reused.release()
    assert lease.size == 100
    again = pool.acquire(200)
    assert again.ptr == first, "a released region of the class is reused"
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    big = pool.acquire(2 << 20)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(2 << 20)
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(2 << 20, block=True, timeout=0.05)
    with pytest.raises(RuntimeError, match="exceeds pool capacity"):
        pool.acquire(64 << 20)
    # A waiting acquire gets the region a release frees.
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(2 << 20, block=True, timeout=20)))
    t.start()
    big.release()
    t.join()
    assert got and got[0].size == 2 << 20
    got[0].release()
    again.release()
    zero = pool.acquire(0)
    assert zero.size == 0 and len(zero.buffer) == 0
    zero.release()
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="pool is closed"):
        pool.acquire(10)
    with pytest.raises(RuntimeError, match="power of two"):
        BufferPool(s, alignment=3)
    warm = BufferPool(s, prewarm_size=4096, prewarm_count=2)
    a, b = warm.acquire(4096), warm.acquire(4096)
    assert a.ptr != b.ptr
    a.release(), b.release()
    warm.close()


def _header(dtype, shape, nbytes):
    """The tensor header, written here field by field (not with tycho's own code)."""
    h = bytearray(304)
    struct.pack_into("<IHHiiIIQQ", h, 0, 0x4D4F4F4E, 1, 304, dtype, len(shape), 0, 0, 304, nbytes)
    struct.pack_into("<8q", h, 40, *(list(shape) + [-1] * (8 - len(shape))))
    struct.pack_into("<8q", h, 104, *(list(shape) + [-1] * (8 - len(shape))))
    return bytes(h)


def test_the_tensor_header_layout_without_torch(make_store):
    s = make_store()
    data = struct.pack("<6f", *range(6))
    h = _header(0, (2, 3), len(data))
    assert _tensors.pack_header(0, (2, 3), len(data)) == h
    fields = _tensors.unpack_header(h + data)
    assert (fields["dtype"], fields["shape"], fields["layout"], fields["data_bytes"]) == (0, (2, 3), 0, 24)
    buf = ctypes.create_string_buffer(h + data, len(h) + len(data))
    assert s.put_tensor_from("t", ctypes.addressof(buf), len(h) + len(data)) == 0
    assert bytes(s.get_buffer("t")) == h + data
    # A wrong magic, a short buffer and a size that disagrees with the header are refused.
    bad = ctypes.create_string_buffer(b"\0" * 4 + h[4:] + data, len(h) + len(data))
    assert s.put_tensor_from("bad", ctypes.addressof(bad), len(h) + len(data)) == -600
    assert s.put_tensor_from("bad", ctypes.addressof(buf), 100) == -600
    assert s.put_tensor_from("bad", ctypes.addressof(buf), len(h) + len(data) - 4) == -600
    assert s.is_exist("bad") == 0
    with pytest.raises(_tensors.HeaderError):
        _tensors.unpack_header(h[:100])
    with pytest.raises(_tensors.HeaderError):
        _tensors.pack_header(0, (1,) * 9, 0)
    m = _tensors.pack_manifest(0, (4, 2), 0, 2)
    assert len(m) == 96 and _tensors.unpack_manifest(m)["global_shape"] == (4, 2)


def test_tensor_methods_without_torch_say_what_is_missing(make_store):
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here; test_tensors.py covers the methods")
    s = make_store()
    with pytest.raises(ImportError, match="PyTorch"):
        s.put_tensor("k", object())
    with pytest.raises(ImportError, match="PyTorch"):
        s.get_tensor_into("k", 0, 0)


def test_init_all_sets_up_against_master_server(master, monkeypatch):
    monkeypatch.setenv("MASTER_SERVER", master.addr)
    s = MooncakeDistributedStore()
    try:
        assert s.init_all("tcp", "", 16 << 20) == 0
        assert s.put("init-all", b"v") == 0 and s.get("init-all") == b"v"
        assert s.init_all("tcp", "", 16 << 20) == -600
    finally:
        s.close()
