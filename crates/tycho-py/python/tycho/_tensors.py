"""Tensor methods of the store: thin Python over ``put_parts`` / ``put_from`` / ``get_buffer`` /
``get_into``, with the 304-byte header Mooncake's wheel writes in front of a tensor's bytes, so
that tensors written by either store read back in the other's format.

torch is imported only when a tensor method runs (an ImportError naming it otherwise). The
header itself (``pack_header`` / ``unpack_header``) needs no torch.

Header (little-endian)::

    0    u32 magic 0x4D4F4F4E        4  u16 version 1      6  u16 header size 304
    8    i32 dtype code              12 i32 ndim (1..8)    16 u32 layout (0 full, 1 shard)
    20   u32 flags 0                 24 u64 data offset    32 u64 data bytes
    40   i64 global shape[8]         104 i64 local shape[8]          (unused dims: -1)
    168  u32 axis count (<= 4)       172 u32 reserved
    176  4 axes of 32 bytes: i32 kind (dp 0, tp 1, ep 2, pp 3), i32 axis index, i32 rank,
         i32 count, i32 split dim (-1: none), i32 expert or stage id, i64 local extent

A scalar is stored as shape ``(1,)``. Sharded layouts (``*_with_tp``, ``*_with_parallelism``)
store each shard under its own key with a shard header, and a 96-byte manifest
(magic 0x574D414E) under ``KEY__parallelism_manifest`` or ``KEY__writer_manifest``.
"""

import copy
import ctypes
import struct

HEADER_SIZE = 304
MAGIC = 0x4D4F4F4E
VERSION = 1
LAYOUT_FULL, LAYOUT_SHARD = 0, 1
MAX_DIMS = 8
MAX_AXES = 4
MANIFEST_SIZE = 96
MANIFEST_MAGIC = 0x574D414E

AXIS_KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
_KIND_NAMES = {v: k for k, v in AXIS_KINDS.items()}

# Codes of the header's dtype field, in Mooncake's order.
DTYPE_NAMES = ("float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
               "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

_INVALID_PARAMS = -600
_OBJECT_NOT_FOUND = -704
_FILE_NOT_FOUND = -1100


class HeaderError(ValueError):
    """Bytes that are not a tensor this store wrote."""


def pack_header(dtype_code, shape, data_bytes, layout=LAYOUT_FULL, global_shape=None, axes=()):
    """The header of a tensor of ``shape`` (its local shape) and ``data_bytes`` bytes; ``axes``
    holds ``(kind, axis_index, rank, count, split_dim, extra, local_extent)`` tuples."""
    shape = tuple(int(d) for d in shape) or (1,)
    global_shape = shape if global_shape is None else tuple(int(d) for d in global_shape)
    if not 0 <= dtype_code < len(DTYPE_NAMES):
        raise HeaderError(f"dtype code {dtype_code}")
    if len(shape) > MAX_DIMS or len(global_shape) != len(shape):
        raise HeaderError(f"{len(shape)} dimensions (at most {MAX_DIMS})")
    if len(axes) > MAX_AXES:
        raise HeaderError(f"{len(axes)} parallel axes (at most {MAX_AXES})")
    pad = lambda s: list(s) + [-1] * (MAX_DIMS - len(s))  # noqa: E731
    out = bytearray(HEADER_SIZE)
    struct.pack_into("<IHHiiIIQQ", out, 0, MAGIC, VERSION, HEADER_SIZE, dtype_code, len(shape), layout, 0,
                     HEADER_SIZE, data_bytes)
    struct.pack_into("<8q", out, 40, *pad(global_shape))
    struct.pack_into("<8q", out, 104, *pad(shape))
    struct.pack_into("<II", out, 168, len(axes), 0)
    for i, a in enumerate(axes):
        struct.pack_into("<6iq", out, 176 + 32 * i, *a)
    return bytes(out)


def unpack_header(buf, total=None):
    """The fields of the header at the start of ``buf`` (bytes-like, at least 304 bytes) as a
    dict; ``total`` is the whole object's length, checked against the data size. Raises
    HeaderError for anything that is not such a header."""
    if len(buf) < HEADER_SIZE:
        raise HeaderError(f"{len(buf)} bytes, less than a tensor header")
    magic, version, size, dtype, ndim, layout, _flags, offset, nbytes = struct.unpack_from("<IHHiiIIQQ", buf, 0)
    if magic != MAGIC or version != VERSION or size != HEADER_SIZE or offset != HEADER_SIZE:
        raise HeaderError("not a tensor header of version 1")
    if not 0 <= dtype < len(DTYPE_NAMES) or not 1 <= ndim <= MAX_DIMS or layout not in (0, 1):
        raise HeaderError(f"dtype {dtype}, {ndim} dimensions, layout {layout}")
    if total is not None and nbytes != total - HEADER_SIZE:
        raise HeaderError(f"{nbytes} data bytes in a {total}-byte object")
    global_shape = struct.unpack_from("<8q", buf, 40)[:ndim]
    shape = struct.unpack_from("<8q", buf, 104)[:ndim]
    count, _ = struct.unpack_from("<II", buf, 168)
    if count > MAX_AXES or any(d < 0 for d in shape):
        raise HeaderError("bad axes or shape")
    axes = [struct.unpack_from("<6iq", buf, 176 + 32 * i) for i in range(count)]
    return {"dtype": dtype, "shape": tuple(shape), "global_shape": tuple(global_shape), "layout": layout,
            "data_bytes": nbytes, "axes": axes}


def pack_manifest(dtype_code, global_shape, split_dim, shard_count, extra=0):
    out = bytearray(MANIFEST_SIZE)
    shape = list(global_shape) + [-1] * (MAX_DIMS - len(global_shape))
    struct.pack_into("<IHHiiiii4x8q", out, 0, MANIFEST_MAGIC, VERSION, MANIFEST_SIZE, dtype_code,
                     len(global_shape), split_dim, shard_count, extra, *shape)
    return bytes(out)


def unpack_manifest(buf):
    if len(buf) != MANIFEST_SIZE:
        raise HeaderError("not a manifest")
    fields = struct.unpack_from("<IHHiiiii4x8q", buf, 0)
    magic, version, size, dtype, ndim, split_dim, count = fields[:7]
    if magic != MANIFEST_MAGIC or version != VERSION or size != MANIFEST_SIZE or not 1 <= ndim <= MAX_DIMS:
        raise HeaderError("not a manifest of version 1")
    return {"dtype": dtype, "global_shape": tuple(fields[8:8 + ndim]), "split_dim": split_dim, "count": count}


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("tycho.store's tensor methods need PyTorch: pip install torch") from e
    return torch


def _dtype_code(torch, dtype):
    for code, name in enumerate(DTYPE_NAMES):
        if getattr(torch, name, None) == dtype:
            return code
    return None


def _is_tensor(obj):
    return "Tensor" in type(obj).__name__ and hasattr(obj, "data_ptr")


class _Encoded:
    """A tensor's header and a view of its bytes (which keeps the tensor alive)."""

    def __init__(self, header, tensor, nbytes):
        self.header = header
        self.tensor = tensor
        self.data = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr()) if nbytes else b""

    def parts(self):
        return (self.header, memoryview(self.data).cast("B") if self.data else b"")


def _encode(tensor, layout=LAYOUT_FULL, global_shape=None, axes=()):
    """``tensor`` (on the CPU) as header and bytes; None for what cannot be stored."""
    torch = _torch()
    if not _is_tensor(tensor) or tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return None
    code = _dtype_code(torch, tensor.dtype)
    if code is None or tensor.dim() > MAX_DIMS:
        return None
    t = tensor.contiguous()
    nbytes = t.numel() * t.element_size()
    try:
        header = pack_header(code, tuple(t.shape), nbytes, layout, global_shape, axes)
    except HeaderError:
        return None
    return _Encoded(header, t, nbytes)


def _decode(buf, total=None):
    """A tensor over ``buf`` (header then data; the tensor shares its memory); None if it is
    not a tensor."""
    torch = _torch()
    try:
        h = unpack_header(buf, len(buf) if total is None else total)
    except HeaderError:
        return None
    dtype = getattr(torch, DTYPE_NAMES[h["dtype"]], None)
    if dtype is None:
        return None
    if h["data_bytes"] == 0:
        return torch.empty(h["shape"], dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, offset=HEADER_SIZE, count=h["data_bytes"])
    try:
        return raw.view(dtype).reshape(h["shape"])
    except RuntimeError:
        return None


def _memory_at(ptr, size):
    return (ctypes.c_ubyte * size).from_address(ptr) if size else bytearray()


def _shard_key(key, rank):
    return f"{key}_tp_{rank}"


def _split(tensor, size, dim):
    """The ``size`` equal slices of ``tensor`` along ``dim``; None unless they divide evenly."""
    if size < 1 or not -tensor.dim() <= dim < tensor.dim():
        return None
    dim %= tensor.dim()
    extent = tensor.shape[dim]
    if extent % size:
        return None
    step = extent // size
    return dim, [tensor.narrow(dim, r * step, step) for r in range(size)]


def _suffix(axes):
    """The key suffix of a shard under several axes (Mooncake's naming): sorted dp, tp, ep, pp."""
    out = ""
    for a in sorted(axes, key=lambda a: AXIS_KINDS[a.kind.lower()]):
        kind = a.kind.lower()
        out += f"__{kind}_{a.rank}of{a.size}"
        if kind == "tp":
            out += f"_sd{a.split_dim}"
        elif kind == "ep":
            out += f"_eid{a.expert_id}"
        elif kind == "pp":
            out += f"_sid{a.stage_id}"
    return out


def _axes_valid(axes):
    kinds = [str(getattr(a, "kind", "")).lower() for a in axes]
    if not axes or len(set(kinds)) != len(kinds) or any(k not in AXIS_KINDS for k in kinds):
        return False
    for a, k in zip(axes, kinds):
        if not 0 <= a.rank < a.size:
            return False
        if (k == "tp") != (a.split_dim is not None):
            return False
        if k == "ep" and a.expert_id is None or k == "pp" and a.stage_id is None:
            return False
    return len(axes) <= MAX_AXES


class TensorMethods:
    """Mixed into ``MooncakeDistributedStore``; see the module's docstring."""

    # ---- whole tensors ----

    def _put_tensor(self, key, tensor, config, upsert, **layout):
        enc = _encode(tensor, **layout)
        if enc is None:
            return _INVALID_PARAMS
        return self._write_parts(key, enc.parts(), config, upsert)

    def put_tensor(self, key, tensor):
        """Stores a CPU tensor under ``key`` (header and bytes); 0 or a negative code."""
        return self._put_tensor(key, tensor, None, False)

    def upsert_tensor(self, key, tensor):
        return self._put_tensor(key, tensor, None, True)

    def pub_tensor(self, key, tensor, config=None):
        return self._put_tensor(key, tensor, config, False)

    def upsert_pub_tensor(self, key, tensor, config=None):
        return self._put_tensor(key, tensor, config, True)

    def _batch_put_tensor(self, keys, tensors, config, upsert):
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            return [_INVALID_PARAMS] * len(keys)
        return [self._put_tensor(k, t, config, upsert) for k, t in zip(keys, tensors)]

    def batch_put_tensor(self, keys, tensors_list):
        return self._batch_put_tensor(keys, tensors_list, None, False)

    def batch_upsert_tensor(self, keys, tensors_list):
        return self._batch_put_tensor(keys, tensors_list, None, True)

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        return self._batch_put_tensor(keys, tensors_list, config, False)

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        return self._batch_put_tensor(keys, tensors_list, config, True)

    def _put_tensor_from(self, key, buffer_ptr, size, config, upsert):
        """Stores ``size`` bytes at ``buffer_ptr`` laid out as [header][data], after checking
        the header: zero-copy from a registered buffer, else with one copy."""
        if size < HEADER_SIZE or not buffer_ptr:
            return _INVALID_PARAMS
        try:
            unpack_header(ctypes.string_at(buffer_ptr, HEADER_SIZE), size)
        except HeaderError:
            return _INVALID_PARAMS
        if self._is_registered(buffer_ptr, size):
            return self._write_from(key, buffer_ptr, size, config, upsert)
        return self._write(key, memoryview(_memory_at(buffer_ptr, size)).cast("B"), config, upsert)

    def put_tensor_from(self, key, buffer_ptr, size):
        return self._put_tensor_from(key, buffer_ptr, size, None, False)

    def upsert_tensor_from(self, key, buffer_ptr, size):
        return self._put_tensor_from(key, buffer_ptr, size, None, True)

    def _batch_put_tensor_from(self, keys, buffer_ptrs, sizes, upsert):
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        return [self._put_tensor_from(k, p, n, None, upsert) for k, p, n in zip(keys, ptrs, sizes)]

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes):
        return self._batch_put_tensor_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes):
        return self._batch_put_tensor_from(keys, buffer_ptrs, sizes, True)

    def get_tensor(self, key):
        """The tensor stored under ``key`` (owning its memory), or None."""
        buf = self.get_buffer(key)
        return None if buf is None else _decode(buf)

    def batch_get_tensor(self, keys):
        return [None if b is None else _decode(b) for b in self.batch_get_buffer(list(keys))]

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads ``key`` into ``size`` bytes at ``buffer_ptr`` (header then data); returns a
        tensor over the data there, or None (missing key, too small a buffer, not a tensor)."""
        _torch()
        if self._is_registered(buffer_ptr, size):
            n = self.get_into(key, buffer_ptr, size)
        else:  # through a copy
            buf = self.get_buffer(key)
            if buf is None or len(buf) > size:
                return None
            n = len(buf)
            ctypes.memmove(buffer_ptr, (ctypes.c_ubyte * n).from_buffer(buf) if n else 0, n)
        if n < HEADER_SIZE:
            return None
        return _decode(_memory_at(buffer_ptr, n))

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        return [self.get_tensor_into(k, p, n) for k, p, n in zip(keys, ptrs, sizes)]

    def get_tensor_into_cuda(self, key, tensor):
        """Needs CUDA, which this build of Tycho does not use: -600."""
        return _INVALID_PARAMS

    def batch_get_tensor_into_cuda(self, keys, tensors_list):
        return [_INVALID_PARAMS] * len(list(keys))

    # ---- tensor parallelism: shards under KEY_tp_RANK ----

    def _put_tp(self, key, tensor, config, tp_size, split_dim, upsert=False):
        if tp_size <= 1:
            return self._put_tensor(key, tensor, config, upsert)
        if not _is_tensor(tensor):
            return _INVALID_PARAMS
        parts = _split(tensor, tp_size, split_dim)
        if parts is None:
            return _INVALID_PARAMS
        dim, shards = parts
        encoded = []
        for rank, shard in enumerate(shards):
            axis = (AXIS_KINDS["tp"], 0, rank, tp_size, dim, 0, shard.shape[dim])
            enc = _encode(shard, LAYOUT_SHARD, tuple(tensor.shape), (axis,))
            if enc is None:
                return _INVALID_PARAMS
            encoded.append(enc)
        for rank, enc in enumerate(encoded):
            rc = self._write_parts(_shard_key(key, rank), enc.parts(), config, upsert)
            if rc != 0:
                return rc
        return 0

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """Splits ``tensor`` into ``tp_size`` equal shards along ``split_dim`` and stores each
        under ``KEY_tp_RANK`` (every rank's; ``tp_rank`` is not used). -600 unless they divide
        evenly."""
        return self._put_tp(key, tensor, None, tp_size, split_dim)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        return self._put_tp(key, tensor, config, tp_size, split_dim)

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0):
        keys, tensors = list(base_keys), list(tensors_list)
        if len(keys) != len(tensors):
            return [_INVALID_PARAMS] * len(keys)
        return [self._put_tp(k, t, None, tp_size, split_dim) for k, t in zip(keys, tensors)]

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0, tp_size=1, split_dim=0):
        keys, tensors = list(base_keys), list(tensors_list)
        if len(keys) != len(tensors):
            return [_INVALID_PARAMS] * len(keys)
        return [self._put_tp(k, t, config, tp_size, split_dim) for k, t in zip(keys, tensors)]

    def _tensor_at(self, buffer_ptr, size):
        """The tensor laid out [header][data] in ``size`` bytes at ``buffer_ptr``, or None."""
        try:
            unpack_header(ctypes.string_at(buffer_ptr, HEADER_SIZE), size)
        except HeaderError:
            return None
        return _decode(_memory_at(buffer_ptr, size))

    def put_tensor_with_tp_from(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        if size < HEADER_SIZE or not buffer_ptr:
            return _INVALID_PARAMS
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        tensor = self._tensor_at(buffer_ptr, size)
        return _INVALID_PARAMS if tensor is None else self._put_tp(key, tensor, None, tp_size, split_dim)

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1, split_dim=0):
        keys, ptrs, sizes = list(base_keys), list(buffer_ptrs), list(sizes)
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        return [self.put_tensor_with_tp_from(k, p, n, tp_rank, tp_size, split_dim) for k, p, n in zip(keys, ptrs, sizes)]

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        """This rank's shard, as stored under ``KEY_tp_RANK`` (``key`` itself when ``tp_size``
        is 1), or None."""
        return self.get_tensor(key if tp_size <= 1 else _shard_key(key, tp_rank))

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        return self.get_tensor_into(key if tp_size <= 1 else _shard_key(key, tp_rank), buffer_ptr, size)

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        return self.batch_get_tensor([k if tp_size <= 1 else _shard_key(k, tp_rank) for k in base_keys])

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1):
        keys = [k if tp_size <= 1 else _shard_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # ---- general parallel layouts ----

    def _put_parallel(self, key, tensor, parallelism, config, writer_partition, upsert):
        if parallelism is not None and writer_partition is not None:
            return _INVALID_PARAMS
        if writer_partition is not None:
            return self._put_writer_partition(key, tensor, writer_partition, config, upsert)
        if parallelism is None:
            return self._put_tensor(key, tensor, config, upsert)
        axes = list(getattr(parallelism, "axes", []) or [])
        if not _is_tensor(tensor) or not _axes_valid(axes):
            return _INVALID_PARAMS
        torch = _torch()
        code = _dtype_code(torch, tensor.dtype)
        kinds = [a.kind.lower() for a in axes]
        wire_axes = [(AXIS_KINDS[k], i, a.rank, a.size, -1 if a.split_dim is None else a.split_dim,
                      a.expert_id if k == "ep" else (a.stage_id if k == "pp" else 0) or 0, 0)
                     for i, (a, k) in enumerate(zip(axes, kinds))]
        if kinds == ["tp"]:
            # The tensor is this rank's shard; the global shape multiplies its split dim.
            a = axes[0]
            if code is None or not -tensor.dim() <= a.split_dim < tensor.dim():
                return _INVALID_PARAMS
            dim = a.split_dim % tensor.dim()
            global_shape = list(tensor.shape)
            global_shape[dim] *= a.size
            wire_axes[0] = wire_axes[0][:4] + (dim, 0, tensor.shape[dim])
            enc = _encode(tensor, LAYOUT_SHARD, tuple(global_shape), wire_axes)
            if enc is None:
                return _INVALID_PARAMS
            rc = self._write_parts(_shard_key(key, a.rank), enc.parts(), config, upsert)
            if rc == 0:
                manifest = pack_manifest(code, global_shape, dim, a.size)
                rc = self._write(key + "__parallelism_manifest", manifest, config, True)
            return rc
        shard, global_shape = tensor, tuple(tensor.shape)
        if "tp" in kinds:
            a = axes[kinds.index("tp")]
            parts = _split(tensor, a.size, a.split_dim)
            if parts is None or code is None:
                return _INVALID_PARAMS
            dim, shards = parts
            shard = shards[a.rank]
            i = kinds.index("tp")
            wire_axes[i] = wire_axes[i][:4] + (dim, 0, shard.shape[dim])
        enc = _encode(shard, LAYOUT_SHARD, global_shape, wire_axes)
        if enc is None:
            return _INVALID_PARAMS
        rc = self._write_parts(key + _suffix(axes), enc.parts(), config, upsert)
        if rc == 0 and "tp" in kinds:
            a = axes[kinds.index("tp")]
            manifest = pack_manifest(code, global_shape, a.split_dim % tensor.dim(), a.size)
            rc = self._write(key + "__parallelism_manifest", manifest, config, True)
        return rc

    def _put_writer_partition(self, key, tensor, part, config, upsert):
        if not _is_tensor(tensor) or any(not hasattr(part, f) for f in ("rank", "size", "split_dim")):
            return _INVALID_PARAMS
        parts = _split(tensor, part.size, part.split_dim)
        code = _dtype_code(_torch(), tensor.dtype)
        if parts is None or code is None or not 0 <= part.rank < part.size:
            return _INVALID_PARAMS
        dim, shards = parts
        for rank, shard in enumerate(shards):
            axis = (AXIS_KINDS["tp"], 0, rank, part.size, dim, 0, shard.shape[dim])
            enc = _encode(shard, LAYOUT_SHARD, tuple(tensor.shape), (axis,))
            if enc is None:
                return _INVALID_PARAMS
            rc = self._write_parts(f"{key}__writer_{rank}of{part.size}_sd{dim}", enc.parts(), config, upsert)
            if rc != 0:
                return rc
        return self._write(key + "__writer_manifest", pack_manifest(code, tuple(tensor.shape), dim, part.size),
                           config, True)

    def put_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None, writer_partition=None):
        """Stores ``tensor`` as a full object (no parallelism), as this rank's shard under a
        ``TensorParallelism`` (with a manifest), or split by ``writer_partition`` (an object
        with ``rank``, ``size``, ``split_dim``) into every part and a manifest."""
        return self._put_parallel(key, tensor, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None, writer_partition=None):
        return self._put_parallel(key, tensor, parallelism, config, writer_partition, True)

    def _put_parallel_from(self, key, buffer_ptr, size, parallelism, config, writer_partition, upsert):
        tensor = self._tensor_at(buffer_ptr, size) if buffer_ptr and size >= HEADER_SIZE else None
        if tensor is None:
            return _INVALID_PARAMS
        return self._put_parallel(key, tensor, parallelism, config, writer_partition, upsert)

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None, config=None,
                                         writer_partition=None):
        return self._put_parallel_from(key, buffer_ptr, size, parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None, config=None,
                                            writer_partition=None):
        return self._put_parallel_from(key, buffer_ptr, size, parallelism, config, writer_partition, True)

    @staticmethod
    def _each(n, many, name):
        many = [None] * n if many is None else list(many)
        if len(many) != n:
            raise ValueError(f"{name} must have one entry per key")
        return many

    def _batch_parallel(self, keys, tensors, parallelisms, config, writer_partitions, upsert):
        keys, tensors = list(keys), list(tensors)
        try:
            ps = self._each(len(keys), parallelisms, "parallelisms")
            ws = self._each(len(keys), writer_partitions, "writer_partitions")
        except ValueError:
            return [_INVALID_PARAMS] * len(keys)
        if len(tensors) != len(keys):
            return [_INVALID_PARAMS] * len(keys)
        return [self._put_parallel(k, t, p, config, w, upsert) for k, t, p, w in zip(keys, tensors, ps, ws)]

    def batch_put_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None, config=None,
                                          writer_partitions=None):
        return self._batch_parallel(keys, tensors_list, parallelisms, config, writer_partitions, False)

    def batch_upsert_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None, config=None,
                                             writer_partitions=None):
        return self._batch_parallel(keys, tensors_list, parallelisms, config, writer_partitions, True)

    def _batch_parallel_from(self, keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, upsert):
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        tensors = [self._tensor_at(p, n) if p and n >= HEADER_SIZE else None for p, n in zip(ptrs, sizes)]
        return self._batch_parallel(keys, tensors, parallelisms, config, writer_partitions, upsert)

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms=None, config=None,
                                               writer_partitions=None):
        return self._batch_parallel_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, False)

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms=None, config=None,
                                                  writer_partitions=None):
        return self._batch_parallel_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, True)

    def _manifest(self, key):
        buf = self.get_buffer(key)
        try:
            return None if buf is None else unpack_manifest(bytes(buf))
        except HeaderError:
            return None

    def _get_parallel(self, key, target):
        """The tensor a ``ReadTarget`` asks for: as stored (``key`` itself), this rank's shard,
        or the full tensor rebuilt from every shard."""
        mode = "as_stored" if target is None else str(getattr(target, "mode", "as_stored")).lower()
        parallelism = None if target is None else getattr(target, "parallelism", None)
        axes = list(getattr(parallelism, "axes", []) or [])
        if mode == "as_stored":
            return self.get_tensor(key) if not axes else None
        if mode == "full":
            # With a parallelism, from the shards of its layout; without, from a writer's parts.
            if not axes:
                return self._rebuild(key, "writer")
            if not _axes_valid(axes):
                return None
            kinds = [a.kind.lower() for a in axes]
            if kinds == ["tp"]:
                return self._rebuild(key, "parallelism")
            if "tp" not in kinds:
                return self.get_tensor(key + _suffix(axes))
            # Several axes: this layout's shards of every tp rank, the others as given.
            i = kinds.index("tp")
            names = []
            for r in range(axes[i].size):
                shard_axes = [copy.copy(a) for a in axes]
                shard_axes[i].rank = r
                names.append(key + _suffix(shard_axes))
            shards = self.batch_get_tensor(names)
            if any(t is None for t in shards):
                return None
            return _torch().cat(shards, dim=axes[i].split_dim)
        if mode != "shard" or not _axes_valid(axes):
            return None
        kinds = [a.kind.lower() for a in axes]
        if kinds == ["tp"]:
            a = axes[0]
            exact = self.get_tensor(_shard_key(key, a.rank))
            m = self._manifest(key + "__parallelism_manifest")
            if m is None or m["count"] == a.size:
                return exact
            # Stored with another shard count: slice this rank's part of the full tensor.
            full = self._rebuild(key, "parallelism")
            parts = None if full is None else _split(full, a.size, a.split_dim)
            return None if parts is None else parts[1][a.rank].contiguous()
        return self.get_tensor(key + _suffix(axes))

    def _rebuild(self, key, kind):
        """The full tensor from the shards a manifest (``parallelism`` or ``writer``) lists."""
        m = self._manifest(f"{key}__{kind}_manifest")
        if m is None:
            return None
        if kind == "writer":
            names = [f"{key}__writer_{r}of{m['count']}_sd{m['split_dim']}" for r in range(m["count"])]
        else:
            names = [_shard_key(key, r) for r in range(m["count"])]
        shards = self.batch_get_tensor(names)
        if any(s is None for s in shards):
            return None
        return _torch().cat(shards, dim=m["split_dim"])

    def get_tensor_with_parallelism(self, key, target=None):
        return self._get_parallel(key, target)

    def get_tensor_with_parallelism_into(self, key, buffer_ptr, size, target=None):
        """``get_tensor_with_parallelism``, laid out [header][data] into ``size`` bytes at
        ``buffer_ptr``; a tensor over the data there, or None."""
        tensor = self._get_parallel(key, target)
        enc = None if tensor is None else _encode(tensor)
        if enc is None or HEADER_SIZE + len(enc.data) > size:
            return None
        ctypes.memmove(buffer_ptr, enc.header, HEADER_SIZE)
        if enc.data:
            ctypes.memmove(buffer_ptr + HEADER_SIZE, enc.data, len(enc.data))
        return _decode(_memory_at(buffer_ptr, HEADER_SIZE + len(enc.data)))

    def batch_get_tensor_with_parallelism(self, keys, targets=None):
        keys = list(keys)
        try:
            targets = self._each(len(keys), targets, "targets")
        except ValueError:
            return [None] * len(keys)
        return [self._get_parallel(k, t) for k, t in zip(keys, targets)]

    def batch_get_tensor_with_parallelism_into(self, keys, buffer_ptrs, sizes, targets=None):
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        try:
            targets = self._each(len(keys), targets, "targets")
        except ValueError:
            return [None] * len(keys)
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, n, t) for k, p, n, t in zip(keys, ptrs, sizes, targets)]

    # ---- files ----

    def save_tensor_to_safetensor(self, key, file_name=None):
        """Writes the tensor under ``key`` to a safetensors file (``file_name``, else the key)
        under the name ``key``: 0; -1100 when no tensor is stored there; -600 when the file
        cannot be written or the ``safetensors`` package is missing."""
        tensor = self.get_tensor(key)
        if tensor is None:
            return _FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: tensor.contiguous()}, file_name or key)
        except Exception:
            return _INVALID_PARAMS
        return 0

    def load_tensor_from_safetensor(self, key=None, file_name=None):
        """Stores the tensor named ``key`` in the safetensors file ``file_name`` (its first
        tensor when it has none of that name) under ``key`` (``file_name`` when not given), and
        returns it; None when the file cannot be read or the store refuses it."""
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor() missing required argument 'file_name'")
        try:
            from safetensors.torch import load_file

            tensors = load_file(file_name)
        except Exception:
            return None
        if not tensors:
            return None
        store_key = key if key is not None else file_name
        tensor = tensors.get(store_key, next(iter(tensors.values())))
        return tensor if self.upsert_tensor(store_key, tensor) == 0 else None

