"""Return conventions of the methods real clients (LMCache, SGLang HiCache) call, with one body
for both stores. Every expected value here was seen from Mooncake's wheel first."""

import array
import ctypes
import uuid

import pytest

from conftest import METADATA

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704


def key(prefix="c"):
    return f"{prefix}-{uuid.uuid4().hex}"


def registered(store, size, fill=0):
    buf = (ctypes.c_ubyte * size)(*([fill] * size))
    assert store.register_buffer(ctypes.addressof(buf), size) == 0
    return buf, ctypes.addressof(buf)


# ---- bytes-like values --------------------------------------------------------------------


def test_values_may_be_any_one_byte_buffer(store):
    raw = (ctypes.c_ubyte * 8)(*range(8))
    values = {
        "ctypes": memoryview(raw),  # format "<B", what LMCache passes
        "bytearray": bytearray(b"ab"),
        "array_b": array.array("b", [1, 2]),
        "array_B": array.array("B", [3, 4]),
        "c_char": memoryview((ctypes.c_char * 3)(b"a", b"b", b"c")),
        "bytes": b"xyz",
    }
    for name, v in values.items():
        k = key(name)
        assert store.put(k, v) == 0, name
        assert store.get(k) == bytes(v), name


def test_put_parts_takes_ctypes_views(store):
    k = key()
    raw = (ctypes.c_ubyte * 4)(1, 2, 3, 4)
    assert store.put_parts(k, memoryview(raw), b"xy", bytearray(b"z")) == 0
    assert store.get(k) == b"\x01\x02\x03\x04xyz"


def test_put_batch_and_upsert_take_ctypes_views(store):
    k1, k2 = key(), key()
    raw = (ctypes.c_ubyte * 4)(9, 8, 7, 6)
    assert store.put_batch([k1, k2], [memoryview(raw), array.array("B", [5])]) == 0
    assert store.get(k1) == b"\x09\x08\x07\x06" and store.get(k2) == b"\x05"
    assert store.upsert(k1, memoryview((ctypes.c_ubyte * 2)(1, 1))) == 0
    assert store.get(k1) == b"\x01\x01"


def test_a_str_value_is_a_type_error(store):
    with pytest.raises(TypeError):
        store.put(key(), "text")


# ---- setup ----------------------------------------------------------------------------------


def test_setup_with_eight_positional_arguments(master, mc):
    s = mc.MooncakeDistributedStore()
    # SGLang passes the transfer engine (None) as the eighth argument.
    assert s.setup("127.0.0.1", METADATA, 16 << 20, 16 << 20, "tcp", "", master.addr, None) == 0
    k = key()
    assert s.put(k, b"v") == 0 and s.get(k) == b"v"
    s.close()


def test_setup_keywords_with_the_default_tenant(master, mc):
    s = mc.MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", METADATA, 16 << 20, 16 << 20, "tcp", "", master.addr,
                 engine=None, enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
                 enable_client_http_server=False, client_http_port=9300)
    assert rc == 0
    s.close()


def test_setup_dict_ignores_unknown_keys(master, mc):
    s = mc.MooncakeDistributedStore()
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": METADATA, "global_segment_size": "16MB",
           "local_buffer_size": "16MB", "protocol": "tcp", "master_server_addr": master.addr,
           "device_name": "", "mooncake_something": 3, "zzz": 1}
    assert s.setup(cfg) == 0
    s.close()


def test_setup_dict_with_an_unusable_size_returns_a_code(master, mc):
    s = mc.MooncakeDistributedStore()
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": METADATA, "global_segment_size": "50%",
           "local_buffer_size": "16MB", "protocol": "tcp", "master_server_addr": master.addr}
    assert s.setup(cfg) == INVALID_PARAMS


# ---- ReplicateConfig ------------------------------------------------------------------------


def test_replicate_config_defaults(mc):
    c = mc.ReplicateConfig()
    assert c.replica_num == 1
    assert c.soft_pin_action == mc.SoftPinAction.PRESERVE
    assert c.soft_pin_ttl_ms is None
    assert c.with_hard_pin is False
    assert c.preferred_segment == ""
    assert list(c.preferred_segments) == []
    assert c.prefer_alloc_in_same_node is False
    assert c.group_ids is None
    assert [int(mc.SoftPinAction.PRESERVE), int(mc.SoftPinAction.ENABLE), int(mc.SoftPinAction.DISABLE)] == [0, 1, 2]


def test_replicate_config_soft_pin_ttl_range(mc):
    c = mc.ReplicateConfig()
    for bad in (-1, 2**64, 1.5, "3"):
        with pytest.raises(TypeError):
            c.soft_pin_ttl_ms = bad
    c.soft_pin_ttl_ms = 2**64 - 1
    assert c.soft_pin_ttl_ms == 2**64 - 1
    c.soft_pin_ttl_ms = None
    assert c.soft_pin_ttl_ms is None


def test_replicate_config_group_ids(mc):
    c = mc.ReplicateConfig()
    c.group_ids = ["a", "b"]
    assert list(c.group_ids) == ["a", "b"]


def test_a_write_with_an_enabled_soft_pin(store, mc):
    c = mc.ReplicateConfig()
    c.soft_pin_action = mc.SoftPinAction.ENABLE
    c.soft_pin_ttl_ms = 60_000
    k = key()
    assert store.put(k, b"pinned", c) == 0
    assert store.get(k) == b"pinned"


# ---- get_into_ranges ----------------------------------------------------------------------


def test_get_into_ranges(store):
    big, base = registered(store, 4096)
    for i in range(1000):
        big[i] = i % 251
    k = key()
    assert store.put_from(k, base, 1000) == 0
    dst = base + 2000
    # Two keys in one buffer: one with ragged lists gets one code, the other is still read.
    assert store.get_into_ranges([dst], [[k, k]], [[[0], []]], [[[0, 1], []]], [[[], []]]) == [[[INVALID_PARAMS], []]]
    assert store.get_into_ranges([dst], [[k, k]], [[[0, 10], [20]]], [[[0, 5], [7]]], [[[4, 4], [3]]]) == [[[4, 4], [3]]]
    assert bytes(big[2000:2004]) == bytes(range(4)) and bytes(big[2010:2014]) == bytes(range(5, 9))
    assert bytes(big[2020:2023]) == bytes(range(7, 10))
    assert store.get_into_ranges([dst], [[k, key()]], [[[0], [20]]], [[[0], [7]]], [[[4], [3]]]) == [[[4], [OBJECT_NOT_FOUND]]]
    assert store.get_into_ranges([dst], [[k]], [[[0]]], [[[990]]], [[[20]]]) == [[[INVALID_PARAMS]]]
    # Outer lists of different lengths: one code per buffer.
    assert store.get_into_ranges([dst, base], [[k]], [[[0]]], [[[990]]], [[[20]]]) == [[[INVALID_PARAMS]], [[INVALID_PARAMS]]]


# ---- multi-buffer batches -------------------------------------------------------------------


def test_multi_buffer_put_and_get(store):
    b1, a1 = registered(store, 16, 1)
    b2, a2 = registered(store, 16, 2)
    b3, a3 = registered(store, 64)
    k1, k2 = key(), key()
    assert store.batch_put_from_multi_buffers([k1, k2], [[a1, a2], [a2]], [[16, 8], [4]]) == [0, 0]
    assert store.get(k1) == b"\x01" * 16 + b"\x02" * 8
    assert store.get(k2) == b"\x02" * 4
    assert store.batch_get_into_multi_buffers([k1, k2], [[a3, a3 + 20], [a3 + 40]], [[10, 14], [4]]) == [24, 4]
    assert bytes(b3[0:10]) == b"\x01" * 10
    assert bytes(b3[20:34]) == b"\x01" * 6 + b"\x02" * 8
    assert bytes(b3[40:44]) == b"\x02" * 4


def test_multi_buffer_shape_errors(store):
    keep1, a1 = registered(store, 16, 1)
    keep2, a3 = registered(store, 64)
    k1 = key()
    assert store.batch_put_from_multi_buffers([key(), key()], [[a1, a1], [a1]], [[16], [4]]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers([key()], [[a1], [a1]], [[16]]) == [INVALID_PARAMS]
    assert store.batch_put_from_multi_buffers([k1], [[a1]], [[16]]) == [0]
    # Buffers smaller than the object in total, and a missing key.
    assert store.batch_get_into_multi_buffers([k1, key()], [[a3], [a3 + 40]], [[10], [4]]) == [INVALID_PARAMS, OBJECT_NOT_FOUND]


def test_ranged_put_without_a_session_is_refused(store):
    keep3, a1 = registered(store, 16, 1)
    k = key()
    assert store.batch_put_from_multi_buffer_ranges([k], [[a1]], [[4]], [[0]]) == [INVALID_PARAMS]
    assert store.is_exist(k) == 0


def test_a_put_session_reserves_then_takes_ranged_writes_then_commits(store):
    keep, a = registered(store, 64, 7)
    k1, k2, k3 = key(), key(), key()
    assert store.put(k3, b"x" * 10) == 0
    OBJECT_ALREADY_EXISTS = -705
    assert store.batch_put_session_start([k1, k2, k3], [32, 16, 10]) == [0, 0, OBJECT_ALREADY_EXISTS]
    # Reserved, not readable.
    assert store.is_exist(k1) == 0 and store.get(k1) == b""
    assert store.batch_put_from_multi_buffer_ranges([k1, k2], [[a, a + 16], [a]], [[16, 16], [8]], [[0, 16], [4]]) == [32, 8]
    assert store.batch_put_from_multi_buffer_ranges([k1], [[a]], [[16]], [[20]]) == [INVALID_PARAMS], "past the end"
    assert store.batch_put_session_end([k1, key()]) == [0, INVALID_PARAMS]
    assert store.get(k1) == b"\x07" * 32
    assert store.batch_put_session_end([k1]) == [INVALID_PARAMS], "ended already"
    assert store.batch_put_session_revoke([k2, key()]) == [0, INVALID_PARAMS]
    assert store.is_exist(k2) == 0
    assert store.batch_put_session_start([key()], [0]) == [INVALID_PARAMS]
    assert store.batch_put_session_start([key(), key()], [8]) == [INVALID_PARAMS] * 2
    # What no ranged write covered reads as zeros.
    k4 = key()
    assert store.batch_put_session_start([k4], [32]) == [0]
    assert store.batch_put_from_multi_buffer_ranges([k4], [[a]], [[16]], [[0]]) == [16]
    assert store.batch_put_session_end([k4]) == [0]
    assert store.get(k4) == b"\x07" * 16 + b"\x00" * 16


def test_a_get_session_checks_its_keys_and_reads_go_on(store):
    k = key()
    assert store.put(k, b"g" * 100) == 0
    assert store.batch_get_session_start([k, key()]) == [0, OBJECT_NOT_FOUND]
    assert store.get(k) == b"g" * 100
    assert store.batch_get_session_end([k]) == 0
    assert store.batch_get_session_end([key()]) == 0 and store.batch_get_session_end([]) == 0
    assert store.get(k) == b"g" * 100


def test_put_from_with_metadata(store):
    keep4, data = registered(store, 16, 1)
    meta_buf = (ctypes.c_ubyte * 4)(*b"META")
    meta = ctypes.addressof(meta_buf)
    assert store.register_buffer(meta, 4) == 0
    k = key()
    assert store.put_from_with_metadata(k, data, meta, 16, 4) == 0
    assert store.get(k) == b"META" + b"\x01" * 16
    assert store.get_size(k) == 20


# ---- batch_replica_clear --------------------------------------------------------------------


def test_batch_replica_clear_skips_leased_and_missing_keys(store):
    k = key()
    assert store.put(k, b"v") == 0
    assert store.get(k) == b"v"  # takes a read lease
    assert store.batch_replica_clear([k, key()]) == []
    assert store.get(k) == b"v"


# ---- the calls LMCache and SGLang make ------------------------------------------------------


def test_client_call_conventions(store):
    k = key()
    assert store.get(key()) == b""
    assert store.get_size(key()) == OBJECT_NOT_FOUND
    assert store.is_exist(key()) == 0
    assert store.batch_is_exist([k]) == [0]
    assert store.put(k, b"hello") == 0
    assert store.batch_is_exist([k, key()]) == [1, 0]
    handles = store.batch_get_buffer([k, key()])
    assert bytes(memoryview(handles[0])) == b"hello" and handles[1] is None
    # Writable, as torch.frombuffer (LMCache) expects; writing changes only this copy.
    view = memoryview(handles[0]).cast("B")
    assert not view.readonly
    view[0] = ord("j")
    assert bytes(view) == b"jello" and store.get(k) == b"hello"
    keep5, src = registered(store, 64, 7)
    keep6, dst = registered(store, 64)
    k2 = key()
    assert store.batch_put_from([k2], [src], [32]) == [0]
    assert store.batch_get_into([k2, key()], [dst, dst + 32], [32, 32]) == [32, OBJECT_NOT_FOUND]
    assert ctypes.string_at(dst, 32) == b"\x07" * 32
    assert store.get_into(k2, dst, 64) == 32
    assert store.remove_all(True) >= 2


# ---- copy and move tasks ------------------------------------------------------------------

TASK_NOT_FOUND = -1400


def wait_task(store, mc, task_id, timeout=30):
    """The task's answer once it has ended (bounded wait)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        resp, rc = store.query_task(task_id)
        assert rc == 0 and resp is not None, rc
        if resp.status in (mc.TaskStatus.SUCCESS, mc.TaskStatus.FAILED):
            return resp
        assert time.monotonic() < deadline, f"task {task_id} still {resp.status}"
        time.sleep(0.05)


def on_segment(mc, name):
    cfg = mc.ReplicateConfig()
    cfg.preferred_segment = name
    return cfg


def test_task_enums_and_fields(mc):
    assert [int(mc.TaskType.REPLICA_COPY), int(mc.TaskType.REPLICA_MOVE)] == [0, 1]
    assert [int(s) for s in (mc.TaskStatus.PENDING, mc.TaskStatus.PROCESSING, mc.TaskStatus.FAILED,
                             mc.TaskStatus.SUCCESS)] == [0, 1, 2, 3]
    names = ["UNDEFINED", "INITIALIZED", "PROCESSING", "COMPLETE", "REMOVED", "FAILED"]
    assert [int(getattr(mc.ReplicaStatus, n)) for n in names] == list(range(6))
    fields = {"id", "type", "status", "created_at_ms_epoch", "last_updated_at_ms_epoch", "assigned_client", "message"}
    assert fields <= set(dir(mc.QueryTaskResponse))


def test_a_copy_task_adds_a_replica_on_the_target(make_store, mc):
    a, b = make_store(), make_store()
    k = key("copy")
    assert a.put(k, b"c" * 10000, on_segment(mc, a.get_hostname())) == 0
    assert len(a.get_replica_desc(k)) == 1
    task_id, rc = a.create_copy_task(k, [b.get_hostname()])
    assert rc == 0 and isinstance(task_id, tuple) and len(task_id) == 2 and task_id != (0, 0)
    resp = wait_task(a, mc, task_id)
    assert resp.status == mc.TaskStatus.SUCCESS, resp.message
    assert resp.type == mc.TaskType.REPLICA_COPY and resp.id == task_id
    assert isinstance(resp.assigned_client, tuple) and resp.created_at_ms_epoch > 0
    assert resp.last_updated_at_ms_epoch >= resp.created_at_ms_epoch
    assert len(a.get_replica_desc(k)) == 2
    assert b.get(k) == b"c" * 10000
    # A copy onto a segment that holds the value already is accepted (and has nothing to do).
    again, rc = a.create_copy_task(k, [b.get_hostname()])
    assert rc == 0 and again != (0, 0)
    assert wait_task(a, mc, again).status == mc.TaskStatus.SUCCESS


def test_a_move_task_moves_the_replica(make_store, mc):
    a, b = make_store(), make_store()
    k = key("move")
    assert a.put(k, b"m" * 5000, on_segment(mc, a.get_hostname())) == 0
    endpoint = lambda d: d.get_memory_descriptor().buffer_descriptor.transport_endpoint  # noqa: E731
    before = [endpoint(d) for d in a.get_replica_desc(k)]
    assert len(before) == 1
    task_id, rc = a.create_move_task(k, a.get_hostname(), b.get_hostname())
    assert rc == 0
    resp = wait_task(a, mc, task_id)
    assert resp.status == mc.TaskStatus.SUCCESS and resp.type == mc.TaskType.REPLICA_MOVE, resp.message
    after = [endpoint(d) for d in a.get_replica_desc(k)]
    assert len(after) == 1 and after != before, (before, after)
    assert a.get(k) == b"m" * 5000 and b.get(k) == b"m" * 5000


def test_task_errors_and_unknown_ids(make_store, mc):
    a, b = make_store(), make_store()
    k = key("task-errors")
    assert a.put(k, b"e" * 100, on_segment(mc, a.get_hostname())) == 0
    assert a.create_copy_task(key("missing"), [b.get_hostname()]) == ((0, 0), OBJECT_NOT_FOUND)
    assert a.create_copy_task(k, ["127.0.0.1:1"]) == ((0, 0), INVALID_PARAMS)
    assert a.create_copy_task(k, []) == ((0, 0), INVALID_PARAMS)
    assert a.create_move_task(k, "127.0.0.1:1", b.get_hostname()) == ((0, 0), INVALID_PARAMS)
    assert a.create_move_task(k, b.get_hostname(), a.get_hostname()) == ((0, 0), INVALID_PARAMS)
    assert a.create_move_task(k, a.get_hostname(), a.get_hostname()) == ((0, 0), INVALID_PARAMS)
    assert a.query_task((1, 2)) == (None, TASK_NOT_FOUND)
    assert a.query_task((0, 0)) == (None, TASK_NOT_FOUND)


def test_module_level_enum_values_and_data_types(mc):
    names = ["UNKNOWN", "KVCACHE", "TENSOR", "WEIGHT", "SAMPLE", "ACTIVATION", "GRADIENT",
             "OPTIMIZER_STATE", "METADATA", "GENERAL"]
    assert [int(getattr(mc.ObjectDataType, n)) for n in names] == list(range(10))
    assert [getattr(mc.ObjectDataType, n).name for n in names] == names
    assert str(mc.ObjectDataType.KVCACHE) == "ObjectDataType.KVCACHE"
    # The module exports every member by name; shared names are TaskStatus's (and UNKNOWN the
    # data type's).
    assert mc.KVCACHE == mc.ObjectDataType.KVCACHE and mc.UNKNOWN == mc.ObjectDataType.UNKNOWN
    assert mc.REPLICA_COPY == mc.TaskType.REPLICA_COPY and mc.REPLICA_MOVE == mc.TaskType.REPLICA_MOVE
    assert mc.PENDING == mc.TaskStatus.PENDING and mc.SUCCESS == mc.TaskStatus.SUCCESS
    assert mc.PROCESSING == mc.TaskStatus.PROCESSING and mc.FAILED == mc.TaskStatus.FAILED
    assert mc.COMPLETE == mc.ReplicaStatus.COMPLETE and mc.REMOVED == mc.ReplicaStatus.REMOVED
    assert mc.UNDEFINED == mc.ReplicaStatus.UNDEFINED and mc.INITIALIZED == mc.ReplicaStatus.INITIALIZED


def test_parallelism_descriptions_and_their_defaults(mc):
    axis = mc.ParallelAxis()
    assert (axis.kind, axis.rank, axis.size, axis.split_dim, axis.expert_id, axis.stage_id) == ("", 0, 1, None, None, None)
    axis.kind, axis.rank, axis.size, axis.split_dim = "tp", 1, 4, 0
    assert (axis.kind, axis.rank, axis.size, axis.split_dim) == ("tp", 1, 4, 0)
    assert mc.TensorParallelism().axes == []
    target = mc.ReadTarget()
    assert (target.mode, target.parallelism) == ("as_stored", None)


def test_the_host_memory_allocator_hands_out_usable_blocks(mc):
    import ctypes

    alloc = mc.MooncakeHostMemAllocator()
    addr = alloc.alloc(1 << 20)
    assert addr != 0
    ctypes.memset(addr, 0x5A, 1 << 20)
    assert ctypes.string_at(addr + (1 << 20) - 4, 4) == b"ZZZZ"
    assert alloc.free(addr) == 0
