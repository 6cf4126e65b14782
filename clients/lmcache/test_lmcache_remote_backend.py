"""End-to-end: LMCache's own ``RemoteBackend`` over ``mooncakestore://``, on a real Tycho master.

Nothing in LMCache is patched or subclassed. The test builds the same objects an LMCache worker
builds for a remote tier (``LMCacheEngineConfig``, ``LMCacheMetadata``, ``LocalCPUBackend``, an
asyncio loop on its own thread, ``RemoteBackend``), and ``RemoteBackend`` creates LMCache's
``MooncakestoreConnector``, which does ``from mooncake.store import MooncakeDistributedStore``.
With ``clients/shim`` on PYTHONPATH that import answers with ``tycho.store``.

Both connector modes run (``extra_config["save_chunk_meta"]``):

* True  - each chunk is stored as LMCache's RemoteMetadata header + the KV bytes with
          ``put_parts`` and read back with ``batch_get_buffer``;
* False - zero-copy: the LocalCPUBackend's host arena is ``register_buffer``-ed, chunks are
          written with ``batch_put_from`` / ``put_from`` and read with ``batch_get_into``.

Per mode: put seeded random KV chunks (one of them a partial chunk) through
``batched_submit_put_task`` and ``submit_put_task``, check ``contains`` / ``batched_contains``,
read them back with ``batched_get_blocking`` and compare bytes, then have a second process
(this file run as a script) build its own RemoteBackend against the same master and report
sha256 hashes of what it reads, while the writer stays alive (its segment holds the bytes).

Runs on CPU only. Opt-in: needs TYCHO_BIN (the ``tycho`` binary), and ``mooncake.store`` resolving
to ``tycho.store``::

    cd /work/main && PYTHONPATH=clients/shim TYCHO_BIN=target/debug/tycho \\
        target/clients-env/bin/python -m pytest -q -p no:cacheprovider clients/lmcache -x
"""

import asyncio
import concurrent.futures
import hashlib
import json
import os
import random
import subprocess
import sys
import threading

import pytest

import torch  # noqa: E402

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

# --- The fake model -------------------------------------------------------------------------
# Small enough that a chunk is 16 KiB: 4 layers, 2 KV heads of size 32, 16-token chunks, bf16.
MODEL_NAME = "tycho-e2e/fake-llm"
NUM_LAYERS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 32
CHUNK_TOKENS = 16
KV_DTYPE = torch.bfloat16

# The chunks each test writes: (number of tokens, how it is submitted). The last one is a
# partial chunk, as LMCache writes for the tail of a prompt when save_unfull_chunk is on.
CHUNK_PLAN = [
    (CHUNK_TOKENS, "batched"),
    (CHUNK_TOKENS, "batched"),
    (CHUNK_TOKENS, "batched"),
    (CHUNK_TOKENS, "batched"),
    (CHUNK_TOKENS, "single"),
    (CHUNK_TOKENS // 2, "single"),
]
SEED = 20240611

# --- Bounds on every wait ---------------------------------------------------------------------
OP_TIMEOUT = 30  # any single backend call (connect, put batch, contains, get, close)
READER_TIMEOUT = 240  # the second process, including its torch + lmcache imports
TRANSFER_TIMEOUT = 5  # LMCache's own per-put timeout (extra_config["transfer_timeout"])
BLOCKING_TIMEOUT = 15  # LMCache's own bound on batched_get_blocking (blocking_timeout_secs)

# Arena sizes (bytes); all far above what 6 x 16 KiB chunks need.
SEGMENT_BYTES = 64 * 1024 * 1024  # the Tycho segment each client contributes
LOCAL_BUFFER_BYTES = 64 * 1024 * 1024  # the client's transfer buffer
LOCAL_CPU_GB = 64 / 1024  # LocalCPUBackend's host arena: 64 MiB (the config is in GB)


def bounded(what, fn, *args, timeout=OP_TIMEOUT, **kwargs):
    """Run ``fn(*args, **kwargs)`` on a daemon thread and return its result, or raise a
    TimeoutError naming ``what`` if it has not returned within ``timeout`` seconds.

    Several LMCache calls wait without a bound (``RemoteBackend.contains`` and ``close`` call
    ``future.result()``; the connector's ``store.setup`` blocks on the network), so every call
    into LMCache goes through here. A hung call leaves its daemon thread behind, which does not
    keep the interpreter from exiting."""
    done = threading.Event()
    outcome = {}

    def run():
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller below
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"bounded: {what}", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"{what} did not return within {timeout} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# --- Building LMCache's objects -------------------------------------------------------------


def build_config(master_addr, save_chunk_meta):
    """The engine config of a worker with a remote tier only (no hot CPU cache), pointed at
    the Tycho master. The Mooncake settings go in extra_config, as LMCache documents for
    ``mooncakestore://``; the connector forwards the setup keys to ``store.setup(dict)`` and
    keeps ``transfer_timeout`` and ``save_chunk_meta`` for itself."""
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS,
        local_cpu=False,  # the LocalCPUBackend only allocates; no hot cache in front
        max_local_cpu_size=LOCAL_CPU_GB,
        remote_url=f"mooncakestore://{master_addr}",
        remote_serde="naive",  # bytes go to the store as they are
        save_unfull_chunk=True,
        blocking_timeout_secs=BLOCKING_TIMEOUT,
        extra_config={
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": SEGMENT_BYTES,
            "local_buffer_size": LOCAL_BUFFER_BYTES,
            "protocol": "tcp",
            "device_name": "",
            "master_server_address": master_addr,
            "transfer_timeout": TRANSFER_TIMEOUT,
            "save_chunk_meta": save_chunk_meta,
        },
    )


def build_metadata():
    """Metadata of the fake model for a single worker (world_size 1). kv_shape is LMCache's
    (num_layers, 2, chunk_size, num_kv_heads, head_size)."""
    return LMCacheMetadata(
        model_name=MODEL_NAME,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=KV_DTYPE,
        kv_shape=(NUM_LAYERS, 2, CHUNK_TOKENS, NUM_KV_HEADS, HEAD_SIZE),
        chunk_size=CHUNK_TOKENS,
    )


def cache_key(chunk_hash):
    """The key LMCache would compute for this chunk of the fake model on worker 0."""
    return CacheEngineKey(MODEL_NAME, 1, 0, chunk_hash, KV_DTYPE)


def chunk_hashes(n, seed):
    """n distinct chunk hashes (LMCache uses prefix hashes; any distinct ints do here)."""
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(n)]


def sha256_of(memory_obj):
    return hashlib.sha256(bytes(memory_obj.byte_array)).hexdigest()


class LMCacheWorkerSide:
    """What one LMCache worker holds for its remote tier: a LocalCPUBackend (LMCache's
    allocator for KV chunks; on CPU its "pinned" arena is a plain page-aligned host buffer from
    LMCache's CPU device ops, which the zero-copy mode registers with the store), an asyncio
    loop on a background thread (RemoteBackend schedules every connector coroutine on it) and
    the RemoteBackend itself, which creates the Mooncake connector from ``remote_url``."""

    def __init__(self, master_addr, save_chunk_meta):
        self.config = build_config(master_addr, save_chunk_meta)
        self.metadata = build_metadata()
        self.local_cpu = LocalCPUBackend(self.config, self.metadata)
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(
            target=self.loop.run_forever, name="lmcache-remote-loop", daemon=True
        )
        self.loop_thread.start()
        self.remote = None
        self.connector = None
        # False while a RemoteBackend constructor may still be running on a timed-out thread
        # (it could register the arena with a store at any moment), so close() leaves the
        # arena alone.
        self._arena_free_ok = True
        try:
            try:
                self.remote = bounded(
                    "RemoteBackend(...) (connector creation and store.setup)",
                    RemoteBackend,
                    self.config,
                    self.metadata,
                    self.loop,
                    self.local_cpu,
                )
            except TimeoutError:
                self._arena_free_ok = False
                raise
            # RemoteBackend logs and swallows a failed connector creation, leaving no
            # connection behind; every later call would then quietly answer False / None.
            if self.remote.connection is None:
                raise AssertionError(
                    "RemoteBackend could not create its mooncakestore connector "
                    "(see the LMCache warning 'Failed to initialize/re-establish remote "
                    "connection' in the captured log)"
                )
            # The connector under LMCache's InstrumentedRemoteConnector wrapper.
            self.connector = self.remote.connection.getWrappedConnector()
            # LMCache ignores the code store.setup() returns, so a store that never joined
            # the cluster would only show up later as misses. Ask the store itself (Mooncake's
            # health_check: 0 usable, 1 not set up / closed, 2 master unreachable).
            health = bounded("store.health_check()", self.connector.store.health_check)
            if health != 0:
                raise AssertionError(
                    f"the connector's store is not usable after setup against {master_addr}: "
                    f"health_check() = {health} (1: not set up, 2: master unreachable)"
                )
        except BaseException:
            try:
                self.close()
            except BaseException:
                pass  # the construction error is the one worth reporting
            raise

    def close(self):
        """Close the store (unregister the arena, leave the cluster), stop the loop, then free
        the arena. Each step is bounded; the arena is only freed once the store that had it
        registered is closed."""
        store_closed = self.remote is None or self.remote.connection is None
        errors = []
        if not store_closed:
            try:
                # RemoteBackend.close -> connector.close -> unregister_buffer + store.close
                bounded("RemoteBackend.close()", self.remote.close)
                store_closed = True
            except BaseException as e:
                errors.append(e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(OP_TIMEOUT)
        if self.loop_thread.is_alive():
            errors.append(TimeoutError(f"the LMCache loop did not stop within {OP_TIMEOUT} s"))
        else:
            self.loop.close()
        if store_closed and self._arena_free_ok:
            bounded("LocalCPUBackend.close()", self.local_cpu.close)
        if errors:
            raise errors[0]


# --- The second process ---------------------------------------------------------------------


def reader_main(spec):
    """Runs in a separate process: its own RemoteBackend (same mode, same master) reads the
    given keys. Prints one JSON line to stdout (LMCache logs to stderr):
    {"store_module", "save_chunk_meta", "contains", "batched_contains", "chunks"} where chunks
    holds, per key, null or {"sha256", "nbytes", "shape"}."""
    side = LMCacheWorkerSide(spec["master"], spec["save_chunk_meta"])
    try:
        keys = [cache_key(h) for h in spec["chunk_hashes"]]
        # As returned: the connector passes is_exist's int through (1 yes, 0 no, <0 error).
        contains = [bounded("RemoteBackend.contains", side.remote.contains, k) for k in keys]
        batched = bounded("RemoteBackend.batched_contains", side.remote.batched_contains, keys)
        objs = bounded(
            "RemoteBackend.batched_get_blocking", side.remote.batched_get_blocking, keys
        )
        chunks = []
        for obj in objs:
            if obj is None:
                chunks.append(None)
                continue
            chunks.append(
                {
                    "sha256": sha256_of(obj),
                    "nbytes": obj.get_size(),
                    "shape": list(obj.meta.shape),
                }
            )
            obj.ref_count_down()  # hand the buffer back to the allocator
        result = {
            "store_module": type(side.connector.store).__module__,
            "save_chunk_meta": side.connector.save_chunk_meta,
            "contains": contains,
            "batched_contains": batched,
            "chunks": chunks,
        }
    finally:
        side.close()
    print(json.dumps(result), flush=True)


# --- Fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _requirements():
    """Skip (with the reason) unless the test was opted into and mooncake.store is Tycho."""
    if not os.environ.get("TYCHO_BIN"):
        pytest.fail("set TYCHO_BIN to the tycho binary (scripts/test-clients does)")
    if not os.access(os.environ["TYCHO_BIN"], os.X_OK):
        pytest.fail(f"TYCHO_BIN={os.environ['TYCHO_BIN']} is not an executable")
    try:
        import mooncake.store as mooncake_store
    except ImportError:
        pytest.fail("mooncake.store is not importable: put clients/shim on PYTHONPATH")
    import tycho.store

    if mooncake_store.MooncakeDistributedStore is not tycho.store.MooncakeDistributedStore:
        pytest.fail(
            f"mooncake.store is {mooncake_store.__file__}, not Tycho's shim: "
            "put clients/shim first on PYTHONPATH"
        )


# The ``master`` fixture (a fresh ``tycho master`` per test) comes from clients/conftest.py.


# --- The test -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "save_chunk_meta",
    [True, False],
    ids=["save_chunk_meta=True", "save_chunk_meta=False(zero-copy)"],
)
def test_remote_backend_round_trip(master, save_chunk_meta):
    writer = LMCacheWorkerSide(master.addr, save_chunk_meta)
    sources = []  # the memory objects this test allocated; released at the end
    try:
        conn = writer.connector

        # The backend really is LMCache's Mooncake connector, on Tycho, in the asked mode.
        assert type(conn).__name__ == "MooncakestoreConnector", type(conn)
        assert type(conn.store).__module__.startswith("tycho"), type(conn.store)
        assert conn.save_chunk_meta is save_chunk_meta
        # The connector registers the allocator's host arena in both modes; the zero-copy
        # mode needs it (put_from / batch_get_into take pointers into it).
        arena = writer.local_cpu.memory_allocator.pin_allocator.buffer
        assert conn.registered_buffer_ptr == arena.data_ptr(), (
            "register_buffer of the LocalCPUBackend arena failed (see the LMCache log)"
        )

        # KV chunks with seeded random contents, allocated where LMCache allocates them.
        hashes = chunk_hashes(len(CHUNK_PLAN) + 1, SEED)
        missing_key = cache_key(hashes.pop())  # never written
        keys = [cache_key(h) for h in hashes]
        gen = torch.Generator().manual_seed(SEED)
        for num_tokens, _ in CHUNK_PLAN:
            obj = writer.local_cpu.allocate(
                writer.metadata.get_shapes(num_tokens), writer.metadata.get_dtypes()
            )
            assert obj is not None, "LocalCPUBackend.allocate returned None"
            sources.append(obj)
            obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(KV_DTYPE))
        source_sha = [sha256_of(o) for o in sources]
        source_sizes = [o.get_size() for o in sources]
        assert source_sizes[0] == 2 * NUM_LAYERS * CHUNK_TOKENS * NUM_KV_HEADS * HEAD_SIZE * 2

        # Put, through both of RemoteBackend's put paths.
        batched = [i for i, (_, how) in enumerate(CHUNK_PLAN) if how == "batched"]
        single = [i for i, (_, how) in enumerate(CHUNK_PLAN) if how == "single"]
        # batched_submit_put_task returns nothing; it calls on_complete_callback once per key
        # when the connector's batched_put has finished (successfully or not; the contains
        # checks below tell which).
        landed = set()
        all_landed = threading.Event()

        def on_complete(key):
            landed.add(key)
            if len(landed) == len(batched):
                all_landed.set()

        writer.remote.batched_submit_put_task(
            [keys[i] for i in batched],
            [sources[i] for i in batched],
            on_complete_callback=on_complete,
        )
        assert all_landed.wait(OP_TIMEOUT), (
            f"batched_submit_put_task: only {len(landed)}/{len(batched)} keys completed "
            f"within {OP_TIMEOUT} s"
        )
        # submit_put_task returns the connector put's future.
        futures = [writer.remote.submit_put_task(keys[i], sources[i]) for i in single]
        for i, fut in zip(single, futures):
            try:
                fut.result(timeout=OP_TIMEOUT)  # re-raises what the connector's put raised
            except concurrent.futures.TimeoutError:
                raise AssertionError(
                    f"submit_put_task of chunk {i} did not complete within {OP_TIMEOUT} s"
                ) from None
        assert writer.remote.put_failed_count == 0

        # contains / batched_contains (prefix semantics: hits until the first miss).
        # RemoteBackend.contains hands back the connector's answer, which is is_exist's int
        # (1 yes, 0 no, negative on error; LMCache would read an error as a hit), so compare
        # with 1 and 0 exactly.
        present = [bounded("RemoteBackend.contains", writer.remote.contains, k) for k in keys]
        assert present == [1] * len(keys), f"contains per key after the puts: {present}"
        absent = bounded("RemoteBackend.contains", writer.remote.contains, missing_key)
        assert absent == 0, f"contains of a never-written key: {absent!r}"
        hits = bounded("RemoteBackend.batched_contains", writer.remote.batched_contains, keys)
        assert hits == len(keys), f"batched_contains of the written keys: {hits}"
        with_gap = keys[:2] + [missing_key] + keys[2:]
        hits = bounded("RemoteBackend.batched_contains", writer.remote.batched_contains, with_gap)
        assert hits == 2, f"batched_contains with a miss at index 2: {hits}"

        # What the store holds per key shows the mode's layout: header + KV bytes when
        # save_chunk_meta is on, the bare KV bytes in the zero-copy mode.
        header = conn.remote_metadata_bytes if save_chunk_meta else 0
        stored = [conn.store.get_size(k.to_string()) for k in keys]
        assert stored == [header + n for n in source_sizes], (
            f"store.get_size per key {stored}, expected {[header + n for n in source_sizes]}"
        )

        # Read back in this process through RemoteBackend.batched_get_blocking (the Mooncake
        # connector serves gets only batched; its single get() raises NotImplementedError by
        # design). The never-written key must come back as None, not as garbage.
        got = bounded(
            "RemoteBackend.batched_get_blocking",
            writer.remote.batched_get_blocking,
            keys + [missing_key],
            timeout=BLOCKING_TIMEOUT + OP_TIMEOUT,
        )
        try:
            assert len(got) == len(keys) + 1
            assert got[-1] is None, "batched_get_blocking returned an object for a missing key"
            for i, (obj, src) in enumerate(zip(got, sources)):
                assert obj is not None, f"chunk {i} ({CHUNK_PLAN[i]}) did not come back"
                assert obj.get_size() == src.get_size(), f"chunk {i}: size"
                assert obj.meta.shape == src.meta.shape, f"chunk {i}: shape"
                assert obj.meta.dtype == src.meta.dtype, f"chunk {i}: dtype"
                assert bytes(obj.byte_array) == bytes(src.byte_array), f"chunk {i}: bytes differ"
        finally:
            for obj in got:
                if obj is not None:
                    obj.ref_count_down()

        # A second process, with its own RemoteBackend in the same mode, reads the same keys
        # while this writer (whose segment holds the bytes) stays alive.
        spec = {
            "master": master.addr,
            "save_chunk_meta": save_chunk_meta,
            "chunk_hashes": hashes + [missing_key.chunk_hash],
        }
        try:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--reader", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=READER_TIMEOUT,
                # Same venv and PYTHONPATH (the shim); LMCache's INFO lines would bury a
                # failure's traceback in the stderr tail quoted below.
                env={"LMCACHE_LOG_LEVEL": "WARNING", **os.environ},
            )
        except subprocess.TimeoutExpired as e:
            raise AssertionError(
                f"the reader process did not finish within {READER_TIMEOUT} s; stderr tail:\n"
                f"{(e.stderr or b'')[-4000:]!r}"
            ) from None
        json_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and json_lines, (
            f"reader process exited {proc.returncode}; stdout:\n{proc.stdout[-2000:]}\n"
            f"stderr tail:\n{proc.stderr[-6000:]}"
        )
        report = json.loads(json_lines[-1])
        assert report["store_module"].startswith("tycho"), report["store_module"]
        assert report["save_chunk_meta"] is save_chunk_meta
        assert report["contains"] == [1] * len(keys) + [0], f"reader: {report['contains']}"
        assert report["batched_contains"] == len(keys), report["batched_contains"]
        assert report["chunks"][-1] is None, "the reader got an object for the missing key"
        for i, (chunk, src) in enumerate(zip(report["chunks"], sources)):
            assert chunk is not None, f"reader: chunk {i} ({CHUNK_PLAN[i]}) did not come back"
            assert chunk["nbytes"] == source_sizes[i], f"reader: chunk {i} size"
            assert chunk["shape"] == list(src.meta.shape), f"reader: chunk {i} shape"
        reader_sha = [c["sha256"] for c in report["chunks"][:-1]]
        assert reader_sha == source_sha, "the reader's sha256 per chunk differ from the writer's"
    finally:
        for obj in sources:
            obj.ref_count_down()
        writer.close()


if __name__ == "__main__":
    # The second process of the test: `python this_file.py --reader '<json spec>'`.
    if len(sys.argv) != 3 or sys.argv[1] != "--reader":
        sys.exit(f"usage: {sys.argv[0]} --reader '<json spec>' (run by the pytest test)")
    reader_main(json.loads(sys.argv[2]))
