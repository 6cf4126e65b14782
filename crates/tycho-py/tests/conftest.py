"""Fixtures: a real `tycho master` process on a free loopback port, and stores set up
against it."""

import atexit
import os
import shutil
import tempfile
import subprocess
import queue
import threading
import time
from pathlib import Path

import pytest

from tycho.store import MooncakeDistributedStore

ROOT = Path(__file__).resolve().parents[3]

# This run's own runtime directory (the master's secret file, the transfer and attach sockets),
# so that tests never meet sockets of other runs or of the user's own nodes; every process the
# tests start inherits it.
_RUNTIME_DIR = tempfile.mkdtemp(prefix="tycho-test-rt-")
os.environ["TYCHO_RUNTIME_DIR"] = _RUNTIME_DIR
atexit.register(shutil.rmtree, _RUNTIME_DIR, True)


def _tycho_bin():
    explicit = os.environ.get("TYCHO_BIN")
    if explicit:
        return explicit
    for profile in ("debug", "release"):
        p = ROOT / "target" / profile / "tycho"
        if p.exists():
            return str(p)
    raise RuntimeError("build the tycho binary first (cargo build) or set TYCHO_BIN")


def lines_of(proc):
    """A queue of `proc`'s stdout lines, read for its whole life so it never blocks on a full
    pipe; None once the stream closes."""
    lines = queue.Queue()

    def drain():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    return lines


def wait_line(lines, prefix, timeout=30):
    """The first line of `lines` that starts with `prefix`; None if the stream ends or `timeout`
    seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None or line.startswith(prefix):
            return line


class Master:
    """A `tycho master` on kernel-chosen loopback ports; the address comes from the line it
    prints once listening, so no other process can take the port in between."""

    def __init__(self, *extra):
        args = [_tycho_bin(), "master", "--rpc-address", "127.0.0.1", "--rpc-port", "0",
                "--metrics-address", "127.0.0.1", "--metrics-port", "0", *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        line = wait_line(lines_of(self.proc), "tycho master listening on ")
        if line is None:
            self.stop()
            raise RuntimeError("tycho master did not print its address within 30 s")
        self.addr = line[len("tycho master listening on "):].strip()
        self.port = int(self.addr.rsplit(":", 1)[1])

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def master():
    # A short lease, as Mooncake's own tests use (DEFAULT_KV_LEASE_TTL=500).
    m = Master("--default_kv_lease_ttl=500", "--client-ttl", "2")
    yield m
    m.stop()


@pytest.fixture
def make_store(master):
    made = []

    def make(segment="64MB", buffer="64MB", hostname="127.0.0.1"):
        s = MooncakeDistributedStore()
        rc = s.setup(hostname, "ignored-metadata-server", segment, buffer, "tcp", "", master.addr)
        assert rc == 0, rc
        made.append(s)
        return s

    yield make
    for s in made:
        s.remove_all(True) if s.health_check() == 0 else None
        s.close()


@pytest.fixture
def store(make_store):
    return make_store()
