"""The names of ``mooncake.store`` beside the store class: the object data types, the enums'
values at module level (as Mooncake's module exports them), the parallelism descriptions its
tensor methods take, a host memory allocator, NUMA binding, and the classes of features Tycho
does not have, which fail with a clear error when constructed."""

import ctypes
import enum
import os

from ._tycho import ReplicaStatus, TaskStatus, TaskType


class ObjectDataType(enum.IntEnum):
    """What an object holds (Mooncake's values)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9

    def __str__(self):
        # As Mooncake's enums print: "ObjectDataType.KVCACHE".
        return f"{type(self).__name__}.{self.name}"


def module_values():
    """The enum members Mooncake's module exports by name. Where two enums share a name, the
    one Mooncake's module ends up with wins: PROCESSING and FAILED are TaskStatus's, UNKNOWN is
    ObjectDataType's."""
    out = {}
    for name in ("UNDEFINED", "INITIALIZED", "PROCESSING", "COMPLETE", "REMOVED", "FAILED"):
        out[name] = getattr(ReplicaStatus, name)
    for name in ("REPLICA_COPY", "REPLICA_MOVE"):
        out[name] = getattr(TaskType, name)
    for name in ("PENDING", "PROCESSING", "FAILED", "SUCCESS"):
        out[name] = getattr(TaskStatus, name)
    for member in ObjectDataType:
        out[member.name] = member
    return out


class ParallelAxis:
    """One axis of a tensor's parallel layout: its kind ("tp", "ep", "pp", ...), this
    process's rank on it, the axis's size, and the dimension it splits, if any."""

    def __init__(self):
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim = None
        self.expert_id = None
        self.stage_id = None

    def __repr__(self):
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim}, expert_id={self.expert_id}, stage_id={self.stage_id})")


class TensorParallelism:
    """A tensor's parallel layout: its axes."""

    def __init__(self):
        self.axes = []

    def __repr__(self):
        return f"TensorParallelism(axes={self.axes!r})"


class ReadTarget:
    """What a parallel tensor read returns: the tensor as stored, one shard, or the full one."""

    def __init__(self):
        self.mode = "as_stored"
        self.parallelism = None

    def __repr__(self):
        return f"ReadTarget(mode={self.mode!r}, parallelism={self.parallelism!r})"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.posix_memalign.restype = ctypes.c_int
_libc.free.argtypes = [ctypes.c_void_p]
_libc.free.restype = None

# Alignment of the host allocator's blocks: a page, so that they can be registered as buffers.
_HOST_ALIGN = 4096


class MooncakeHostMemAllocator:
    """Host memory for buffers: ``alloc(size)`` returns the address of a page-aligned block (0
    when none can be had), ``free(addr)`` gives one back (0; -1 for an address this allocator
    did not hand out, which is left alone)."""

    def __init__(self):
        self._blocks = set()

    def alloc(self, size):
        if size <= 0:
            return 0
        ptr = ctypes.c_void_p()
        if _libc.posix_memalign(ctypes.byref(ptr), _HOST_ALIGN, size) != 0 or not ptr.value:
            return 0
        self._blocks.add(ptr.value)
        return ptr.value

    def free(self, addr):
        try:
            self._blocks.remove(addr)  # one thread wins; a second free of it gets -1
        except KeyError:
            return -1
        _libc.free(addr)
        return 0


# Page-aligned allocation and its free, as C functions `void *(size_t)` and `void (void *)`.
_libc.valloc.argtypes = [ctypes.c_size_t]
_libc.valloc.restype = ctypes.c_void_p


def get_alloc_func_addr():
    """The address of a C allocator, ``void *alloc(size_t size)``, returning page-aligned host
    memory (glibc's ``valloc``), for code that takes allocator function pointers."""
    return ctypes.cast(_libc.valloc, ctypes.c_void_p).value


def get_free_func_addr():
    """The address of the matching ``void free(void *ptr)``."""
    return ctypes.cast(_libc.free, ctypes.c_void_p).value


class DiskDescriptor:
    """Where a disk replica's bytes are (Mooncake's). Tycho keeps no disk replicas, so none is
    ever returned, and like Mooncake's it cannot be constructed."""

    file_path = ""
    object_size = 0

    def __init__(self, *args, **kwargs):
        raise TypeError("tycho.store.DiskDescriptor: No constructor defined!")


def _node_cpus(node):
    path = f"/sys/devices/system/node/node{int(node)}/cpulist"
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    cpus = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_to_numa_node(node):
    """Binds the calling thread to the CPUs of NUMA node ``node`` (those this process may use);
    its memory then comes from that node by first touch (Tycho sets no memory policy of its
    own). Raises ValueError for a node this machine does not have, or none of whose CPUs the
    process may use."""
    cpus = _node_cpus(node)
    if not cpus:
        raise ValueError(f"NUMA node {node} does not exist on this machine")
    usable = cpus & os.sched_getaffinity(0)
    if not usable:
        raise ValueError(f"none of NUMA node {node}'s CPUs is allowed to this process")
    os.sched_setaffinity(0, usable)


class _Unsupported:
    """A Mooncake class for a feature Tycho does not have: constructing it raises."""

    _why = ""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is not supported by Tycho: {self._why} "
                                  "(see docs/python.md)")


class EngramStore(_Unsupported):
    _why = "Engram embedding tables are a Mooncake feature outside the KV-cache store"


class EngramStoreConfig(_Unsupported):
    _why = "Engram embedding tables are a Mooncake feature outside the KV-cache store"


class MooncakeDistributedNoFRegister(_Unsupported):
    _why = "NVMe-over-Fabrics registration needs Mooncake's NoF transport, which Tycho does not have"
