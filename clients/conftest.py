"""Shared by the client tests: a real `tycho master` per test.

The master runs on ports the kernel picks and the address is read from the line it prints once
listening, so no other process can take the port in between.
"""

import atexit
import os
import shutil
import tempfile
import queue
import subprocess
import threading
import time

import pytest


def _die_with_parent():
    """Runs in the child before exec: the kernel kills it (SIGKILL) if the test process dies,
    so a crashed or killed pytest leaves no master behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL

START_TIMEOUT = 30  # seconds until the master prints its address

# This run's own runtime directory (the master's secret file, the transfer and attach sockets),
# so that tests never meet sockets of other runs or of the user's own nodes; every process the
# tests start inherits it.
_RUNTIME_DIR = tempfile.mkdtemp(prefix="tycho-test-rt-")
os.environ["TYCHO_RUNTIME_DIR"] = _RUNTIME_DIR
atexit.register(shutil.rmtree, _RUNTIME_DIR, True)


class TychoMaster:
    """A ``tycho master`` on ports the kernel picks; its address is read from the line it
    prints once listening."""

    PREFIX = "tycho master listening on "

    def __init__(self, stderr_path):
        self.stderr_path = stderr_path
        self.stderr = open(stderr_path, "w")
        self.proc = subprocess.Popen(
            [
                os.environ["TYCHO_BIN"], "master",
                "--rpc-address", "127.0.0.1", "--rpc-port", "0",
                "--metrics-address", "127.0.0.1", "--metrics-port", "0",
            ],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            preexec_fn=_die_with_parent,
        )
        lines = queue.Queue()

        def pump():
            # Reads stdout for the master's whole life so it can never block on a full pipe.
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)  # stdout closed: the master exited

        threading.Thread(target=pump, name="tycho-master-stdout", daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        self.addr = None
        while self.addr is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.stop()
                raise AssertionError(
                    f"tycho master did not print its address within {START_TIMEOUT} s "
                    f"(exit code {self.proc.returncode}); stderr:\n{self.stderr_text()}"
                )
            if line.startswith(self.PREFIX):
                self.addr = line[len(self.PREFIX):].strip()

    def stderr_text(self):
        self.stderr.flush()
        with open(self.stderr_path) as f:
            return f.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.stderr.close()


@pytest.fixture
def master(tmp_path):
    """A fresh master per test, so tests never see each other's keys or segments."""
    m = TychoMaster(tmp_path / "tycho-master.stderr")
    try:
        yield m
    finally:
        m.stop()
