"""SGLang HiCache's Mooncake backend (`MooncakeStore`, unmodified, from PyPI `sglang`) on Tycho.

`mooncake.store` is Tycho's, through the opt-in shim in clients/shim (scripts/test-clients puts it
on PYTHONPATH). Three checks against a real `tycho master`:

1. SGLang's own shipped test, `sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py`,
   run as SGLang runs it (its `__main__`), unchanged;
2. pages written by one process through `MooncakeStore.batch_set_v1` are read back byte for byte by
   a second process through `batch_get_v1`, for the MHA layout (two buffers per page: the
   multi-buffer calls) and the MLA layout (one buffer per page);
3. the shim really is what answered (not some real Mooncake on the path).
"""

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIM = ROOT / "clients" / "shim"


# The ``master`` fixture (a fresh ``tycho master`` per test) comes from clients/conftest.py.


def mooncake_env(master_addr):
    """What SGLang reads to build its MooncakeStoreConfig (its `load_from_env`)."""
    env = dict(os.environ)
    env.update({
        "MOONCAKE_MASTER": master_addr,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_DEVICE": "",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(256 << 20),
        "PYTHONPATH": os.pathsep.join([str(SHIM), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    })
    return env


def test_the_shim_answers_for_mooncake():
    import mooncake.store
    import tycho.store

    assert Path(mooncake.store.__file__).resolve().parent == (SHIM / "mooncake").resolve()
    assert mooncake.store.MooncakeDistributedStore is tycho.store.MooncakeDistributedStore


def test_sglang_shipped_mooncake_store_test(master):
    import sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store as shipped

    r = subprocess.run([sys.executable, shipped.__file__], env=mooncake_env(master.addr),
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    print(out[-4000:])
    assert r.returncode == 0, out[-4000:]
    assert "All tests passed" in out
    assert out.count("Batch operation passed") == 4


# The worker both processes run: build SGLang's MooncakeStore over a mock host KV pool (the one
# SGLang's own test uses), then write or read pages and print one sha256 per key.
WORKER = r'''
import hashlib, json, sys, torch
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore
from sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store import (
    create_mock_host_kv_cache, make_hicache_storage_config)

mode, mla, keys = sys.argv[1], sys.argv[2] == "mla", json.loads(sys.argv[3])
entries = 1 if mla else 2
elements = 256
store = MooncakeStore(make_hicache_storage_config(is_mla_model=mla, tp_rank=0, tp_size=1))
host, buf = create_mock_host_kv_cache(1 << 20, entries_per_page=entries, page_elements=elements)
store.register_mem_pool_host(host)
n = len(keys)

def digests(first_page):
    out = []
    for i in range(n):
        page = buf[(first_page + i) * entries * elements:(first_page + i + 1) * entries * elements]
        out.append(hashlib.sha256(page.contiguous().numpy().tobytes()).hexdigest())
    return out

if mode == "write":
    torch.manual_seed(7)
    buf[: n * entries * elements] = torch.randn(n * entries * elements)
    assert all(store.batch_set_v1(keys, torch.arange(n))), "batch_set_v1 failed"
    print(json.dumps(digests(0)), flush=True)
    sys.stdin.readline()  # keep this store (and the segment holding the pages) until told
else:
    assert store.batch_exists(keys) == n, "not every key exists"
    buf.zero_()
    ok = store.batch_get_v1(keys, torch.arange(n, 2 * n))
    assert all(ok), f"batch_get_v1: {ok}"
    print(json.dumps(digests(n)), flush=True)
'''


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_pages_written_by_one_process_are_read_by_another(master, layout, tmp_path):
    keys = [f"sglang-{layout}-{i}-{time.monotonic_ns()}" for i in range(9)]
    env = mooncake_env(master.addr)
    # The writer's log goes to a file: a pipe nobody reads could fill and stall it.
    writer_log = open(tmp_path / "writer.log", "w+")
    writer = subprocess.Popen([sys.executable, "-c", WORKER, "write", layout, json.dumps(keys)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=writer_log, text=True)
    try:
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in writer.stdout] + [lines.put(None)], daemon=True).start()
        written = None
        deadline = time.monotonic() + 300
        while written is None:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, "writer exited: " + (tmp_path / "writer.log").read_text()[-3000:]
            if line.startswith("["):
                written = json.loads(line)
        reader = subprocess.run([sys.executable, "-c", WORKER, "read", layout, json.dumps(keys)], env=env,
                                capture_output=True, text=True, timeout=300)
        assert reader.returncode == 0, reader.stderr[-3000:]
        read = json.loads([l for l in reader.stdout.splitlines() if l.startswith("[")][-1])
        assert read == written
        assert len(set(written)) == len(keys), "pages should differ"
    finally:
        writer.stdin.close()
        try:
            writer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
        writer_log.close()


# SGLang's standalone-storage mode: the SGLang process runs a dummy client (setup_dummy) over
# host memory from MooncakeHostTensorAllocator, attached to a long-running `tycho node` that holds
# the store's memory, so the pages outlive the SGLang process.
STANDALONE_WORKER = r'''
import hashlib, json, sys, torch
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
    MooncakeHostTensorAllocator, MooncakeStore)
from sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store import make_hicache_storage_config

mode, keys = sys.argv[1], json.loads(sys.argv[2])
entries, elements, n = 2, 256, len(keys)

class HostPool:
    """A page-first host KV pool over memory from SGLang's Mooncake allocator."""
    def __init__(self, pages):
        self.allocator = MooncakeHostTensorAllocator()
        self.kv_buffer = self.allocator.allocate((pages * entries * elements,), torch.float32)
        self.layout, self.page_size = "page_first", 1
    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for idx in indices:
            for e in range(entries):
                ptrs.append(self.kv_buffer[(int(idx) * entries + e) * elements:].data_ptr())
                sizes.append(elements * 4)
        return ptrs, sizes
    def get_ksize_per_token(self):
        return entries * elements * 4

host = HostPool(2 * n)
store = MooncakeStore(make_hicache_storage_config(is_mla_model=False, tp_rank=0, tp_size=1), host)
assert store.config.standalone_storage, "not in standalone mode"
store.register_mem_pool_host(host)
buf = host.kv_buffer

def digests(first_page):
    return [hashlib.sha256(buf[(first_page + i) * entries * elements:(first_page + i + 1) * entries * elements]
                           .contiguous().numpy().tobytes()).hexdigest() for i in range(n)]

if mode == "write":
    torch.manual_seed(11)
    buf[: n * entries * elements] = torch.randn(n * entries * elements)
    assert all(store.batch_set_v1(keys, torch.arange(n))), "batch_set_v1 failed"
else:
    assert store.batch_exists(keys) == n, "not every key exists"
    buf.zero_()
    ok = store.batch_get_v1(keys, torch.arange(n, 2 * n))
    assert all(ok), f"batch_get_v1: {ok}"
print(json.dumps(digests(0 if mode == "write" else n)), flush=True)
'''


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_standalone_storage_through_a_tycho_node(master, tmp_path):
    port = _free_port()
    node_log = open(tmp_path / "node.log", "w+")
    node = subprocess.Popen([os.environ["TYCHO_BIN"], "node", "--master", master.addr, "--segment-size", "256MB",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=node_log, text=True)
    try:
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in node.stdout] + [lines.put(None)], daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            assert line is not None, "the node did not start: " + (tmp_path / "node.log").read_text()[-3000:]
            if "attach with setup_dummy" in line:
                break
        env = mooncake_env(master.addr)
        env.update({"MOONCAKE_STANDALONE_STORAGE": "1", "MOONCAKE_CLIENT": f"127.0.0.1:{port}"})
        keys = [f"standalone-{i}-{time.monotonic_ns()}" for i in range(9)]
        runs = []
        # The writer exits before the reader starts: the pages live in the node.
        for mode in ("write", "read"):
            r = subprocess.run([sys.executable, "-c", STANDALONE_WORKER, mode, json.dumps(keys)], env=env,
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            runs.append(json.loads([l for l in r.stdout.splitlines() if l.startswith("[")][-1]))
        assert runs[0] == runs[1]
        assert len(set(runs[0])) == len(keys), "pages should differ"
    finally:
        node.terminate()
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
        node_log.close()
