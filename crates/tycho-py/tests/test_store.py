"""The `tycho.store` API against a real `tycho master`, with Mooncake's return conventions."""

import ctypes
import hashlib
import os
import threading
import time
import uuid

import pytest

from tycho.store import (
    DistributedStore,
    MooncakeDistributedStore,
    ReplicaDescriptor,
    ReplicateConfig,
    SoftPinAction,
)

OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
INVALID_PARAMS = -600


def key(prefix="k"):
    return f"{prefix}-{uuid.uuid4().hex}"


def registered(store, size, fill=0):
    buf = (ctypes.c_ubyte * size)(*([fill] * size)) if fill else (ctypes.c_ubyte * size)()
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, size) == 0
    return buf, ptr


def test_alias_and_exports():
    assert DistributedStore is MooncakeDistributedStore
    assert SoftPinAction.ENABLE != SoftPinAction.DISABLE
    c = ReplicateConfig()
    assert (c.replica_num, c.with_soft_pin, c.with_hard_pin) == (1, False, False)


def test_get_of_missing_key_is_empty_bytes(store):
    assert store.get(key()) == b""
    assert store.get_size(key()) == OBJECT_NOT_FOUND
    assert store.is_exist(key()) == 0


def test_put_is_put_if_absent(store):
    k = key()
    assert store.put(k, b"first") == 0
    assert store.put(k, b"second") == 0
    assert store.get(k) == b"first"
    assert store.get_size(k) == 5
    assert store.upsert(k, b"third value") == 0
    assert store.get(k) == b"third value"


def test_parts_and_batches(store):
    k = key()
    assert store.put_parts(k, b"Hello, ", bytearray(b"World"), memoryview(b"!")) == 0
    assert store.get(k) == b"Hello, World!"
    assert store.upsert_parts(k, b"a", b"b", config=ReplicateConfig()) == 0
    assert store.get(k) == b"ab"
    keys = [key("b") for _ in range(10)]
    values = [os.urandom(1000 + i) for i in range(10)]
    rc = store.put_batch(keys, values)
    assert isinstance(rc, int) and rc == 0
    assert store.get_batch(keys) == values
    assert store.get_batch([keys[0], key("missing")]) == [values[0], b""]
    assert store.upsert_batch(keys[:2], [b"x", b"y"]) == 0
    assert store.get_batch(keys[:2]) == [b"x", b"y"]
    assert store.batch_is_exist(keys + [key("nope")]) == [1] * 10 + [0]


def test_is_exist(store):
    k = key()
    assert store.is_exist(k) == 0
    store.put(k, b"v")
    assert store.is_exist(k) == 1


def test_remove_of_a_leased_object_waits_for_the_lease(store):
    k = key()
    store.put(k, b"v")
    assert store.get(k) == b"v"  # takes a 500 ms read lease
    assert store.remove(k) == OBJECT_HAS_LEASE
    deadline = time.time() + 5
    while store.remove(k) == OBJECT_HAS_LEASE:
        assert time.time() < deadline
        time.sleep(0.05)
    assert store.is_exist(k) == 0
    assert store.remove(k) == OBJECT_NOT_FOUND


def test_batch_remove_regex_and_all(store):
    tag = uuid.uuid4().hex
    keys = [f"rm-{tag}-{i}" for i in range(4)]
    for k in keys:
        store.put(k, b"v")
    assert store.batch_remove(keys[:2]) == [0, 0]
    assert store.batch_remove([keys[0]]) == [OBJECT_NOT_FOUND]
    # An unbalanced pattern is refused, not wrapped into one that matches every key.
    assert store.remove_by_regex("x)|(.*") == INVALID_PARAMS
    assert store.remove_by_regex("(") == INVALID_PARAMS
    # Both remaining keys are still there to be removed: the refused patterns removed nothing.
    assert store.remove_by_regex(tag) == 2  # searched anywhere in the key, as Mooncake
    store.put(key("all"), b"v")
    assert store.remove_all() >= 1
    assert store.get_batch([keys[3]]) == [b""]


def test_soft_pin_ttl_validation(store):
    c = ReplicateConfig()
    c.soft_pin_action = SoftPinAction.PRESERVE
    c.soft_pin_ttl_ms = 1000
    assert store.put(key(), b"v", c) == INVALID_PARAMS
    c.soft_pin_action = SoftPinAction.ENABLE
    assert store.put(key(), b"v", c) == 0
    c.soft_pin_ttl_ms = 25 * 3600 * 1000
    assert store.put(key(), b"v", c) == INVALID_PARAMS
    d = ReplicateConfig()
    d.with_soft_pin = True
    d.with_hard_pin = True
    assert store.put(key(), b"v", d) == 0


def test_zero_local_buffer_cannot_put(make_store):
    s = make_store(segment=0, buffer=0)
    k = key()
    assert s.put(k, b"value") < 0
    assert s.is_exist(k) == 0


def test_zero_copy_paths(store):
    size = 64 * 1024
    src, src_ptr = registered(store, size, fill=7)
    k = key()
    assert store.put_from(k, src_ptr, size) == 0
    dst, dst_ptr = registered(store, size)
    assert store.get_into(k, dst_ptr, size) == size
    assert bytes(dst) == bytes(src)
    assert store.upsert_from(k, src_ptr, 100) == 0
    assert store.get_size(k) == 100
    keys = [key("zc") for _ in range(4)]
    assert store.batch_put_from(keys, [src_ptr] * 4, [1000, 2000, 3000, 4000]) == [0, 0, 0, 0]
    assert store.batch_upsert_from(keys[:1], [src_ptr], [10]) == [0]
    outs = [registered(store, 4096) for _ in range(4)]
    got = store.batch_get_into(keys + [key("x")], [p for _, p in outs] + [outs[0][1]], [4096] * 5)
    assert got == [10, 2000, 3000, 4000, OBJECT_NOT_FOUND]
    # Unregistered memory is refused, not touched.
    assert store.unregister_buffer(src_ptr) == 0
    assert store.put_from(key(), src_ptr, size) == INVALID_PARAMS
    assert store.unregister_buffer(src_ptr) != 0


def test_get_into_ranges(store):
    k1, k2 = key(), key()
    store.put(k1, bytes(range(64)))
    store.put(k2, bytes(range(100, 164)))
    b0, p0 = registered(store, 32)
    b1, p1 = registered(store, 32)
    res = store.get_into_ranges(
        [p0, p1],
        [[k1, k2], [k2, k1]],
        [[[0, 20], [8]], [[4], [16]]],
        [[[1, 30], [2]], [[0], [10]]],
        [[[4, 3], [5]], [[6], [4]]],
    )
    assert res == [[[4, 3], [5]], [[6], [4]]]
    assert bytes(b0[0:4]) == bytes(range(1, 5))
    assert bytes(b0[20:23]) == bytes(range(30, 33))
    assert bytes(b0[8:13]) == bytes(range(102, 107))
    assert bytes(b1[4:10]) == bytes(range(100, 106))
    assert bytes(b1[16:20]) == bytes(range(10, 14))
    bad = store.get_into_ranges([p0], [[key("missing")]], [[[0]]], [[[0]]], [[[4]]])
    assert bad[0][0][0] == OBJECT_NOT_FOUND


def test_buffers_and_descriptors(store):
    k = key()
    store.put(k, b"buffer-bytes")
    buf = store.get_buffer(k)
    assert buf is not None and buf.size() == 12 and len(buf) == 12
    assert bytes(memoryview(buf)) == b"buffer-bytes"
    assert store.get_buffer(key()) is None
    bufs = store.batch_get_buffer([k, key()])
    assert bytes(memoryview(bufs[0])) == b"buffer-bytes" and bufs[1] is None
    descs = store.get_replica_desc(k)
    assert len(descs) == 1 and isinstance(descs[0], ReplicaDescriptor)
    assert descs[0].is_memory_replica() and not descs[0].is_disk_replica()
    assert descs[0].get_memory_descriptor().buffer_descriptor.size == 12
    m = store.batch_get_replica_desc([k, key()])
    assert list(m.keys()) == [k]


def test_hostname_health_and_setup_forms(master):
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    rc = s.setup({
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "16MB",
        "local_buffer_size": "16 MiB",
        "protocol": "tcp",
        "master_server_address": master.addr,
    })
    assert rc == 0
    host, port = s.get_hostname().rsplit(":", 1)
    assert host == "127.0.0.1" and 12300 <= int(port) < 14300
    assert s.health_check() == 0
    assert s.close() == 0
    assert s.health_check() == 1
    assert s.setup("127.0.0.1", "x", master_server_addr=master.addr, global_segment_size=0) == 0
    assert s.close() == 0
    with pytest.raises(TypeError):
        s.setup("127.0.0.1", "x", bogus=1)


def test_close_then_setup_again(make_store, master):
    a = make_store()
    b = make_store(segment=0)
    only_a = ReplicateConfig()
    only_a.preferred_segment = a.get_hostname()
    k = key()
    assert a.put(k, b"in a", only_a) == 0
    assert b.get(k) == b"in a"
    assert a.close() == 0
    assert b.is_exist(k) == 0
    assert a.setup("127.0.0.1", "x", 64 << 20, 64 << 20, "tcp", "", master.addr) == 0
    k2 = key()
    assert a.put(k2, b"again") == 0
    assert b.get(k2) == b"again"


def test_two_stores_replica_two_survives_one_closing(make_store):
    a = make_store()
    b = make_store()
    c = ReplicateConfig()
    c.replica_num = 2
    k = key()
    value = os.urandom(256 * 1024)
    assert a.put(k, value, c) == 0
    assert len(a.get_replica_desc(k)) == 2
    a.close()
    assert b.get(k) == value
    assert len(b.get_replica_desc(k)) == 1


def test_eight_threads_share_one_store(make_store):
    # Room for every value at once: force-removed values stay reserved while their read
    # lease (500 ms here) lasts, and 8 threads write faster than that.
    s = make_store(segment="1GB", buffer="16MB")
    errors = []

    def work(t):
        try:
            for i in range(100):
                k = f"thr-{t}-{i}-{uuid.uuid4().hex[:8]}"
                v = os.urandom(1024 * 1024)
                assert s.put(k, v) == 0
                got = s.get(k)
                assert hashlib.sha256(got).digest() == hashlib.sha256(v).digest()
                assert s.remove(k, True) == 0
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---- what Tycho does beyond (or better than) Mooncake --------------------------------------


def test_values_are_their_buffers_bytes(store):
    import array

    k = key()
    # Mooncake stores len(items) bytes of a multi-byte array; Tycho stores all of its bytes.
    assert store.put(k, array.array("i", [1, 2])) == 0
    assert store.get(k) == array.array("i", [1, 2]).tobytes()
    # A strided view is stored as the bytes it shows, not the memory under it.
    k = key()
    assert store.put(k, memoryview(b"abcdef")[::2]) == 0
    assert store.get(k) == b"ace"
    k = key()
    assert store.put_parts(k, memoryview(b"abcdef")[1::2], array.array("h", [0x0102])) == 0
    assert store.get(k) == b"bdf" + array.array("h", [0x0102]).tobytes()


def _first_clear(store, keys, segment="", within=5.0):
    """Calls batch_replica_clear until it clears something (the read leases it waits out are
    500 ms on the fixture's master); returns what it cleared."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        cleared = store.batch_replica_clear(keys, segment)
        if cleared:
            return cleared
        time.sleep(0.02)
    return []


def test_batch_replica_clear_after_the_lease(make_store):
    a, b = make_store(), make_store()
    mine, theirs, two = key("mine"), key("theirs"), key("two")
    assert a.put(mine, b"1") == 0
    assert b.put(theirs, b"2") == 0
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    cfg.preferred_segments = [a.get_hostname(), b.get_hostname()]
    assert a.put(two, b"3" * 100, cfg) == 0
    assert a.get(mine) == b"1" and b.get(theirs) == b"2"  # read leases on both
    assert sorted(r.memory.buffer_descriptor.transport_endpoint for r in a.get_replica_desc(two)) == sorted(
        cfg.preferred_segments)
    # Leased: nothing is cleared yet.
    assert a.batch_replica_clear([mine, theirs, two]) == []
    # Once the leases end, only objects this store wrote are cleared.
    assert _first_clear(a, [mine, theirs, key("missing")]) == [mine]
    assert a.is_exist(mine) == 0 and b.get(theirs) == b"2"
    # Clearing on one segment keeps the replica on the other.
    assert _first_clear(a, [two], b.get_hostname()) == [two]
    left = a.get_replica_desc(two)
    assert [r.memory.buffer_descriptor.transport_endpoint for r in left] == [a.get_hostname()]
    assert b.get(two) == b"3" * 100


def test_multi_buffer_reads_leave_spare_room_alone(store):
    src = (ctypes.c_ubyte * 8)(*range(8))
    dst = (ctypes.c_ubyte * 32)(*([0xEE] * 32))
    ps, pd = ctypes.addressof(src), ctypes.addressof(dst)
    assert store.register_buffer(ps, 8) == 0 and store.register_buffer(pd, 32) == 0
    k = key()
    assert store.put_from(k, ps, 8) == 0
    # Mooncake fails buffers larger than the object (-800); Tycho fills them in order.
    assert store.batch_get_into_multi_buffers([k], [[pd, pd + 16]], [[5, 16]]) == [8]
    assert bytes(dst[0:5]) == bytes(range(5)) and bytes(dst[16:19]) == bytes(range(5, 8))
    assert bytes(dst[5:16]) == b"\xee" * 11 and bytes(dst[19:32]) == b"\xee" * 13
    # Unregistered memory is refused, never touched.
    assert store.batch_get_into_multi_buffers([k], [[12345]], [[8]]) == [INVALID_PARAMS]
    assert store.batch_put_from_multi_buffers([key()], [[12345]], [[8]]) == [INVALID_PARAMS]


def test_ranged_reads_without_a_session(store):
    src = (ctypes.c_ubyte * 100)(*range(100))
    dst = (ctypes.c_ubyte * 20)()
    ps, pd = ctypes.addressof(src), ctypes.addressof(dst)
    assert store.register_buffer(ps, 100) == 0 and store.register_buffer(pd, 20) == 0
    k = key()
    assert store.put_from(k, ps, 100) == 0
    got = store.batch_get_into_multi_buffer_ranges([k, key()], [[pd, pd + 10], [pd]], [[4, 4], [1]], [[0, 96], [0]])
    assert got == [8, OBJECT_NOT_FOUND]
    assert bytes(dst[0:4]) == bytes(range(4)) and bytes(dst[10:14]) == bytes(range(96, 100))
    assert store.batch_get_into_multi_buffer_ranges([k], [[pd]], [[8]], [[96]]) == [INVALID_PARAMS]


def test_setup_forms_sglang_and_lmcache_use(master):
    s = MooncakeDistributedStore()
    # LMCache forwards the legacy key spelling; Tycho reads it (Mooncake ignores it).
    rc = s.setup({"local_hostname": "127.0.0.1", "metadata_server": "x", "global_segment_size": "16MB",
                  "local_buffer_size": "16MB", "protocol": "tcp", "master_server_address": master.addr})
    assert rc == 0
    s.close()
    s = MooncakeDistributedStore()
    with pytest.raises(TypeError):
        s.setup("127.0.0.1", "x", 1, 1, "tcp", "", master.addr, None, False, "", "default", False, 9300, "extra")
    with pytest.raises(TypeError):
        s.setup("127.0.0.1", "x", 1, 1, "tcp", "", master.addr, no_such_argument=1)
    assert s.setup("127.0.0.1", "x", "50%", 1, "tcp", "", master.addr) == INVALID_PARAMS
    # A named tenant keeps its keys apart from the default one.
    t = MooncakeDistributedStore()
    d = MooncakeDistributedStore()
    assert t.setup("127.0.0.1", "x", 16 << 20, 16 << 20, "tcp", "", master.addr, tenant_id="team-a") == 0
    assert d.setup("127.0.0.1", "x", 16 << 20, 16 << 20, "tcp", "", master.addr, tenant_id="default") == 0
    k = key()
    assert t.put(k, b"a") == 0
    assert d.is_exist(k) == 0 and t.get(k) == b"a"
    t.close()
    d.close()


def test_master_takes_mooncake_flags():
    from conftest import Master

    m = Master("--default_kv_lease_ttl=1s", "--enable_offload=true", "--dynamic_replication_mode=observe",
               "--max_total_pending_tasks=5", "--client_ttl=2s", "-logtostderr", "--noenable_ha")
    try:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "x", 16 << 20, 16 << 20, "tcp", "", m.addr) == 0
        k = key()
        assert s.put(k, b"v") == 0 and s.get(k) == b"v"
        s.close()
    finally:
        m.stop()
    import subprocess

    from conftest import _tycho_bin

    bin_ = _tycho_bin()

    for flag in ("--enable_oplog", "--enable_snapshot=1", "--flagfile=/etc/x"):
        r = subprocess.run([bin_, "master", "--rpc-port", "0", flag], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "not supported" in r.stderr, (flag, r.stderr)
    # HA is on with etcd endpoints; asked for without them, the master says what it needs.
    r = subprocess.run([bin_, "master", "--rpc-port", "0", "--enable_ha=true"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "--etcd-endpoints" in r.stderr, r.stderr


def test_a_store_left_open_is_closed_when_its_process_exits():
    import subprocess
    import sys

    from conftest import Master, _tycho_bin

    # A client TTL far longer than the test: only the stores closing themselves can unmount.
    m = Master("--client-ttl", "60")
    script = (
        "import sys\n"
        "from tycho.store import MooncakeDistributedStore\n"
        "KEPT = MooncakeDistributedStore()  # a module global, never closed\n"
        "assert KEPT.setup('127.0.0.1', 'x', 16 << 20, 16 << 20, 'tcp', '', sys.argv[1]) == 0\n"
        "dropped = MooncakeDistributedStore()  # dropped before exit\n"
        "assert dropped.setup('127.0.0.1', 'x', 16 << 20, 16 << 20, 'tcp', '', sys.argv[1]) == 0\n"
        "assert KEPT.put(sys.argv[2], b'v') == 0\n"
        "print(KEPT.get_hostname(), dropped.get_hostname(), flush=True)\n"
        "del dropped\n"
    )

    def segment_names():
        r = subprocess.run([_tycho_bin(), "segments", "--master", m.addr], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout

    try:
        k = key()
        r = subprocess.run([sys.executable, "-c", script, m.addr, k], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        names = r.stdout.split()
        assert len(names) == 2
        listing = segment_names()
        for name in names:
            assert name not in listing, listing
        observer = MooncakeDistributedStore()
        assert observer.setup("127.0.0.1", "x", 0, 16 << 20, "tcp", "", m.addr) == 0
        assert observer.is_exist(k) == 0
        observer.close()
    finally:
        m.stop()


def test_a_forked_child_leaves_its_parents_store_alone(master):
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from tycho.store import MooncakeDistributedStore\n"
        "s = MooncakeDistributedStore()\n"
        "assert s.setup('127.0.0.1', 'x', 16 << 20, 16 << 20, 'tcp', '', sys.argv[1]) == 0\n"
        "assert s.put('forked', b'parent') == 0\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)  # a normal exit: atexit handlers and finalizers run in the child\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert status == 0, status\n"
        "assert s.get('forked') == b'parent'\n"
        "assert s.put('after-fork', b'still mounted') == 0 and s.get('after-fork') == b'still mounted'\n"
        "s.close()\n"
        "print('ok', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", script, master.addr], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_unsupported_mooncake_classes_fail_clearly_and_numa_binding_checks_the_node():
    import os

    import pytest

    import tycho.store as ts

    for cls in (ts.EngramStore, ts.EngramStoreConfig, ts.MooncakeDistributedNoFRegister):
        with pytest.raises(NotImplementedError, match="not supported by Tycho"):
            cls()
    if os.path.exists("/sys/devices/system/node/node0"):
        before = os.sched_getaffinity(0)
        try:
            ts.bind_to_numa_node(0)
            assert os.sched_getaffinity(0) <= before
        finally:
            os.sched_setaffinity(0, before)
    with pytest.raises(ValueError, match="does not exist"):
        ts.bind_to_numa_node(4095)
    alloc = ts.MooncakeHostMemAllocator()
    assert alloc.alloc(0) == 0
    assert alloc.free(12345) == -1, "an address it did not hand out is left alone"


def test_a_store_that_closes_revokes_its_open_put_sessions(make_store):
    a, b = make_store(), make_store()
    k = key()
    assert a.batch_put_session_start([k], [64]) == [0]
    # Being written: another store's put of the key is refused (put-if-absent says done).
    assert b.batch_put_session_start([k], [64]) == [-705]
    assert a.close() == 0
    # The close revoked it: the key is free at once, not after the discard timeout.
    assert b.put(k, b"v" * 64) == 0
    assert b.get(k) == b"v" * 64
