#!/usr/bin/env python3
"""Replays Mooncake's FAST'25 conversation trace against tycho.store and mooncake.store and
prints the hit ratio each one gives a KV-cache user, with latency and error counts.

    python bench/replay_trace.py                          # whole trace, both stores, 10x speed
    python bench/replay_trace.py --impl tycho --limit 300 --unpaced
    python bench/replay_trace.py --trace bench/traces/conversation-slice.jsonl --unpaced
    python bench/replay_trace.py --tycho-python target/pyenv/bin/python \\
        --mooncake-python target/mooncake-env/bin/python

The trace (kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl) lists 12,031
requests of one hour, each with its arrival time and its prompt as prefix block ids (a block is
512 tokens). Here a block is a value of --block-size bytes (64 KiB by default, far below a real
model's KV block, so that a run fits a small machine: the default store holds 16,384 blocks,
about 9% of the trace's 182,790 distinct ones) under the key "<run prefix>@<block id>"; its
bytes are a function of the block id, so every read is checked. The heading line also gives
the hit ratio of a store that never evicts, the most any store can reach on these requests.

For each store the script starts its master on free loopback ports, then --clients worker
processes (this script again, under --tycho-python or --mooncake-python), each mounting a
--segment-size segment: the store holds clients x segment size bytes. Request i goes to worker
i mod clients; a worker serves its requests in order, the way LMCache's zero-copy mode uses a
store:

  1. batch_is_exist(keys); the leading run is the longest prefix of keys that exist;
  2. batch_get_into(leading run) into the worker's registered buffer; every block must come
     back whole and with its own bytes; the hit count stops at the first that does not;
  3. batch_put_from(the keys from the first miss on that did not exist).

Paced (the default), request i is issued at the common start + its timestamp / --speedup; a
worker that falls behind issues at once. --unpaced issues back to back. Both masters keep their
defaults: eviction above 0.9 of the memory, 5% of the objects per round, 10 s read leases.

Printed per store: hit ratio (blocks served from the store / blocks asked), requests per
second, p50 and p99 of the whole request's latency, MB read and written, and errors by kind;
with both stores, Tycho/Mooncake ratios. Exits non-zero on wrong bytes, a failed get, or a
worker that crashed; puts refused for lack of space (NO_AVAILABLE_HANDLE) or failed otherwise
are reported but do not fail the run. "already existed" counts puts answered
OBJECT_ALREADY_EXISTS; both stores answer 0 to a put of a key that is already complete, so
it stays 0 unless two workers race on a block.

tycho.store comes from `pip install ./crates/tycho-py` (the master is target/release/tycho or
$TYCHO_BIN); mooncake.store and mooncake_master from
`pip install mooncake-transfer-engine-non-cuda` (Debian packages libibverbs1 librdmacm1 libnuma1).
Tycho picks shared memory between processes on one host for "tcp"; set TYCHO_PROTOCOL=tcp to
force TCP.
"""

import argparse
import ctypes
import functools
import importlib
import json
import math
import os
import random
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"
NO_AVAILABLE_HANDLE = -200
OBJECT_ALREADY_EXISTS = -705
LEASE_SECONDS = 10
MAX_SPEEDUP = 10
LATE_SECONDS = 0.1
ERRORS = ["wrong bytes", "failed gets", "failed puts", "NO_AVAILABLE_HANDLE", "already existed",
          "exist errors"]


# ---------------------------------------------------------------------------------------------
# Shared by the parent and the workers


def load_trace(path, limit):
    """The trace's requests, as (seconds after the first request, hash ids), at most `limit`."""
    requests = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                r = json.loads(line)
                requests.append((r["timestamp"] / 1000.0, r["hash_ids"]))
    first = requests[0][0] if requests else 0.0
    return [(ts - first, ids) for ts, ids in requests]


def unlimited_hit_ratio(requests):
    """The hit ratio of a store that never evicts, serving the requests one after the other: the
    most any store can give this trace."""
    seen, hit, asked = set(), 0, 0
    for _, ids in requests:
        lead = 0
        while lead < len(ids) and ids[lead] in seen:
            lead += 1
        hit += lead
        asked += len(ids)
        seen.update(ids)
    return hit / asked if asked else float("nan")


# ---------------------------------------------------------------------------------------------
# Worker: one client process replaying its share of the requests


class Blocks:
    """The bytes of each block: a fixed pseudo-random pattern XOR a word made from the block id,
    repeated, so that a block read under another id, or shifted, does not match."""

    def __init__(self, size):
        if size % 8:
            raise SystemExit("--block-size must be a multiple of 8")
        self.size = size
        self.words = size // 8
        self.pattern = int.from_bytes(random.Random(size).randbytes(size), "little")

    @functools.lru_cache(maxsize=1024)
    def content(self, block_id):
        word = struct.pack("<Q", (block_id * 0x9E3779B97F4A7C15 + 1) & (2**64 - 1))
        return (self.pattern ^ int.from_bytes(word * self.words, "little")).to_bytes(self.size, "little")


def new_store(impl, master, meta, segment):
    s = importlib.import_module(f"{impl}.store").MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", meta, segment, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"{impl} setup failed: {rc}")
    return s


def serve_request(s, blocks, prefix, hash_ids, base, stats):
    """One request the way a KV-cache connector issues it: exist, read the leading run, write
    the missing rest. Adds to `stats`; returns the number of blocks hit."""
    size = blocks.size
    keys = [f"{prefix}@{h}" for h in hash_ids]
    exist = s.batch_is_exist(keys)
    lead = 0
    while lead < len(keys) and exist[lead] == 1:
        lead += 1
    stats["exist errors"] += sum(1 for e in exist if e not in (0, 1))

    hits = 0
    if lead:
        got = s.batch_get_into(keys[:lead], [base + j * size for j in range(lead)], [size] * lead)
        served = True
        for j, n in enumerate(got):
            if n != size:
                stats["failed gets"] += 1
                served = False
            elif ctypes.string_at(base + j * size, size) != blocks.content(hash_ids[j]):
                stats["wrong bytes"] += 1
                served = False
            else:
                stats["bytes read"] += size
                hits += served

    rest = [j for j in range(lead, len(keys)) if exist[j] == 0]
    if rest:
        for slot, j in enumerate(rest):
            ctypes.memmove(base + slot * size, blocks.content(hash_ids[j]), size)
        put = s.batch_put_from([keys[j] for j in rest], [base + slot * size for slot in range(len(rest))],
                               [size] * len(rest))
        for rc in put:
            if rc == 0:
                stats["bytes written"] += size
            elif rc == OBJECT_ALREADY_EXISTS:
                stats["already existed"] += 1
            elif rc == NO_AVAILABLE_HANDLE:
                stats["NO_AVAILABLE_HANDLE"] += 1
            else:
                stats["failed puts"] += 1
    return hits


def worker_main(args):
    """Child process: sets up a store, says "ready", waits for the start time on stdin, replays
    requests index, index + clients, ... and prints its totals as JSON; then keeps its segment
    mounted until stdin closes, since the other workers may still read from it."""
    # The protocol goes over a private copy of stdout; whatever a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(line):
        out.write(line + "\n")
        out.flush()

    mine = load_trace(args.trace, args.limit)[args.worker::args.clients]
    blocks = Blocks(args.block_size)
    s = new_store(args.impl, args.master, args.meta, args.segment_size)
    capacity = max([len(h) for _, h in mine] + [1]) * blocks.size
    buf = ctypes.create_string_buffer(capacity)
    base = ctypes.addressof(buf)
    rc = s.register_buffer(base, capacity)
    if rc != 0:
        raise RuntimeError(f"register_buffer returned {rc}")
    say("ready")

    start = float(sys.stdin.readline())
    stats = {k: 0 for k in ERRORS + ["bytes read", "bytes written", "blocks asked", "blocks hit", "late"]}
    latencies = []
    max_lag = 0.0
    for ts, hash_ids in mine:
        if not args.unpaced:
            due = start + ts / args.speedup
            now = time.time()
            if now < due:
                time.sleep(due - now)
            lag = max(0.0, time.time() - due)
            max_lag = max(max_lag, lag)
            stats["late"] += lag > LATE_SECONDS
        t = time.perf_counter()
        hits = serve_request(s, blocks, args.prefix, hash_ids, base, stats)
        latencies.append((time.perf_counter() - t) * 1000)
        stats["blocks asked"] += len(hash_ids)
        stats["blocks hit"] += hits
    stats.update(requests=len(mine), finished=time.time(), max_lag=max_lag, latencies_ms=latencies)
    say(json.dumps(stats))

    sys.stdin.read()
    s.unregister_buffer(base)
    s.close()


# ---------------------------------------------------------------------------------------------
# Parent: masters, workers, figures


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, what, proc):
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode} before listening")
            if time.time() > deadline:
                raise RuntimeError(f"{what} did not start on port {port}")
            time.sleep(0.05)


def master_command(impl, args):
    """The master's command line, its address and the metadata server the clients pass."""
    port = free_port()
    if impl == "tycho":
        exe = os.environ.get("TYCHO_BIN") or str(ROOT / "target" / "release" / "tycho")
        cmd = [exe, "master", "--rpc-address", "127.0.0.1", f"--rpc-port={port}", "--metrics-port", "0"]
        return cmd + args.tycho_master_arg, port, None, "unused"
    beside = Path(args.mooncake_python).parent / "mooncake_master"
    exe = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if exe is None:
        raise SystemExit(f"mooncake_master is neither beside {args.mooncake_python} nor on PATH")
    http = free_port()
    cmd = [exe, f"--rpc_port={port}", "--enable_http_metadata_server=true",
           f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
           f"--metrics_port={free_port()}"]
    return cmd + args.mooncake_master_arg, port, http, f"http://127.0.0.1:{http}/metadata"


def stop(proc, grace):
    """Waits up to `grace` seconds for the process to end, then kills it."""
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path, n=30):
    lines = Path(path).read_text(errors="replace").splitlines()
    return "\n".join("    " + l for l in lines[-n:])


def replay(impl, args, logs):
    """Runs the whole replay against one store; returns its figures, with "crashed" set when a
    worker died."""
    python = args.tycho_python if impl == "tycho" else args.mooncake_python
    prefix = uuid.uuid4().hex[:12]
    cmd, port, http, meta = master_command(impl, args)
    master_log = open(logs / f"{impl}-master.log", "w")
    master = subprocess.Popen(cmd, stdout=master_log, stderr=subprocess.STDOUT)
    workers = []
    try:
        wait_port(port, f"{impl} master", master)
        if http:
            wait_port(http, "mooncake metadata server", master)
        for w in range(args.clients):
            wcmd = [python, __file__, "--worker", str(w), "--impl", impl, "--master", f"127.0.0.1:{port}",
                    "--meta", meta, "--prefix", prefix, "--trace", str(args.trace), "--clients", str(args.clients),
                    "--segment-size", str(args.segment_size), "--block-size", str(args.block_size),
                    "--speedup", str(args.speedup), "--force-speedup"]
            wcmd += ["--limit", str(args.limit)] if args.limit is not None else []
            wcmd += ["--unpaced"] if args.unpaced else []
            err = open(logs / f"{impl}-worker{w}.log", "w")
            p = subprocess.Popen(wcmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            workers.append((p, logs / f"{impl}-worker{w}.log"))
        lines, dead = one_line_each(workers)
        if not dead:
            dead = next((w for w, l in zip(workers, lines) if l.strip() != "ready"), None)
        if dead:
            return crashed(impl, *dead)
        start = time.time() + 1.0
        for p, _ in workers:
            p.stdin.write(f"{start!r}\n")
            p.stdin.flush()
        lines, dead = one_line_each(workers)
        if dead:
            return crashed(impl, *dead)
        reports = [json.loads(l) for l in lines]
        for p, _ in workers:
            p.stdin.close()
        for p, _ in workers:
            stop(p, 30)
        return figures(reports, start)
    finally:
        for p, _ in workers:
            if p.poll() is None:
                p.kill()
            p.wait()
        master.kill()
        master.wait()
        master_log.close()


def one_line_each(workers):
    """Reads the next line of every worker, in whatever order they come; returns (lines, None),
    or (lines so far, (process, log)) as soon as one of them closes its output instead."""
    lines = [None] * len(workers)
    with selectors.DefaultSelector() as sel:
        for i, (p, _) in enumerate(workers):
            sel.register(p.stdout, selectors.EVENT_READ, i)
        while sel.get_map():
            for key, _ in sel.select():
                line = key.fileobj.readline()
                if not line:
                    return lines, workers[key.data]
                lines[key.data] = line
                sel.unregister(key.fileobj)
    return lines, None


def crashed(impl, proc, log):
    stop(proc, 10)
    print(f"{impl}: worker {proc.args[3]} crashed (status {proc.returncode}); last lines of {log}:\n"
          f"{tail(log)}", file=sys.stderr)
    return {"crashed": True}


def percentile(values, q):
    """Nearest-rank percentile of sorted values."""
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else float("nan")


def figures(reports, start):
    """The per-store figures, summed over the workers' reports."""
    total = {k: sum(r[k] for r in reports) for k in reports[0]
             if k not in ("latencies_ms", "finished", "max_lag")}
    lat = sorted(x for r in reports for x in r["latencies_ms"])
    wall = max(r["finished"] for r in reports) - start
    return {
        "crashed": False,
        "requests": total["requests"],
        "blocks asked": total["blocks asked"],
        "blocks hit": total["blocks hit"],
        "hit ratio": total["blocks hit"] / total["blocks asked"] if total["blocks asked"] else float("nan"),
        "wall s": wall,
        "requests/s": total["requests"] / wall,
        "p50 ms": percentile(lat, 0.50),
        "p99 ms": percentile(lat, 0.99),
        "MB read": total["bytes read"] / 1e6,
        "MB written": total["bytes written"] / 1e6,
        "errors": {k: total[k] for k in ERRORS},
        "late requests": total["late"],
        "max lag s": max(r["max_lag"] for r in reports),
    }


def importable(python, impl):
    done = subprocess.run([python, "-c", f"import {impl}.store"], capture_output=True, text=True)
    return done.returncode == 0, done.stderr.strip().splitlines()[-1:] or [""]


def print_table(results, impls):
    both = len(impls) == 2 and not any(results[i]["crashed"] for i in impls)
    print(f"{'':<28}" + "".join(f"{i:>14}" for i in impls) + ("   tycho/mooncake" if both else ""))

    def row(name, get, fmt, ratio=False):
        cells = [format(get(results[i]), fmt) if not results[i]["crashed"] else "crashed" for i in impls]
        line = f"{name:<28}" + "".join(f"{c:>14}" for c in cells)
        if both and ratio:
            m = get(results["mooncake"])
            line += f"   {get(results['tycho']) / m:>8.2f}x" if m else "        n/a"
        print(line)

    row("hit ratio", lambda r: r["hit ratio"], ".3f", ratio=True)
    row("blocks hit / asked", lambda r: f"{r['blocks hit']}/{r['blocks asked']}", "")
    row("requests/s", lambda r: r["requests/s"], ".1f")
    row("p50 latency (ms)", lambda r: r["p50 ms"], ".2f", ratio=True)
    row("p99 latency (ms)", lambda r: r["p99 ms"], ".2f", ratio=True)
    row("MB read", lambda r: r["MB read"], ".1f")
    row("MB written", lambda r: r["MB written"], ".1f")
    for k in ERRORS:
        row(k, lambda r, k=k: r["errors"][k], "d")
    row(f"late by > {LATE_SECONDS * 1000:.0f} ms", lambda r: r["late requests"], "d")
    row("wall time (s)", lambda r: r["wall s"], ".1f")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["tycho", "mooncake", "both"],
                    help="store(s) to replay against (default: both when mooncake.store is importable)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"trace file (default: {DEFAULT_TRACE})")
    ap.add_argument("--limit", type=int, help="replay only the first N requests")
    ap.add_argument("--clients", type=int, default=2, help="client processes (default 2)")
    ap.add_argument("--segment-size", type=int, default=512 << 20,
                    help="bytes of memory each client gives the store (default 512 MiB)")
    ap.add_argument("--block-size", type=int, default=64 << 10,
                    help="bytes of one 512-token block (default 64 KiB)")
    ap.add_argument("--speedup", type=float, default=10.0,
                    help="replay this many times faster than the trace (default 10)")
    ap.add_argument("--force-speedup", action="store_true", help=f"allow --speedup above {MAX_SPEEDUP}")
    ap.add_argument("--unpaced", action="store_true", help="issue each worker's requests back to back")
    ap.add_argument("--tycho-python", default=sys.executable,
                    help="Python that imports tycho.store (default: this one)")
    ap.add_argument("--mooncake-python", default=sys.executable,
                    help="Python that imports mooncake.store (default: this one)")
    ap.add_argument("--tycho-master-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `tycho master` (repeatable), "
                         "e.g. --tycho-master-arg=--eviction-ratio=0.1")
    ap.add_argument("--mooncake-master-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for mooncake_master (repeatable)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to PATH as JSON")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--meta", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    return ap.parse_args()


def main():
    args = parse_args()
    if args.worker is not None:
        return worker_main(args)
    if not args.trace.is_file():
        raise SystemExit(f"trace file {args.trace} not found: pass --trace PATH (the whole trace is "
                         f"conversation_trace.jsonl from kvcache-ai/Mooncake, FAST25-release/traces/; "
                         f"a slice is in bench/traces/conversation-slice.jsonl)")
    if args.speedup > MAX_SPEEDUP and not args.force_speedup and not args.unpaced:
        raise SystemExit(
            f"--speedup {args.speedup:g} refused: a read lease lasts {LEASE_SECONDS} s of real time, which "
            f"would then span {LEASE_SECONDS * args.speedup:g} s of the trace, and the blocks read in that "
            f"span can be more than the store holds, so puts fail for want of evictable space instead of "
            f"evicting; the hit ratio would measure the leases, not the store. --force-speedup allows it.")
    if args.speedup <= 0:
        raise SystemExit("--speedup must be positive")

    if args.impl in (None, "both"):
        impls = ["tycho", "mooncake"]
        ok, why = importable(args.mooncake_python, "mooncake")
        if not ok:
            note = f"mooncake.store is not importable by {args.mooncake_python} ({why[0]})"
            if args.impl == "both":
                raise SystemExit(note)
            print(f"{note}; replaying against tycho only (pass --mooncake-python)", file=sys.stderr)
            impls = ["tycho"]
    else:
        impls = [args.impl]
    for impl in impls:
        ok, why = importable(args.tycho_python if impl == "tycho" else args.mooncake_python, impl)
        if not ok:
            raise SystemExit(f"{impl}.store is not importable ({why[0]}); pass --{impl}-python")

    requests = load_trace(args.trace, args.limit)
    blocks = args.segment_size * args.clients // args.block_size
    pace = "unpaced" if args.unpaced else f"paced at {args.speedup:g}x ({requests[-1][0] / args.speedup:.0f} s)"
    bound = unlimited_hit_ratio(requests)
    print(f"{len(requests)} requests of {args.trace.name}, {sum(len(h) for _, h in requests)} blocks asked, "
          f"{len({b for _, h in requests for b in h})} distinct (a store that never evicts would hit "
          f"{bound:.3f}); {args.clients} clients x {args.segment_size >> 20} MiB = {blocks} blocks of "
          f"{args.block_size >> 10} KiB; {pace}", flush=True)

    logs = Path(tempfile.mkdtemp(prefix="replay-trace-"))
    results = {}
    for impl in impls:
        t = time.time()
        results[impl] = replay(impl, args, logs)
        print(f"{impl} done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    print_table(results, impls)

    if args.json:
        ratios = {}
        if len(impls) == 2 and not any(results[i]["crashed"] for i in impls):
            for k in ("hit ratio", "p50 ms", "p99 ms"):
                m = results["mooncake"][k]
                ratios[k] = results["tycho"][k] / m if m else None
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                  if k not in ("worker", "master", "meta", "prefix", "json")}
        args.json.write_text(json.dumps({"config": config, "requests": len(requests), "store blocks": blocks,
                                         "unlimited hit ratio": bound,
                                         "results": results, "tycho/mooncake": ratios}, indent=2) + "\n")

    failed = [i for i in impls if results[i]["crashed"]
              or results[i]["errors"]["wrong bytes"] or results[i]["errors"]["failed gets"]]
    if failed:
        print(f"FAILED: {', '.join(failed)} (wrong bytes, failed gets or a crashed worker); logs in {logs}",
              file=sys.stderr)
        sys.exit(1)
    shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
