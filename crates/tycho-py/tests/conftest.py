"""Fixtures: a real `tycho master` process on a free loopback port, and stores set up
against it."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tycho.store import MooncakeDistributedStore

ROOT = Path(__file__).resolve().parents[3]


def _tycho_bin():
    explicit = os.environ.get("TYCHO_BIN")
    if explicit:
        return explicit
    for profile in ("debug", "release"):
        p = ROOT / "target" / profile / "tycho"
        if p.exists():
            return str(p)
    raise RuntimeError("build the tycho binary first (cargo build) or set TYCHO_BIN")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    def __init__(self, *extra):
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        args = [_tycho_bin(), "master", "--rpc-address", "127.0.0.1", "--rpc-port", str(self.port),
                "--metrics-port", "0", *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError("tycho master did not start")
                time.sleep(0.02)

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
