"""Same-body tests of the rest of the surface: extra segments, host-memory helpers, buffer
pools, and the tensor header (without torch: the header is written here, field by field)."""

import ctypes
import struct

import pytest


def _header(dtype, shape, nbytes, magic=0x4D4F4F4E):
    h = bytearray(304)
    struct.pack_into("<IHHiiIIQQ", h, 0, magic, 1, 304, dtype, len(shape), 0, 0, 304, nbytes)
    pad = list(shape) + [-1] * (8 - len(shape))
    struct.pack_into("<8q", h, 40, *pad)
    struct.pack_into("<8q", h, 104, *pad)
    return bytes(h)


def _put_from_bytes(store, key, data):
    buf = ctypes.create_string_buffer(data, len(data))
    return store.put_tensor_from(key, ctypes.addressof(buf), len(data))


def test_tensor_header_layout(store):
    data = struct.pack("<6f", *range(6))
    h = _header(0, (2, 3), len(data))
    assert _put_from_bytes(store, "tensor", h + data) == 0
    assert bytes(store.get_buffer("tensor")) == h + data
    i64 = struct.pack("<3q", 1, 2, 3)
    h64 = _header(8, (3,), len(i64))
    assert _put_from_bytes(store, "tensor64", h64 + i64) == 0
    assert bytes(store.get_buffer("tensor64")) == h64 + i64


def test_bad_tensor_headers_are_refused(store):
    data = struct.pack("<6f", *range(6))
    assert _put_from_bytes(store, "bad-magic", _header(0, (2, 3), len(data), magic=0x12345678) + data) == -600
    assert _put_from_bytes(store, "bad-size", _header(0, (2, 3), len(data) + 4) + data) == -600
    assert _put_from_bytes(store, "bad-dtype", _header(99, (2, 3), len(data)) + data) == -600
    assert _put_from_bytes(store, "short", _header(0, (2, 3), len(data))[:200]) == -600
    for k in ("bad-magic", "bad-size", "bad-dtype", "short"):
        assert store.is_exist(k) == 0


def test_cuda_reads_without_cuda(store):
    assert store.get_tensor_into_cuda("k", None) == -600
    assert store.batch_get_tensor_into_cuda(["a", "b"], [None, None]) == [-600, -600]


def test_extra_segments(store, tmp_path):
    r = store.allocate_and_mount_segment(16 << 20)
    assert r["ret"] == 0 and r["allocated_size"] == 16 << 20 and len(r["segment_ids"]) == 1
    assert store.allocate_and_mount_segment(0) == {"ret": -1, "segment_ids": [], "allocated_size": 0}
    assert store.unmount_and_free_segment(r["segment_ids"]) == 0
    assert store.unmount_and_free_segment(r["segment_ids"]) == -1
    assert store.unmount_segment(["bogus"]) == -1
    assert store.unmount_segment([]) == 0
    path = tmp_path / "seg"
    with open(path, "wb") as f:
        f.truncate(32 << 20)
    m = store.mount_segment(str(path), 16 << 20, 0)
    assert m["ret"] == 0 and len(m["segment_ids"]) == 1
    assert store.mount_segment(str(path), 64 << 20, 0) == {"ret": -1, "segment_ids": []}
    assert store.mount_segment(str(path), 4 << 20, 100) == {"ret": -1, "segment_ids": []}
    assert store.mount_segment(str(tmp_path / "none"), 4 << 20, 0) == {"ret": -1, "segment_ids": []}
    assert store.unmount_segment(m["segment_ids"] + ["bogus"]) == -1
    assert store.unmount_local_disk_segment() == 0


def test_host_memory_helpers(store, mc):
    assert store.get_offload_rpc_read_count() == 0
    assert store.init_all("tcp", "", 16 << 20) == -600
    assert isinstance(mc.get_alloc_func_addr(), int) and mc.get_alloc_func_addr()
    assert isinstance(mc.get_free_func_addr(), int) and mc.get_free_func_addr()
    d = mc.Descriptor()
    assert (d.size, d.buffer_address, d.transport_endpoint) == (0, 0, "")
    with pytest.raises(TypeError):
        mc.DiskDescriptor()


def test_buffer_pool_conventions(store, mc):
    assert mc.RegisteredBufferPool is mc.BufferPool
    assert mc.RegisteredBufferLease is mc.BufferLease
    pool = mc.BufferPool(store)
    lease = pool.acquire(100)
    assert lease.size == 100 and isinstance(lease.buffer, memoryview) and len(lease.buffer) == 100
    assert not lease.buffer.readonly
    with pytest.raises(RuntimeError, match="cannot close buffer pool with active leases"):
        pool.close()
    lease.release()
    lease.release()
    with pytest.raises(RuntimeError, match="buffer lease is closed"):
        lease.ptr
    assert lease.size == 100
    with pool.buffer(0) as z:
        assert z.size == 0 and len(z.buffer) == 0
    with pytest.raises(RuntimeError, match="requested buffer size exceeds pool capacity"):
        pool.acquire(1 << 40)
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="buffer pool is closed"):
        pool.acquire(10)
    with pytest.raises(RuntimeError, match="alignment must be a power of two"):
        mc.BufferPool(store, alignment=3)
