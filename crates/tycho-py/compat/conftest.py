"""Fixtures for the same-body tests: one test body, run once against Tycho (`tycho.store` and
a real `tycho master`) and once against Mooncake (the `mooncake-transfer-engine-non-cuda` wheel's
`mooncake.store` and its `mooncake_master`), chosen by STORE_IMPL=tycho|mooncake.

scripts/test runs both; a test that passes on one and fails on the other is a difference Tycho
must fix (or a documented, deliberate one, which then has no place in this suite)."""

import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


def _die_with_parent():
    """Runs in the child before exec: the kernel kills it (SIGKILL) if the test process dies,
    so a crashed or killed pytest leaves no master behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL

IMPL = os.environ.get("STORE_IMPL", "tycho")
ROOT = Path(__file__).resolve().parents[3]

if IMPL == "tycho":
    # This run's own runtime directory (secret file, sockets), inherited by every process the
    # tests start, so that they never meet another run's.
    import atexit
    import tempfile

    _RUNTIME_DIR = tempfile.mkdtemp(prefix="tycho-test-rt-")
    os.environ["TYCHO_RUNTIME_DIR"] = _RUNTIME_DIR
    atexit.register(shutil.rmtree, _RUNTIME_DIR, True)

if IMPL == "mooncake":
    import mooncake.store as store_module
elif IMPL == "tycho":
    import tycho.store as store_module
else:
    raise RuntimeError(f"STORE_IMPL must be tycho or mooncake, not {IMPL!r}")


def _lines(proc, stream):
    """Collects a process's output lines on a thread, so the pipe never fills."""
    q = queue.Queue()

    def drain():
        for line in stream:
            q.put(line)
        q.put(None)

    threading.Thread(target=drain, daemon=True).start()
    return q


def _wait_for(q, proc, prefix, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            return None
        if prefix in line:
            return line


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    def __init__(self, lease_ms=500):
        if IMPL == "tycho":
            exe = os.environ.get("TYCHO_BIN") or str(ROOT / "target" / "debug" / "tycho")
            args = [exe, "master", "--rpc-address", "127.0.0.1", "--rpc-port", "0",
                    "--metrics-address", "127.0.0.1", "--metrics-port", "0",
                    f"--default_kv_lease_ttl={lease_ms}ms", "--client-ttl", "2"]
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
            line = _wait_for(_lines(self.proc, self.proc.stdout), self.proc, "tycho master listening on ")
            if line is None:
                self.stop()
                raise RuntimeError("tycho master did not start")
            self.addr = line.split("listening on ", 1)[1].strip()
            return
        # mooncake_master cannot be told to pick its own port: take a free one and retry if
        # another process grabbed it in between.
        exe = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
        for _ in range(5):
            port, metrics = _free_port(), _free_port()
            args = [exe, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}",
                    "--metrics_host=127.0.0.1", f"--default_kv_lease_ttl={lease_ms}ms", "--client_ttl=2",
                    "--enable_metric_reporting=false"]
            self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                         preexec_fn=_die_with_parent)
            line = _wait_for(_lines(self.proc, self.proc.stderr), self.proc, "Master service started on port")
            if line is not None and self._connects(port):
                self.addr = f"127.0.0.1:{port}"
                return
            self.stop()
        raise RuntimeError("mooncake_master did not start")

    @staticmethod
    def _connects(port, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="session")
def mc():
    """The store module under test (`tycho.store` or `mooncake.store`)."""
    return store_module


@pytest.fixture(scope="module")
def master():
    m = Master()
    yield m
    m.stop()


# Mooncake needs a metadata server name; P2PHANDSHAKE means "none", and Tycho ignores it.
METADATA = "P2PHANDSHAKE"


@pytest.fixture
def make_store(master, mc):
    made = []

    def make(segment=64 << 20, buffer=64 << 20):
        s = mc.MooncakeDistributedStore()
        rc = s.setup("127.0.0.1", METADATA, segment, buffer, "tcp", "", master.addr)
        assert rc == 0, rc
        made.append(s)
        return s

    yield make
    for s in made:
        s.remove_all(True)
        s.close()


@pytest.fixture
def store(make_store):
    return make_store()
