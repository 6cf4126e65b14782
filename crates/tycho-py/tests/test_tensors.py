"""Tensor methods with a real torch (skipped where torch is not installed: scripts/test-clients
runs them in its environment, which has torch)."""

import ctypes

import pytest

from tycho import _tensors
from tycho.store import ParallelAxis, ReadTarget, ReplicateConfig, TensorParallelism

torch = pytest.importorskip("torch")

DTYPES = [torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32,
          torch.uint32, torch.int64, torch.uint64, torch.bool, torch.float16, torch.bfloat16,
          torch.float8_e4m3fn, torch.float8_e5m2]


def _sample(dtype, shape=(3, 5)):
    t = torch.arange(15, dtype=torch.float32).reshape(shape) - 7
    return (t > 0) if dtype == torch.bool else t.abs().to(dtype) if dtype.is_floating_point is False else t.to(dtype)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype in (
        torch.float8_e4m3fn, torch.float8_e5m2) else a, b.view(torch.uint8) if b.dtype in (
        torch.float8_e4m3fn, torch.float8_e5m2) else b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(store, dtype):
    t = _sample(dtype)
    assert store.put_tensor(f"t-{dtype}", t) == 0
    back = store.get_tensor(f"t-{dtype}")
    assert _same(back, t)
    h = _tensors.unpack_header(bytes(store.get_buffer(f"t-{dtype}")))
    assert h["dtype"] == DTYPES.index(dtype) and h["shape"] == (3, 5) and h["layout"] == 0


def test_shapes_and_refusals(store):
    assert store.put_tensor("scalar", torch.tensor(5, dtype=torch.int64)) == 0
    assert store.get_tensor("scalar").shape == (1,), "a scalar is stored as shape (1,)"
    assert store.put_tensor("empty", torch.zeros((0, 3))) == 0
    assert store.get_tensor("empty").shape == (0, 3)
    strided = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    assert store.put_tensor("strided", strided) == 0
    assert torch.equal(store.get_tensor("strided"), strided)
    assert store.put_tensor("complex", torch.zeros(2, dtype=torch.complex64)) == -600
    assert store.put_tensor("deep", torch.zeros((1,) * 9)) == -600
    assert store.put_tensor("not", [1, 2]) == -600
    assert store.get_tensor("missing") is None
    assert store.put("raw", b"not a tensor") == 0
    assert store.get_tensor("raw") is None


def test_put_keeps_upsert_replaces(store):
    a, b = torch.ones(4), torch.zeros((2, 2), dtype=torch.int16)
    assert store.put_tensor("k", a) == 0
    assert store.put_tensor("k", b) == 0
    assert torch.equal(store.get_tensor("k"), a)
    assert store.upsert_tensor("k", b) == 0
    assert torch.equal(store.get_tensor("k"), b)
    cfg = ReplicateConfig()
    assert store.pub_tensor("p", a, cfg) == 0 and store.upsert_pub_tensor("p", b, cfg) == 0
    assert torch.equal(store.get_tensor("p"), b)


def test_batches_and_buffers(store):
    ts = [torch.randn(8, 8), torch.arange(10), torch.ones(3, dtype=torch.bfloat16)]
    keys = ["b0", "b1", "b2"]
    assert store.batch_put_tensor(keys, ts) == [0, 0, 0]
    assert all(_same(x, y) for x, y in zip(store.batch_get_tensor(keys), ts))
    assert store.batch_put_tensor(keys, ts[:2]) == [-600] * 3
    assert store.batch_upsert_tensor(keys, list(reversed(ts))) == [0, 0, 0]
    assert _same(store.batch_get_tensor(["b0"])[0], ts[2])
    assert store.batch_get_tensor(["b0", "nope"])[1] is None
    # Into caller memory: registered or not, the tensor views that memory.
    size = 1 << 16
    reg = ctypes.create_string_buffer(size)
    assert store.register_buffer(ctypes.addressof(reg), size) == 0
    plain = ctypes.create_string_buffer(size)
    for buf in (reg, plain):
        got = store.get_tensor_into("b1", ctypes.addressof(buf), size)
        assert _same(got, ts[1])
        assert got.data_ptr() == ctypes.addressof(buf) + 304
    assert store.get_tensor_into("b1", ctypes.addressof(plain), 100) is None, "too small"
    assert store.get_tensor_into("nope", ctypes.addressof(plain), size) is None
    out = store.batch_get_tensor_into(["b1", "b2"], [ctypes.addressof(reg), ctypes.addressof(plain)], [size, size])
    assert _same(out[0], ts[1]) and _same(out[1], ts[0])
    # A buffer laid out [header][data] goes back in with put_tensor_from.
    assert store.put_tensor_from("again", ctypes.addressof(reg), 304 + 10 * 8) == 0
    assert _same(store.get_tensor("again"), ts[1])
    assert store.batch_put_tensor_from(["a1", "a2"], [ctypes.addressof(reg)] * 2, [384, 384]) == [0, 0]
    assert store.unregister_buffer(ctypes.addressof(reg)) == 0


def test_tensor_parallel_shards(store):
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    assert store.put_tensor_with_tp("w", full, tp_size=4, split_dim=0) == 0
    for r in range(4):
        shard = store.get_tensor_with_tp("w", tp_rank=r, tp_size=4)
        assert torch.equal(shard, full[2 * r:2 * r + 2])
        h = _tensors.unpack_header(bytes(store.get_buffer(f"w_tp_{r}")))
        assert h["layout"] == 1 and h["global_shape"] == (8, 4) and h["axes"][0][2:4] == (r, 4)
    assert store.put_tensor_with_tp("odd", full, tp_size=3, split_dim=0) == -600
    assert store.is_exist("odd_tp_0") == 0
    assert store.get_tensor_with_tp("w", tp_rank=0, tp_size=1) is None, "tp_size 1 reads the key itself"
    assert store.batch_put_tensor_with_tp(["x", "y"], [full, full], tp_size=2, split_dim=1) == [0, 0]
    got = store.batch_get_tensor_with_tp(["x", "y"], tp_rank=1, tp_size=2)
    assert all(torch.equal(g, full[:, 2:]) for g in got)
    assert store.pub_tensor_with_tp("z", full, ReplicateConfig(), tp_size=2) == 0
    assert torch.equal(store.get_tensor("z_tp_1"), full[4:])


def test_parallel_layouts(store):
    full = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    for r in range(2):
        p = TensorParallelism()
        a = ParallelAxis()
        a.kind, a.rank, a.size, a.split_dim = "tp", r, 2, 1
        p.axes = [a]
        assert store.put_tensor_with_parallelism("m", full[:, 3 * r:3 * r + 3].contiguous(), p) == 0
    target = ReadTarget()
    target.mode = "full"
    target.parallelism = p
    assert torch.equal(store.get_tensor_with_parallelism("m", target), full)
    target.mode = "shard"
    assert torch.equal(store.get_tensor_with_parallelism("m", target), full[:, 3:])
    # Read as three shards although written as two.
    a3 = ParallelAxis()
    a3.kind, a3.rank, a3.size, a3.split_dim = "tp", 2, 3, 1
    p3 = TensorParallelism()
    p3.axes = [a3]
    target.parallelism = p3
    assert torch.equal(store.get_tensor_with_parallelism("m", target), full[:, 4:])

    class Part:
        rank, size, split_dim = 0, 2, 0

    assert store.put_tensor_with_parallelism("wp", full, writer_partition=Part()) == 0
    whole = ReadTarget()
    whole.mode = "full"
    assert torch.equal(store.get_tensor_with_parallelism("wp", whole), full)
    assert store.get_tensor_with_parallelism("wp") is None, "as stored: nothing under the key itself"
    assert store.put_tensor_with_parallelism("both", full, p, writer_partition=Part()) == -600
    dp = ParallelAxis()
    dp.kind, dp.rank, dp.size = "dp", 1, 2
    pd = TensorParallelism()
    pd.axes = [dp]
    assert store.put_tensor_with_parallelism("d", full, pd) == 0
    assert torch.equal(store.get_tensor("d__dp_1of2"), full)
    buf = ctypes.create_string_buffer(4096)
    got = store.get_tensor_with_parallelism_into("wp", ctypes.addressof(buf), 4096, whole)
    assert torch.equal(got, full)


def test_safetensors_files(store, tmp_path):
    pytest.importorskip("safetensors")
    t = torch.randn(3, 4)
    assert store.put_tensor("s", t) == 0
    path = str(tmp_path / "s.safetensors")
    assert store.save_tensor_to_safetensor("s", path) == 0
    assert store.save_tensor_to_safetensor("missing", path) == -1100
    back = store.load_tensor_from_safetensor("s2", path)
    assert torch.equal(back, t) and torch.equal(store.get_tensor("s2"), t)
    assert store.load_tensor_from_safetensor("x", str(tmp_path / "none")) is None


def test_cuda_variants_say_no(store):
    assert store.get_tensor_into_cuda("k", torch.zeros(1)) == -600
    assert store.batch_get_tensor_into_cuda(["k"], [torch.zeros(1)]) == [-600]


def test_the_remaining_variants(store):
    """Each variant not exercised above, once: the *_from, upsert and batch forms."""
    full = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    other = torch.ones(2, 2, dtype=torch.int64)
    size = 1 << 12
    buf = ctypes.create_string_buffer(size)
    assert store.put_tensor("src", full) == 0
    assert store.get_tensor_into("src", ctypes.addressof(buf), size) is not None  # buf: [header][full]
    n = 304 + full.numel() * 4
    addr = ctypes.addressof(buf)
    cfg = ReplicateConfig()
    assert store.batch_pub_tensor(["bp"], [full], cfg) == [0]
    assert store.batch_upsert_pub_tensor(["bp"], [other], cfg) == [0]
    assert torch.equal(store.get_tensor("bp"), other)
    assert store.upsert_tensor_from("bp", addr, n) == 0 and torch.equal(store.get_tensor("bp"), full)
    assert store.batch_upsert_tensor_from(["bp", "bq"], [addr, addr], [n, n]) == [0, 0]
    assert store.put_tensor_with_tp_from("tf", addr, n, tp_size=2, split_dim=1) == 0
    assert torch.equal(store.get_tensor("tf_tp_1"), full[:, 2:])
    assert store.batch_put_tensor_with_tp_from(["tg"], [addr], [n], tp_size=2) == [0]
    out = ctypes.create_string_buffer(size)
    got = store.get_tensor_with_tp_into("tg", ctypes.addressof(out), size, tp_rank=1, tp_size=2)
    assert torch.equal(got, full[2:])
    got = store.batch_get_tensor_with_tp_into(["tg", "tf"], [ctypes.addressof(out)] * 2, [size] * 2, 0, 2)
    assert torch.equal(got[1], full[:, :2])
    assert store.batch_pub_tensor_with_tp(["th"], [full], cfg, 0, 4, 0) == [0]
    assert torch.equal(store.get_tensor("th_tp_3"), full[3:])

    def tp(rank, size, dim):
        a = ParallelAxis()
        a.kind, a.rank, a.size, a.split_dim = "tp", rank, size, dim
        p = TensorParallelism()
        p.axes = [a]
        return p

    assert store.put_tensor_with_parallelism_from("pf", addr, n, tp(0, 2, 0)) == 0
    assert store.upsert_tensor_with_parallelism("pf", full, tp(1, 2, 0)) == 0
    assert store.upsert_tensor_with_parallelism_from("pf", addr, n, tp(0, 2, 0)) == 0
    t = ReadTarget()
    t.mode, t.parallelism = "full", tp(0, 2, 0)
    assert torch.equal(store.get_tensor_with_parallelism("pf", t), torch.cat([full, full]))
    assert store.batch_put_tensor_with_parallelism(["b1", "b2"], [full, full], [tp(0, 1, 0), None]) == [0, 0]
    assert store.batch_upsert_tensor_with_parallelism(["b2"], [other]) == [0]
    assert store.batch_put_tensor_with_parallelism_from(["b3"], [addr], [n]) == [0]
    assert store.batch_upsert_tensor_with_parallelism_from(["b3"], [addr], [n], [tp(0, 1, 1)]) == [0]
    got = store.batch_get_tensor_with_parallelism(["b2", "b3"])
    assert torch.equal(got[0], other) and torch.equal(got[1], full)
    got = store.batch_get_tensor_with_parallelism_into(["b2"], [ctypes.addressof(out)], [size])
    assert torch.equal(got[0], other)
    assert store.batch_put_tensor_with_parallelism(["x"], [full], [None, None]) == [-600]
