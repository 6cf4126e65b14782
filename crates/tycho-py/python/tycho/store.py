"""``tycho.store``: the Python API of Mooncake Store, served by Tycho.

Switching from Mooncake is one line::

    from tycho.store import MooncakeDistributedStore   # was: from mooncake.store import ...

Signatures, keyword names, defaults and return conventions follow Mooncake's: ints with 0 for
success and negative error codes, ``b""`` for a missing key, counts for bulk removals.
"""

import atexit
import weakref

from ._tycho import (  # noqa: F401  (re-exported)
    BufferDescriptor,
    BufferHandle,
    MemoryDescriptor,
    QueryTaskResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    Store as _Store,
    TaskStatus,
    TaskType,
    parse_size as _parse_size,
)

from ._extras import (  # noqa: F401  (re-exported)
    DiskDescriptor,
    EngramStore,
    EngramStoreConfig,
    MooncakeDistributedNoFRegister,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ParallelAxis,
    ReadTarget,
    TensorParallelism,
    bind_to_numa_node,
    get_alloc_func_addr,
    get_free_func_addr,
    module_values as _module_values,
)
from ._pools import (  # noqa: F401  (re-exported)
    BufferLease,
    BufferLeaseView,
    BufferPool,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
)
from ._tensors import TensorMethods as _TensorMethods

# Mooncake's name of a memory replica's location.
Descriptor = BufferDescriptor

# The enums' members by name, as Mooncake's module has them (PENDING, REPLICA_COPY, KVCACHE...).
globals().update(_module_values())

__all__ = [
    "MooncakeDistributedStore",
    "DistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "ReplicaDescriptor",
    "MemoryDescriptor",
    "BufferDescriptor",
    "BufferHandle",
    "TaskType",
    "TaskStatus",
    "ReplicaStatus",
    "QueryTaskResponse",
    "ObjectDataType",
    "ParallelAxis",
    "TensorParallelism",
    "ReadTarget",
    "MooncakeHostMemAllocator",
    "bind_to_numa_node",
    "EngramStore",
    "EngramStoreConfig",
    "MooncakeDistributedNoFRegister",
    "Descriptor",
    "DiskDescriptor",
    "BufferPool",
    "BufferLease",
    "BufferLeaseView",
    "RegisteredBufferPool",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "get_alloc_func_addr",
    "get_free_func_addr",
] + sorted(_module_values())

# Mooncake's setup() defaults.
_DEFAULT_GLOBAL_SEGMENT_SIZE = 16 * 1024 * 1024
_DEFAULT_LOCAL_BUFFER_SIZE = 16 * 1024 * 1024

# Mooncake's positional order, with the defaults of the optional arguments.
_SETUP_ORDER = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "engine",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
)
_REQUIRED = ("local_hostname", "master_server_addr")

# Spellings of setup() keys found in Mooncake configs and the clients that forward them
# (LMCache passes master_server_address and device_name).
_ALIASES = {
    "master_server_address": "master_server_addr",
    "master_address": "master_server_addr",
    "device_name": "rdma_devices",
    "metadata_server_addr": "metadata_server",
    "tenant": "tenant_id",
}

# Mooncake's default tenant is Tycho's default (unnamed) tenant.
_DEFAULT_TENANT = "default"

_INVALID_PARAMS = -600


# Stores still open when the interpreter exits are closed then (their segments unmounted), as
# Mooncake's destructor does; a store dropped earlier closes itself when its last reference goes.
_OPEN_STORES = weakref.WeakSet()


@atexit.register
def _close_open_stores():
    # One short attempt per unmount, so a dead master cannot hold up the exit; a forked child
    # leaves its parent's segments alone.
    for s in list(_OPEN_STORES):
        s._close_quickly()


class MooncakeDistributedStore(_TensorMethods, _Store):
    """A client of a Tycho store, with the API of ``mooncake.store.MooncakeDistributedStore``.

    Tycho's segments carry their own endpoints, so ``metadata_server`` is accepted and ignored.
    ``protocol`` "tcp" and "rdma" both select the fastest transport available (shared memory
    between processes on one host, TCP otherwise); set ``TYCHO_PROTOCOL=tcp`` to force TCP.
    """

    def setup(self, *args, **kwargs):
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config: dict)``.

        Sizes may be ints or strings such as ``"16MB"``. The dict form reads the same names
        (and the legacy ``master_server_address`` / ``device_name``) and ignores other keys.
        ``engine``, the SSD offload and the client HTTP server are Mooncake features Tycho does
        not have; they are accepted and ignored. Returns 0 on success, a negative error code
        otherwise (-600 for a value that cannot be used, such as a size of "50%")."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            params = {}
            for k, v in args[0].items():
                k = _ALIASES.get(k, k)
                if k in _SETUP_ORDER:
                    params.setdefault(k, v)
            if "local_hostname" not in params or "master_server_addr" not in params:
                return _INVALID_PARAMS
        else:
            if len(args) > len(_SETUP_ORDER):
                raise TypeError(f"setup() takes at most {len(_SETUP_ORDER)} positional arguments")
            params = dict(zip(_SETUP_ORDER, args))
            for k, v in kwargs.items():
                k = _ALIASES.get(k, k)
                if k not in _SETUP_ORDER:
                    raise TypeError(f"setup() got an unexpected keyword argument {k!r}")
                if k in params:
                    raise TypeError(f"setup() got multiple values for argument {k!r}")
                params[k] = v
            missing = [k for k in _REQUIRED if k not in params]
            if missing:
                raise TypeError(f"setup() missing required arguments: {missing}")
        try:
            segment = _parse_size(params.get("global_segment_size", _DEFAULT_GLOBAL_SEGMENT_SIZE))
            buffer = _parse_size(params.get("local_buffer_size", _DEFAULT_LOCAL_BUFFER_SIZE))
        except (ValueError, TypeError, OverflowError):
            return _INVALID_PARAMS
        tenant = params.get("tenant_id")
        tenant = "" if tenant in (None, "", _DEFAULT_TENANT) else str(tenant)
        _OPEN_STORES.add(self)
        self._local_buffer_size = buffer
        return self._connect(
            str(params["local_hostname"]),
            segment,
            buffer,
            str(params.get("protocol") or "tcp"),
            str(params["master_server_addr"]),
            tenant,
        )

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Attaches to the ``tycho node`` of this user on this host started with ``--port P``,
        where ``server_address`` is ``"127.0.0.1:P"`` (Mooncake's real-client address; the
        port names a Unix socket, so only processes of the node's user on its host can attach).
        The store then needs no master address, secret or segment of its own: it joins the
        node's store, reads and writes with one copy (mapping the node's segment), and
        ``alloc_from_mem_pool`` hands out up to ``mem_pool_size`` bytes of host memory.
        Returns 0, or -1 when no node answers there."""
        host, _, port = str(server_address).rpartition(":")
        try:
            port = int(port)
            buffer = _parse_size(local_buffer_size)
            pool = _parse_size(mem_pool_size)
        except (ValueError, TypeError, OverflowError):
            return -1
        if not 0 < port < 65536 or host not in ("127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0", ""):
            return -1
        _OPEN_STORES.add(self)
        self._local_buffer_size = buffer
        self._mem_pool_limit = pool
        return 0 if self._connect_dummy(port, buffer) == 0 else -1

    def init_all(self, protocol, device_name, mount_segment_size):
        """``setup`` with Mooncake's fixed arguments: this host, a segment of
        ``mount_segment_size`` bytes, the master at ``$MASTER_SERVER`` (default
        127.0.0.1:50051). -600 when this store is set up already."""
        if self._is_set_up():
            return _INVALID_PARAMS
        import os

        master = os.environ.get("MASTER_SERVER", "127.0.0.1:50051")
        return self.setup("localhost", "P2PHANDSHAKE", mount_segment_size, _DEFAULT_LOCAL_BUFFER_SIZE,
                          protocol, device_name, master)

    def alloc_from_mem_pool(self, size):
        """The address of ``size`` bytes of page-aligned host memory that live until this store
        closes (register them with ``register_buffer`` for zero-copy calls); 0 when the store is
        not set up, ``size`` is not positive, or a dummy store's ``mem_pool_size`` is used up."""
        size = int(size)
        if size <= 0 or not self._is_set_up():
            return 0
        pool = self.__dict__.setdefault("_mem_pool", MooncakeHostMemAllocator())
        used = self.__dict__.get("_mem_pool_used", 0)
        limit = self.__dict__.get("_mem_pool_limit", 0)
        if limit and used + size > limit:
            return 0
        ptr = pool.alloc(size)
        if ptr:
            self._mem_pool_used = used + size
        return ptr

    def get_offload_rpc_read_count(self):
        """Reads of SSD-offloaded objects served over RPC: Tycho offloads nothing, so 0."""
        return 0

    def unmount_local_disk_segment(self, grace_period_seconds=0):
        """Tycho has no local disk segments: nothing to unmount, 0."""
        return 0

    def close(self):
        rc = _Store.close(self)
        pool = self.__dict__.pop("_mem_pool", None)
        if pool is not None:
            for ptr in list(pool._blocks):
                pool.free(ptr)
        self._mem_pool_used = 0
        return rc

    def put(self, key, value, config=None):
        """Stores ``value`` under ``key`` unless the key exists (then the old value stays and 0 is
        returned). Returns 0 or a negative error code."""
        return self._write(key, value, config, False)

    def upsert(self, key, value, config=None):
        """Stores ``value`` under ``key``, replacing any existing value."""
        return self._write(key, value, config, True)

    def put_parts(self, key, *args, config=None):
        """Stores the concatenation of ``parts`` as one object."""
        return self._write_parts(key, args, config, False)

    def upsert_parts(self, key, *args, config=None):
        """Upserts the concatenation of ``parts`` as one object."""
        return self._write_parts(key, args, config, True)

    def put_batch(self, keys, values, config=None):
        """Stores many objects; returns 0, or the first error code."""
        return self._write_batch(list(keys), list(values), config, False)

    def upsert_batch(self, keys, values, config=None):
        """Upserts many objects; returns 0, or the first error code."""
        return self._write_batch(list(keys), list(values), config, True)

    def put_from(self, key, buffer_ptr, size, config=None):
        """Stores ``size`` bytes at ``buffer_ptr`` (inside a registered buffer), zero-copy."""
        return self._write_from(key, buffer_ptr, size, config, False)

    def upsert_from(self, key, buffer_ptr, size, config=None):
        """Upserts ``size`` bytes at ``buffer_ptr`` (inside a registered buffer), zero-copy."""
        return self._write_from(key, buffer_ptr, size, config, True)

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        """Zero-copy ``put_from`` of many objects; one code per key."""
        return self._batch_write_from(list(keys), list(buffer_ptrs), list(sizes), config, False)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        """Zero-copy ``upsert_from`` of many objects; one code per key."""
        return self._batch_write_from(list(keys), list(buffer_ptrs), list(sizes), config, True)


DistributedStore = MooncakeDistributedStore
