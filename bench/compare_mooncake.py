#!/usr/bin/env python3
"""Runs one workload against tycho.store and, when installed, mooncake.store; prints both and
the ratio.

Each implementation gets its own master, started by this script on free loopback ports, and
the same client code. Small-operation latency on a 2-core VM depends mostly on which CPU each
process lands on, so the client and the master are pinned (--client-cpu, --master-cpu) the
same way for both.

    python bench/compare_mooncake.py                    # both, if mooncake is importable
    python bench/compare_mooncake.py --impl tycho       # Tycho alone
    python bench/compare_mooncake.py --workload fill-loop

The fill-loop workload is the loop Mooncake's users and benchmarks run: fill half of a 1 GiB
segment with 4 MiB (then 1 MiB) values, read them all back, remove them with
remove_by_regex(..., force=True), and repeat for 20 rounds; once with the writer reading back,
once with a second client process reading what the writer just wrote. It reports throughput
(MB/s of values written and read) and counts failed puts and empty reads.

mooncake.store comes from `pip install mooncake-transfer-engine-non-cuda` (Debian packages
libibverbs1 librdmacm1 libnuma1 are needed); tycho.store from `pip install ./crates/tycho-py`.
"""

import argparse
import ctypes
import importlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = [("64 B", 64), ("4 KiB", 4096), ("1 MiB", 1 << 20), ("4 MiB", 4 << 20)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, what):
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"{what} did not start on port {port}")
            time.sleep(0.05)


def pinned(cmd, cpu):
    return (["taskset", "-c", str(cpu)] + cmd) if cpu is not None and shutil.which("taskset") else cmd


def start_master(impl, cpu):
    """Starts the implementation's master; returns (process, master address, metadata server)."""
    port = free_port()
    if impl == "tycho":
        exe = os.environ.get("TYCHO_BIN") or str(ROOT / "target" / "release" / "tycho")
        cmd = [exe, "master", "--rpc-address", "127.0.0.1", f"--rpc_port={port}", "--metrics-port", "0"]
        meta = "unused"
    else:
        exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
        http = free_port()
        cmd = [exe, f"--rpc_port={port}", "--enable_http_metadata_server=true",
               f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
               f"--metrics_port={free_port()}"]
        meta = f"http://127.0.0.1:{http}/metadata"
    proc = subprocess.Popen(pinned(cmd, cpu), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, f"{impl} master")
    if impl == "mooncake":
        wait_port(int(meta.split(":")[2].split("/")[0]), "mooncake metadata server")
    return proc, f"127.0.0.1:{port}", meta


def store_class(impl):
    return importlib.import_module(f"{impl}.store").MooncakeDistributedStore


def new_store(impl, master, meta, segment):
    s = store_class(impl)()
    rc = s.setup("127.0.0.1", meta, segment, 512 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"{impl} setup failed: {rc}")
    return s


def remove_regex(s, pattern):
    """Removes keys by regex, forcing past read leases where the API allows it."""
    try:
        return s.remove_by_regex(pattern, True)
    except TypeError:
        return s.remove_by_regex(pattern)


def timed(n, fn):
    """Runs fn(i) n times; returns ops/s."""
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t)


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


def reader_main(args):
    """Child process: a second store reading what the parent wrote."""
    os.sched_setaffinity(0, {args.client_cpu}) if args.client_cpu is not None else None
    s = new_store(args.impl, args.master, args.meta, 0)
    keys = args.keys.split(",")
    size = args.size
    buf = (ctypes.c_ubyte * size)()
    ptr = ctypes.addressof(buf)
    check(s.register_buffer(ptr, size), "register_buffer")
    # Warm-up: connections and mappings.
    assert s.get_into(keys[0], ptr, size) == size
    n = args.iters
    def read(i):
        rc = s.get_into(keys[i % len(keys)], ptr, size)
        if rc != size:
            raise RuntimeError(f"get_into returned {rc}")

    rate = timed(n, read)
    s.unregister_buffer(ptr)
    s.close()
    print(json.dumps({"ops": rate}))


def fill_reader_main(args):
    """Child process of the fill loop: reads the keys of each round the parent announces."""
    s = new_store(args.impl, args.master, args.meta, 0)
    print("ready", flush=True)
    for line in sys.stdin:
        prefix, n = line.split()
        empty = sum(1 for i in range(int(n)) if len(s.get(f"{prefix}-{i}")) != args.size)
        print(empty, flush=True)
    s.close()


FILL_SEGMENT = 1 << 30
FILL_ROUNDS = 20


def run_fill_loop(impl, args):
    """The fill-half / read / force-remove loop; returns rows of MB/s and failure counts."""
    proc, master, meta = start_master(impl, args.master_cpu)
    rows = {}
    try:
        s = new_store(impl, master, meta, FILL_SEGMENT)
        tag = uuid.uuid4().hex[:8]
        for label, size in [("4 MiB", 4 << 20), ("1 MiB", 1 << 20)]:
            value = os.urandom(size)
            n = FILL_SEGMENT // 2 // size
            for readers in (1, 2):
                child = None
                if readers == 2:
                    cmd = [sys.executable, __file__, "--fill-reader", "--impl", impl, "--master", master,
                           "--meta", meta, "--size", str(size)]
                    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    assert child.stdout.readline().strip() == "ready"
                failed = empty = 0
                t = time.perf_counter()
                for r in range(FILL_ROUNDS):
                    prefix = f"{tag}-{label[0]}-{readers}-{r}"
                    failed += sum(1 for i in range(n) if s.put(f"{prefix}-{i}", value) != 0)
                    if child is None:
                        empty += sum(1 for i in range(n) if len(s.get(f"{prefix}-{i}")) != size)
                    else:
                        child.stdin.write(f"{prefix} {n}\n")
                        child.stdin.flush()
                        empty += int(child.stdout.readline())
                    remove_regex(s, f"^{prefix}-.*")
                secs = time.perf_counter() - t
                if child is not None:
                    child.stdin.close()
                    child.wait()
                name = f"fill-loop {label}, {readers} client{'s' if readers == 2 else ''}"
                rows[f"{name} (MB/s)"] = 2 * FILL_ROUNDS * n * size / secs / 1e6
                rows[f"{name}: failed puts"] = failed
                rows[f"{name}: empty reads"] = empty
        s.close()
    finally:
        proc.kill()
        proc.wait()
    return rows


def run_impl(impl, args):
    proc, master, meta = start_master(impl, args.master_cpu)
    rows = {}
    try:
        if args.client_cpu is not None:
            os.sched_setaffinity(0, {args.client_cpu})
        s = new_store(impl, master, meta, 1 << 30)
        tag = uuid.uuid4().hex[:8]
        for label, size in SIZES:
            n = args.iters if size <= 4096 else max(50, args.iters // (20 if size <= (1 << 20) else 60))
            value = os.urandom(size)
            keys = [f"{tag}-{size}-{i}" for i in range(n)]
            s.put(f"{tag}-warm-{size}", value)
            rows[f"put {label}"] = timed(n, lambda i: check(s.put(keys[i], value), "put"))
            rows[f"get {label}"] = timed(n, lambda i: len(s.get(keys[i])) == size or (_ for _ in ()).throw(RuntimeError("get")))
            rows[f"is_exist {label}"] = timed(n, lambda i: s.is_exist(keys[i]) == 1 or (_ for _ in ()).throw(RuntimeError("exist")))
            remove_regex(s, f"^{tag}-{size}-.*")
        # batch_is_exist of 128 keys.
        keys = [f"{tag}-be-{i}" for i in range(128)]
        s.put_batch(keys, [b"x" * 64] * 128)
        nb = max(20, args.iters // 3)
        s.batch_is_exist(keys)
        rows["batch_is_exist 128 (calls)"] = timed(nb, lambda i: s.batch_is_exist(keys))
        # batch_put_from / batch_get_into of 32 x 1 MiB.
        size, count = 1 << 20, 32
        src = (ctypes.c_ubyte * (size * count))()
        ctypes.memset(src, 7, size * count)
        dst = (ctypes.c_ubyte * (size * count))()
        sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
        check(s.register_buffer(sp, size * count), "register src")
        check(s.register_buffer(dp, size * count), "register dst")
        ptrs_s = [sp + j * size for j in range(count)]
        ptrs_d = [dp + j * size for j in range(count)]
        # At most 12 rounds (384 MiB) so that the rows stay below the eviction watermark.
        rounds = max(5, min(12, args.iters // 150))
        batches = [[f"{tag}-bp-{r}-{j}" for j in range(count)] for r in range(rounds)]

        def put_round(r):
            res = s.batch_put_from(batches[r], ptrs_s, [size] * count)
            if any(x != 0 for x in res):
                raise RuntimeError(f"batch_put_from: {res}")

        def get_round(r):
            res = s.batch_get_into(batches[r], ptrs_d, [size] * count)
            if any(x != size for x in res):
                raise RuntimeError(f"batch_get_into: {res}")

        rows["batch_put_from 32x1MiB (calls)"] = timed(rounds, put_round)
        # Reads do not change the store, so they pass over the batches three times for a longer,
        # steadier sample.
        rows["batch_get_into 32x1MiB (calls)"] = timed(3 * rounds, lambda i: get_round(i % rounds))
        remove_regex(s, f"^{tag}-bp-.*")
        s.unregister_buffer(sp)
        s.unregister_buffer(dp)
        # Cross-client get of 4 MiB: another process reads what this store wrote.
        size = 4 << 20
        value = os.urandom(size)
        keys = [f"{tag}-x-{i}" for i in range(16)]
        for k in keys:
            check(s.put(k, value), "put 4 MiB")
        cmd = [sys.executable, __file__, "--reader", "--impl", impl, "--master", master, "--meta", meta,
               "--keys", ",".join(keys), "--size", str(size), "--iters", str(max(50, args.iters // 30))]
        if args.client_cpu is not None:
            cmd += ["--client-cpu", str(args.client_cpu)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"reader process failed: {done.stderr[-2000:]}")
        rows["cross-client get 4 MiB"] = json.loads(done.stdout.strip().splitlines()[-1])["ops"]
        s.remove_all(True) if hasattr(s, "remove_all") else None
        s.close()
    finally:
        proc.kill()
        proc.wait()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["tycho", "mooncake", "both"], default="both")
    ap.add_argument("--iters", type=int, default=3000, help="operations per small-value row")
    ap.add_argument("--repeat", type=int, default=5, help="alternating runs per implementation; rows report the median")
    ap.add_argument("--client-cpu", type=int, default=0, help="CPU the client (and reader) run on")
    ap.add_argument("--master-cpu", type=int, default=0, help="CPU the master runs on")
    ap.add_argument("--workload", choices=["mixed", "fill-loop"], default="mixed",
                    help="mixed: per-operation rows; fill-loop: fill half, read, force-remove, 20 rounds")
    ap.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fill-reader", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--meta", help=argparse.SUPPRESS)
    ap.add_argument("--keys", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        return reader_main(args)
    if args.fill_reader:
        return fill_reader_main(args)
    impls = ["tycho", "mooncake"] if args.impl == "both" else [args.impl]
    if "mooncake" in impls:
        try:
            importlib.import_module("mooncake.store")
        except ImportError as e:
            if args.impl == "mooncake":
                raise
            print(f"mooncake.store is not importable ({e}); running tycho only", file=sys.stderr)
            impls = ["tycho"]
    print(f"pinning: client and reader on CPU {args.client_cpu}, master on CPU {args.master_cpu}; "
          f"{args.iters} operations per small-value row; {args.repeat} alternating runs per implementation")
    # Runs alternate between the implementations so that slow drift in the machine's load
    # falls on both; each row reports the median over the runs.
    runs = {impl: [] for impl in impls}
    for r in range(args.repeat):
        for impl in impls:
            run = run_fill_loop if args.workload == "fill-loop" else run_impl
            runs[impl].append(run(impl, args))
            print(f"run {r + 1}/{args.repeat} of {impl} done", file=sys.stderr)
    results = {impl: {n: statistics.median(run[n] for run in rs) for n in rs[0]} for impl, rs in runs.items()}
    names = list(results[impls[0]].keys())
    print(f"{'row':<34}" + "".join(f"{i + ' ops/s':>18}" for i in impls) + ("   ratio tycho/mooncake" if len(impls) == 2 else ""))
    for n in names:
        line = f"{n:<34}" + "".join(f"{results[i].get(n, float('nan')):>18.1f}" for i in impls)
        if len(impls) == 2 and ":" in n:
            # A count (failed puts, empty reads): the sum over all runs, not a ratio.
            line = f"{n:<34}" + "".join(f"{sum(run[n] for run in runs[i]):>18d}" for i in impls) + "   (total over runs)"
        elif len(impls) == 2:
            line += f"   {results['tycho'][n] / results['mooncake'][n]:>8.2f}x"
            spread = [t[n] / m[n] for t, m in zip(runs["tycho"], runs["mooncake"])]
            line += f"   (per run {min(spread):.2f}-{max(spread):.2f})"
        print(line)


if __name__ == "__main__":
    main()
