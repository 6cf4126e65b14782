"""``tycho.store``: the Python API of Mooncake Store, served by Tycho.

Switching from Mooncake is one line::

    from tycho.store import MooncakeDistributedStore   # was: from mooncake.store import ...

Signatures, keyword names, defaults and return conventions follow Mooncake's: ints with 0 for
success and negative error codes, ``b""`` for a missing key, counts for bulk removals.
"""

from ._tycho import (  # noqa: F401  (re-exported)
    BufferDescriptor,
    BufferHandle,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicateConfig,
    SoftPinAction,
    Store as _Store,
    parse_size as _parse_size,
)

__all__ = [
    "MooncakeDistributedStore",
    "DistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "ReplicaDescriptor",
    "MemoryDescriptor",
    "BufferDescriptor",
    "BufferHandle",
]

# Mooncake's setup() defaults.
_DEFAULT_GLOBAL_SEGMENT_SIZE = 16 * 1024 * 1024
_DEFAULT_LOCAL_BUFFER_SIZE = 1024 * 1024 * 1024

_SETUP_ORDER = (
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
)

# Spellings of setup() keys found in Mooncake configs and scripts.
_ALIASES = {
    "master_server_address": "master_server_addr",
    "master_address": "master_server_addr",
    "device_name": "rdma_devices",
    "metadata_server_addr": "metadata_server",
}


class MooncakeDistributedStore(_Store):
    """A client of a Tycho store, with the API of ``mooncake.store.MooncakeDistributedStore``.

    Tycho's segments carry their own endpoints, so ``metadata_server`` is accepted and ignored.
    ``protocol`` "tcp" and "rdma" both select the fastest transport available (shared memory
    between processes on one host, TCP otherwise); set ``TYCHO_PROTOCOL=tcp`` to force TCP.
    """

    def setup(self, *args, **kwargs):
        """``setup(local_hostname, metadata_server, global_segment_size=16MB,
        local_buffer_size=1GB, protocol="tcp", rdma_devices="", master_server_addr=...)``
        or ``setup(config: dict)``. Sizes may be ints or strings such as ``"16MB"``.
        Returns 0 on success, a negative error code otherwise."""
        if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
            params = {_ALIASES.get(k, k): v for k, v in args[0].items()}
        else:
            if len(args) > len(_SETUP_ORDER):
                raise TypeError(f"setup() takes at most {len(_SETUP_ORDER)} positional arguments")
            params = dict(zip(_SETUP_ORDER, args))
            for k, v in kwargs.items():
                k = _ALIASES.get(k, k)
                if k in params:
                    raise TypeError(f"setup() got multiple values for argument {k!r}")
                params[k] = v
        unknown = set(params) - set(_SETUP_ORDER) - {"tenant", "tenant_id"}
        if unknown:
            raise TypeError(f"setup() got unexpected arguments: {sorted(unknown)}")
        if "local_hostname" not in params or "master_server_addr" not in params:
            raise TypeError("setup() needs local_hostname and master_server_addr")
        return self._connect(
            str(params["local_hostname"]),
            _parse_size(params.get("global_segment_size", _DEFAULT_GLOBAL_SEGMENT_SIZE)),
            _parse_size(params.get("local_buffer_size", _DEFAULT_LOCAL_BUFFER_SIZE)),
            str(params.get("protocol", "tcp")),
            str(params["master_server_addr"]),
            str(params.get("tenant", params.get("tenant_id", ""))),
        )

    def put(self, key, value, config=None):
        """Stores ``value`` under ``key`` unless the key exists (then the old value stays and 0 is
        returned). Returns 0 or a negative error code."""
        return self._write(key, value, config, False)

    def upsert(self, key, value, config=None):
        """Stores ``value`` under ``key``, replacing any existing value."""
        return self._write(key, value, config, True)

    def put_parts(self, key, *parts, config=None):
        """Stores the concatenation of ``parts`` as one object."""
        return self._write_parts(key, parts, config, False)

    def upsert_parts(self, key, *parts, config=None):
        """Upserts the concatenation of ``parts`` as one object."""
        return self._write_parts(key, parts, config, True)

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
