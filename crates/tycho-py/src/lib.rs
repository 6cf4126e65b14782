//! The `tycho._tycho` extension: the store client behind `tycho.store`.
//!
//! Every method that talks to the network or copies bytes releases the GIL, so several
//! Python threads can share one store. Return values follow Mooncake Store's conventions:
//! ints with 0 for success and negative error codes, `b""` for a missing key.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::RwLock;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use tycho_client::{Client, ClientConfig, Protocol, WriteMode};
use tycho_proto::{ErrorCode, ReplicaDesc};

// Rust-side allocations of the extension (keys, frames) bypass glibc malloc; Python objects
// still come from Python's allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A removal's answer as Mooncake gives it: the count removed, even when some primary failed
/// (which is said on stderr); a negative code when no primary did it.
fn removed(r: Result<u64, tycho_client::PartialRemoval>) -> i64 {
    match r {
        Ok(n) => n as i64,
        Err(p) if p.none_done() => {
            eprintln!("tycho: removal failed: {p}");
            code(p.code())
        }
        Err(p) => {
            eprintln!("tycho: removal incomplete: {p}");
            p.removed as i64
        }
    }
}

fn code(e: ErrorCode) -> i64 {
    e.as_i32() as i64
}

fn status(r: Result<(), ErrorCode>) -> i64 {
    r.map_or_else(code, |()| 0)
}

/// How a write treats the soft pin (Mooncake's numbering).
#[pyclass(module = "tycho._tycho", eq, eq_int)]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms)]
enum SoftPinAction {
    /// Keep the object's current pin (an upsert); a new object gets none. The default.
    PRESERVE = 0,
    /// Soft-pin for `soft_pin_ttl_ms` or the master's default.
    ENABLE = 1,
    /// No soft pin.
    DISABLE = 2,
}

/// What a copy or move task does (Mooncake's `TaskType`).
#[pyclass(module = "tycho._tycho", eq, eq_int)]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
enum TaskType {
    /// Copy an object onto more segments.
    REPLICA_COPY = 0,
    /// Move an object's replica to another segment.
    REPLICA_MOVE = 1,
}

/// Where a task stands (Mooncake's `TaskStatus`).
#[pyclass(module = "tycho._tycho", eq, eq_int)]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms)]
enum TaskStatus {
    /// Waiting for the client that holds the source replica.
    PENDING = 0,
    /// Being run by that client.
    PROCESSING = 1,
    /// Ended without doing its work (the message says why).
    FAILED = 2,
    /// Done.
    SUCCESS = 3,
}

/// The states of a replica (Mooncake's `ReplicaStatus`); Tycho lists complete replicas only.
#[pyclass(module = "tycho._tycho", eq, eq_int)]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms)]
enum ReplicaStatus {
    /// Not set.
    UNDEFINED = 0,
    /// Space reserved.
    INITIALIZED = 1,
    /// Being written.
    PROCESSING = 2,
    /// Written and readable.
    COMPLETE = 3,
    /// Removed.
    REMOVED = 4,
    /// Its write failed.
    FAILED = 5,
}

/// A 128-bit id as Mooncake's Python API spells UUIDs: `(high 64 bits, low 64 bits)`.
fn uuid_pair(id: u128) -> (u64, u64) {
    ((id >> 64) as u64, id as u64)
}

/// Answer to `query_task` (Mooncake's `QueryTaskResponse`).
#[pyclass(module = "tycho._tycho", get_all, frozen)]
#[derive(Clone)]
struct QueryTaskResponse {
    /// The task's id.
    id: (u64, u64),
    /// Copy or move.
    #[pyo3(name = "type")]
    kind: TaskType,
    /// Where it stands.
    status: TaskStatus,
    /// When it was created (Unix ms).
    created_at_ms_epoch: u64,
    /// When its status last changed (Unix ms).
    last_updated_at_ms_epoch: u64,
    /// The client that runs it.
    assigned_client: (u64, u64),
    /// Why it failed, or a word on its success.
    message: String,
}

#[pymethods]
impl QueryTaskResponse {
    fn __repr__(&self) -> String {
        format!(
            "QueryTaskResponse(id={}-{}, type={}, status={}, created_at={}, last_updated_at={}, assigned_client={}-{}, message={:?})",
            self.id.0,
            self.id.1,
            self.kind as i32,
            self.status as i32,
            self.created_at_ms_epoch,
            self.last_updated_at_ms_epoch,
            self.assigned_client.0,
            self.assigned_client.1,
            self.message
        )
    }
}

impl From<tycho_proto::TaskInfo> for QueryTaskResponse {
    fn from(t: tycho_proto::TaskInfo) -> Self {
        QueryTaskResponse {
            id: uuid_pair(t.id),
            kind: match t.kind {
                tycho_proto::TaskKind::Copy => TaskType::REPLICA_COPY,
                tycho_proto::TaskKind::Move => TaskType::REPLICA_MOVE,
            },
            status: match t.status {
                tycho_proto::TaskStatus::Pending => TaskStatus::PENDING,
                tycho_proto::TaskStatus::Processing => TaskStatus::PROCESSING,
                tycho_proto::TaskStatus::Failed => TaskStatus::FAILED,
                tycho_proto::TaskStatus::Success => TaskStatus::SUCCESS,
            },
            created_at_ms_epoch: t.created_ms,
            last_updated_at_ms_epoch: t.updated_ms,
            assigned_client: uuid_pair(t.assigned.0),
            message: t.message,
        }
    }
}

/// Placement and pinning of a write (Mooncake's `ReplicateConfig`).
#[pyclass(module = "tycho._tycho", get_all)]
#[derive(Clone)]
struct ReplicateConfig {
    /// Replicas wanted (best effort).
    #[pyo3(set)]
    replica_num: u32,
    /// Shorthand for `soft_pin_action = ENABLE` (an older Mooncake field).
    #[pyo3(set)]
    with_soft_pin: bool,
    /// Soft-pin handling.
    #[pyo3(set)]
    soft_pin_action: SoftPinAction,
    /// Soft-pin TTL in ms; only with ENABLE. Set through the checking setter below.
    soft_pin_ttl_ms: Option<u64>,
    /// Never evict.
    #[pyo3(set)]
    with_hard_pin: bool,
    /// One preferred segment (`host:port`), as Mooncake's field.
    #[pyo3(set)]
    preferred_segment: String,
    /// Preferred segments, in order.
    #[pyo3(set)]
    preferred_segments: Vec<String>,
    /// Place the first replica on this host when possible.
    #[pyo3(set)]
    prefer_alloc_in_same_node: bool,
    /// Mooncake's placement groups; accepted and kept, not yet used for placement.
    #[pyo3(set)]
    group_ids: Option<Vec<String>>,
    /// Mooncake's KV-session ids; accepted and kept, not yet used for placement.
    #[pyo3(set)]
    session_ids: Option<Vec<String>>,
}

#[pymethods]
impl ReplicateConfig {
    #[new]
    fn new() -> Self {
        ReplicateConfig {
            replica_num: 1,
            with_soft_pin: false,
            soft_pin_action: SoftPinAction::PRESERVE,
            soft_pin_ttl_ms: None,
            with_hard_pin: false,
            preferred_segment: String::new(),
            preferred_segments: Vec::new(),
            prefer_alloc_in_same_node: false,
            group_ids: None,
            session_ids: None,
        }
    }

    /// None or an int in [0, 2^64); anything else is a TypeError, as in Mooncake.
    #[setter]
    fn set_soft_pin_ttl_ms(&mut self, value: Bound<'_, PyAny>) -> PyResult<()> {
        if value.is_none() {
            self.soft_pin_ttl_ms = None;
            return Ok(());
        }
        // Any int-like object (numpy and torch ints too); floats, strings and ints out of range
        // are a TypeError, as in Mooncake.
        let ttl = value
            .extract::<u64>()
            .map_err(|_| PyTypeError::new_err("soft_pin_ttl_ms takes None or an int in [0, 2**64)"))?;
        self.soft_pin_ttl_ms = Some(ttl);
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "ReplicateConfig(replica_num={}, with_soft_pin={}, with_hard_pin={}, preferred_segments={:?})",
            self.replica_num, self.with_soft_pin, self.with_hard_pin, self.preferred_segments
        )
    }
}

impl ReplicateConfig {
    fn to_wire(&self) -> tycho_proto::ReplicateConfig {
        let action = match (self.soft_pin_action, self.with_soft_pin) {
            (SoftPinAction::ENABLE, _) | (_, true) => tycho_proto::SoftPinAction::Enable,
            (SoftPinAction::DISABLE, false) => tycho_proto::SoftPinAction::Disable,
            (SoftPinAction::PRESERVE, false) => tycho_proto::SoftPinAction::Preserve,
        };
        let mut preferred = self.preferred_segments.clone();
        if !self.preferred_segment.is_empty() && !preferred.contains(&self.preferred_segment) {
            preferred.insert(0, self.preferred_segment.clone());
        }
        tycho_proto::ReplicateConfig {
            replica_num: self.replica_num,
            soft_pin_action: action,
            soft_pin_ttl_ms: self.soft_pin_ttl_ms,
            hard_pin: self.with_hard_pin,
            preferred_segments: preferred,
            prefer_alloc_in_same_node: self.prefer_alloc_in_same_node,
            strategy: None,
        }
    }
}

fn wire_config(c: Option<PyRef<'_, ReplicateConfig>>) -> tycho_proto::ReplicateConfig {
    c.map_or_else(tycho_proto::ReplicateConfig::default, |c| c.to_wire())
}

/// Where the bytes of one memory replica are (Mooncake's `Descriptor`).
#[pyclass(module = "tycho._tycho", get_all, set_all)]
#[derive(Clone, Default)]
struct BufferDescriptor {
    /// Transfer server of the holding segment.
    transport_endpoint: String,
    /// Offset of the bytes inside their segment.
    buffer_address: u64,
    /// Length in bytes.
    size: u64,
}

#[pymethods]
impl BufferDescriptor {
    #[new]
    fn new() -> Self {
        BufferDescriptor::default()
    }

    fn __repr__(&self) -> String {
        format!(
            "<Descriptor size={} buffer_address={} transport_endpoint={}>",
            self.size, self.buffer_address, self.transport_endpoint
        )
    }
}

/// A memory replica.
#[pyclass(module = "tycho._tycho", get_all, frozen)]
#[derive(Clone)]
struct MemoryDescriptor {
    /// Location of the bytes.
    buffer_descriptor: BufferDescriptor,
}

/// One replica of an object (Mooncake's `Replica::Descriptor`).
#[pyclass(module = "tycho._tycho", get_all, frozen)]
#[derive(Clone)]
struct ReplicaDescriptor {
    /// Replica state; Tycho lists only complete replicas.
    status: String,
    /// Segment id (hex).
    segment_id: String,
    /// Host identity of the holding segment.
    host: String,
    memory: MemoryDescriptor,
}

#[pymethods]
impl ReplicaDescriptor {
    fn is_memory_replica(&self) -> bool {
        true
    }
    fn is_disk_replica(&self) -> bool {
        false
    }
    fn get_memory_descriptor(&self) -> MemoryDescriptor {
        self.memory.clone()
    }
    fn __repr__(&self) -> String {
        let b = &self.memory.buffer_descriptor;
        format!(
            "ReplicaDescriptor(status={}, endpoint={}, offset={}, size={})",
            self.status, b.transport_endpoint, b.buffer_address, b.size
        )
    }
}

fn descriptor(r: &ReplicaDesc) -> ReplicaDescriptor {
    ReplicaDescriptor {
        status: "COMPLETE".into(),
        segment_id: r.segment.to_string(),
        host: r.host.clone(),
        memory: MemoryDescriptor {
            buffer_descriptor: BufferDescriptor {
                transport_endpoint: r.endpoint.clone(),
                buffer_address: r.offset,
                size: r.len,
            },
        },
    }
}

/// Bytes of an object exposed through the buffer protocol (`memoryview`, `numpy`, `torch`).
/// Writable, as Mooncake's: each handle owns its copy of the bytes, so writing into it changes
/// nothing stored.
#[pyclass(module = "tycho._tycho", frozen)]
struct BufferHandle {
    /// Owns the bytes; only ever accessed through `ptr`.
    _data: Box<[u8]>,
    /// `_data`'s first byte, taken mutably once at construction.
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the handle's Rust code only hands out `ptr` and `len`; the bytes behind them are read
// and written by Python through the buffer protocol, under the GIL, like a bytearray's.
unsafe impl Send for BufferHandle {}
unsafe impl Sync for BufferHandle {}

impl BufferHandle {
    fn new(data: Vec<u8>) -> BufferHandle {
        let mut data = data.into_boxed_slice();
        let (ptr, len) = (data.as_mut_ptr(), data.len());
        BufferHandle { _data: data, ptr, len }
    }
}

#[pymethods]
impl BufferHandle {
    /// Address of the first byte.
    fn ptr(&self) -> usize {
        self.ptr as usize
    }
    /// Size in bytes.
    fn size(&self) -> usize {
        self.len
    }
    fn __len__(&self) -> usize {
        self.len
    }
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (ptr, len) = (slf.get().ptr, slf.get().len);
        // SAFETY: the bytes live as long as `slf`, which the view holds a reference to.
        let ret = unsafe {
            ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast::<std::ffi::c_void>(), len as ffi::Py_ssize_t, 0, flags)
        };
        if ret == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// A buffer view held for the length of a call and released (with the GIL) on drop.
struct View(Box<ffi::Py_buffer>);

// SAFETY: the view only pins the exporter's memory; it is released with the GIL held.
unsafe impl Send for View {}
unsafe impl Sync for View {}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released once.
        Python::with_gil(|_| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// The raw bytes of any buffer-protocol object, for use with the GIL released. The item
/// format does not matter (ctypes arrays export `<B`, `array('b')` exports `b`): the value is
/// the buffer's bytes. A non-contiguous buffer (a strided slice) is copied into order first.
struct Bytes {
    ptr: usize,
    len: usize,
    _view: View,
    _copy: Option<Vec<u8>>,
}

impl Bytes {
    fn of(obj: &Bound<'_, PyAny>) -> PyResult<Bytes> {
        // SAFETY: a zeroed Py_buffer is a valid target for PyObject_GetBuffer, which fills it
        // or fails with a Python error set (a TypeError for objects without the protocol).
        let view = unsafe {
            let mut raw: Box<ffi::Py_buffer> = Box::new(std::mem::zeroed());
            if ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *raw, ffi::PyBUF_FULL_RO) == -1 {
                return Err(PyErr::fetch(obj.py()));
            }
            View(raw)
        };
        let len = view.0.len.max(0) as usize;
        // SAFETY: `view` is a live buffer view.
        if unsafe { ffi::PyBuffer_IsContiguous(&*view.0, b'C' as std::os::raw::c_char) } != 0 {
            return Ok(Bytes { ptr: view.0.buf as usize, len, _view: view, _copy: None });
        }
        let mut copy = vec![0u8; len];
        // SAFETY: `copy` has room for the view's `len` bytes.
        let rc = unsafe {
            ffi::PyBuffer_ToContiguous(
                copy.as_mut_ptr().cast(),
                &*view.0,
                len as ffi::Py_ssize_t,
                b'C' as std::os::raw::c_char,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Bytes { ptr: copy.as_ptr() as usize, len, _view: view, _copy: Some(copy) })
    }
    /// # Safety
    /// The object stays alive (`_view` holds it) and the caller does not mutate it meanwhile.
    unsafe fn slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see the function's contract.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

/// The store client (`tycho.store.MooncakeDistributedStore` is its Python face).
#[pyclass(module = "tycho._tycho", subclass, frozen)]
struct Store {
    client: RwLock<Option<Client>>,
    was_set_up: AtomicBool,
}

impl Drop for Store {
    fn drop(&mut self) {
        // A store dropped without close(): close it as Mooncake's destructor does, quickly
        // (one short attempt per unmount) and without holding the GIL while the master answers.
        if let Some(c) = self.client.get_mut().take() {
            Python::with_gil(|py| {
                py.allow_threads(move || {
                    let _ = c.close_quickly();
                })
            });
        }
    }
}

impl Store {
    fn client(&self) -> Result<Client, ErrorCode> {
        self.client.read().clone().ok_or(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS)
    }

    /// Runs `f` on this store's client with `keys`, off the GIL, for one answer per key (every
    /// key the store's own error when it is not set up).
    fn per_key(
        &self,
        py: Python<'_>,
        keys: &[String],
        f: impl FnOnce(&Client, &[&str]) -> Vec<i64> + Send,
    ) -> Vec<i64> {
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return vec![code(e); keys.len()],
        };
        py.allow_threads(|| {
            let ks: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            f(&c, &ks)
        })
    }

    /// Connects with `cfg`, replacing (and closing) any earlier connection. 0 or a negative code.
    fn install(&self, py: Python<'_>, cfg: ClientConfig) -> i64 {
        let previous = self.client.write().take();
        let result = py.allow_threads(move || {
            if let Some(p) = previous {
                let _ = p.close();
            }
            Client::connect(cfg)
        });
        match result {
            Ok(c) => {
                *self.client.write() = Some(c);
                self.was_set_up.store(true, Ordering::Release);
                0
            }
            Err(e) => {
                // setup answers a number, as Mooncake's does; say why on stderr, as its log does.
                eprintln!("tycho: setup failed: {e}: {}", e.hint());
                code(e)
            }
        }
    }
}

fn mode(upsert: bool) -> WriteMode {
    if upsert {
        WriteMode::Upsert
    } else {
        WriteMode::Put
    }
}

// Python signatures mirror Mooncake's, which take many arguments.
#[allow(clippy::too_many_arguments)]
#[pymethods]
impl Store {
    #[new]
    fn new() -> Self {
        Store { client: RwLock::new(None), was_set_up: AtomicBool::new(false) }
    }

    /// Connects (called by `setup` after argument parsing). Returns 0 or a negative code.
    #[pyo3(signature = (local_hostname, global_segment_size, local_buffer_size, protocol, master_server_addr, tenant = String::new()))]
    fn _connect(
        &self,
        py: Python<'_>,
        local_hostname: String,
        global_segment_size: u64,
        local_buffer_size: u64,
        protocol: String,
        master_server_addr: String,
        tenant: String,
    ) -> i64 {
        // Mooncake's "tcp" and "rdma" both mean "the fastest transport there is"; TYCHO_PROTOCOL=tcp
        // forces TCP for tests and benchmarks.
        let forced = std::env::var("TYCHO_PROTOCOL").ok();
        let proto = match forced.as_deref().unwrap_or(&protocol) {
            "tcp" if forced.is_some() => Protocol::Tcp,
            _ => Protocol::Auto,
        };
        let mut cfg = ClientConfig::new(&master_server_addr);
        cfg.local_hostname = local_hostname;
        cfg.segment_size = global_segment_size;
        cfg.staging_buffer_size = local_buffer_size;
        cfg.protocol = proto;
        cfg.tenant = tenant;
        self.install(py, cfg)
    }

    /// Attaches to the `tycho node` of this user listening on `port` of this host (called by
    /// `setup_dummy`): a client of the node's store that contributes no memory. Returns 0 or a
    /// negative code.
    fn _connect_dummy(&self, py: Python<'_>, port: u16, local_buffer_size: u64) -> i64 {
        let info = match py.allow_threads(|| tycho_client::attach::attach(port)) {
            Ok(i) => i,
            Err(e) => {
                eprintln!("tycho: setup_dummy failed: no tycho node to attach to on port {port} ({e}): start one with `tycho node --port {port}` as this user on this host");
                return code(e);
            }
        };
        let mut cfg = ClientConfig::new(&info.master_addr);
        cfg.auth = info.auth();
        cfg.host_id = info.host_id.clone();
        cfg.tenant = info.tenant.clone();
        cfg.segment_size = 0;
        cfg.staging_buffer_size = local_buffer_size;
        if std::env::var("TYCHO_PROTOCOL").as_deref() == Ok("tcp") {
            cfg.protocol = Protocol::Tcp;
        }
        self.install(py, cfg)
    }

    /// Mounts `size` bytes of the file at `path`, from `offset` (a multiple of 4096) on, as one
    /// more segment of this store: what the store places there is written into the file. The
    /// file is opened here, by this process, and never shared: peers on this host reach it over
    /// the transfer server, not by mapping it (see docs/python.md). Returns
    /// `{"ret": 0 or a negative code, "segment_ids": [id]}`. With `stable_id` (a Tycho
    /// addition), the segment is the stable segment of that name, of medium `file`: the same
    /// id after a restart, one VSegment extents may name (docs/vsegment.md).
    #[pyo3(signature = (path, size, offset = 0, protocol = "tcp", location = "", stable_id = None))]
    #[allow(clippy::too_many_arguments)]
    fn mount_segment<'py>(
        &self,
        py: Python<'py>,
        path: String,
        size: u64,
        offset: u64,
        protocol: &str,
        location: &str,
        stable_id: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let _ = (protocol, location);
        let result = self.client().and_then(|c| {
            py.allow_threads(move || {
                let len = usize::try_from(size).map_err(|_| ErrorCode::INTERNAL_ERROR)?;
                let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).map_err(|e| {
                    eprintln!("tycho: mount_segment: cannot open {path}: {e}");
                    ErrorCode::INTERNAL_ERROR
                })?;
                let memory =
                    tycho_client::Mapping::over_file("tycho-file-segment", &file, offset, len).map_err(|e| {
                        eprintln!("tycho: mount_segment: {path}: {e}");
                        ErrorCode::INTERNAL_ERROR
                    })?;
                let memory = std::sync::Arc::new(memory);
                match &stable_id {
                    Some(name) => c.mount_stable_segment(memory, name, tycho_proto::quota::Medium::File),
                    None => c.mount_segment(memory),
                }
            })
        });
        mount_answer(py, result, false)
    }

    /// Allocates `size` bytes of shared memory and mounts them as one more segment of this
    /// store. Returns `{"ret", "segment_ids", "allocated_size"}`. With `stable_id` (a Tycho
    /// addition), the segment is the stable segment of that name, of medium `dram`.
    #[pyo3(signature = (size, protocol = "tcp", location = "", stable_id = None))]
    fn allocate_and_mount_segment<'py>(
        &self,
        py: Python<'py>,
        size: u64,
        protocol: &str,
        location: &str,
        stable_id: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let _ = (protocol, location);
        let result = self.client().and_then(|c| {
            py.allow_threads(move || {
                let len = usize::try_from(size).map_err(|_| ErrorCode::INTERNAL_ERROR)?;
                let memory = tycho_client::Mapping::create("tycho-segment", len).map_err(|e| {
                    eprintln!("tycho: allocate_and_mount_segment: {e}");
                    ErrorCode::INTERNAL_ERROR
                })?;
                let memory = std::sync::Arc::new(memory);
                match &stable_id {
                    Some(name) => c.mount_stable_segment(memory, name, tycho_proto::quota::Medium::Dram),
                    None => c.mount_segment(memory),
                }
            })
        });
        mount_answer(py, result, true)
    }

    /// Unmounts segments `mount_segment` or `allocate_and_mount_segment` mounted (objects kept
    /// only there are dropped), now or after `grace_period_seconds`. Every id is tried; returns
    /// 0, or the first error (-1 for an id that is not one of this store's).
    #[pyo3(signature = (segment_ids, grace_period_seconds = 0))]
    fn unmount_segment(&self, py: Python<'_>, segment_ids: Vec<String>, grace_period_seconds: u64) -> i64 {
        let Ok(c) = self.client() else { return -1 };
        py.allow_threads(move || {
            let mut first = 0;
            for id in &segment_ids {
                let r = match parse_segment_id(id) {
                    None => Err(ErrorCode::INTERNAL_ERROR),
                    Some(id) if grace_period_seconds == 0 => c.unmount_segment(id),
                    Some(id) => c.unmount_segment_after(id, std::time::Duration::from_secs(grace_period_seconds)),
                };
                let r = r.map_err(|e| if e == ErrorCode::SEGMENT_NOT_FOUND { ErrorCode::INTERNAL_ERROR } else { e });
                if first == 0 {
                    first = status(r);
                }
            }
            first
        })
    }

    /// `unmount_segment`: in Tycho the memory of a segment goes with its unmount either way.
    #[pyo3(signature = (segment_ids, grace_period_seconds = 0))]
    fn unmount_and_free_segment(&self, py: Python<'_>, segment_ids: Vec<String>, grace_period_seconds: u64) -> i64 {
        self.unmount_segment(py, segment_ids, grace_period_seconds)
    }

    /// Whether `[ptr, ptr + size)` lies inside one buffer registered with this store.
    fn _is_registered(&self, ptr: u64, size: u64) -> bool {
        self.client.read().as_ref().is_some_and(|c| c.is_registered(ptr, size))
    }

    /// Whether `setup` (or `setup_dummy`) connected this store and it is not closed.
    fn _is_set_up(&self) -> bool {
        self.client.read().is_some()
    }

    /// Unmounts this store's segment (objects stored only there disappear) and disconnects.
    fn close(&self, py: Python<'_>) -> i64 {
        let Some(c) = self.client.write().take() else { return 0 };
        status(py.allow_threads(move || c.close()))
    }

    /// close() for exit paths: one short unmount attempt, nothing in a forked child.
    fn _close_quickly(&self, py: Python<'_>) -> i64 {
        let Some(c) = self.client.write().take() else { return 0 };
        status(py.allow_threads(move || c.close_quickly()))
    }

    /// 0 when usable, 1 when closed (or never set up), 2 when the master does not answer.
    fn health_check(&self, py: Python<'_>) -> i64 {
        match self.client() {
            Err(_) => 1,
            Ok(c) => {
                if py.allow_threads(move || c.master_reachable()) {
                    0
                } else {
                    2
                }
            }
        }
    }

    /// `host:port` of this store's transfer server.
    fn get_hostname(&self) -> String {
        self.client.read().as_ref().map(|c| c.hostname().to_string()).unwrap_or_default()
    }

    // ---- writes ----

    #[pyo3(signature = (key, value, config = None, upsert = false))]
    fn _write(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        upsert: bool,
    ) -> PyResult<i64> {
        let v = Bytes::of(value)?;
        let cfg = wire_config(config);
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return Ok(code(e)),
        };
        // SAFETY: `v` keeps the object alive for the call.
        Ok(py.allow_threads(|| status(c.write(mode(upsert), key, &[unsafe { v.slice() }], &cfg))))
    }

    #[pyo3(signature = (key, parts, config = None, upsert = false))]
    fn _write_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyTuple>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        upsert: bool,
    ) -> PyResult<i64> {
        let bufs: Vec<Bytes> = parts.iter().map(|p| Bytes::of(&p)).collect::<PyResult<_>>()?;
        let cfg = wire_config(config);
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return Ok(code(e)),
        };
        Ok(py.allow_threads(|| {
            // SAFETY: `bufs` keeps every part alive for the call.
            let slices: Vec<&[u8]> = bufs.iter().map(|b| unsafe { b.slice() }).collect();
            status(c.write(mode(upsert), key, &slices, &cfg))
        }))
    }

    #[pyo3(signature = (keys, values, config = None, upsert = false))]
    fn _write_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: &Bound<'_, PyList>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        upsert: bool,
    ) -> PyResult<i64> {
        if keys.len() != values.len() {
            return Ok(code(ErrorCode::INVALID_PARAMS));
        }
        let bufs: Vec<Bytes> = values.iter().map(|v| Bytes::of(&v)).collect::<PyResult<_>>()?;
        let cfg = wire_config(config);
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return Ok(code(e)),
        };
        Ok(py.allow_threads(|| {
            // SAFETY: `bufs` keeps every value alive for the call.
            let items: Vec<(&str, &[u8])> =
                keys.iter().map(|k| k.as_str()).zip(bufs.iter().map(|b| unsafe { b.slice() })).collect();
            let results = c.write_batch(mode(upsert), &items, &cfg, true);
            results.into_iter().find_map(|r| r.err()).map_or(0, code)
        }))
    }

    #[pyo3(signature = (key, buffer_ptr, size, config = None, upsert = false))]
    fn _write_from(
        &self,
        py: Python<'_>,
        key: &str,
        buffer_ptr: u64,
        size: u64,
        config: Option<PyRef<'_, ReplicateConfig>>,
        upsert: bool,
    ) -> i64 {
        let cfg = wire_config(config);
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return code(e),
        };
        // SAFETY: the caller registered this memory and keeps it alive (Mooncake's contract).
        py.allow_threads(|| status(unsafe { c.write_from(mode(upsert), key, buffer_ptr, size, &cfg) }))
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes, config = None, upsert = false))]
    fn _batch_write_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<u64>,
        sizes: Vec<u64>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        upsert: bool,
    ) -> Vec<i64> {
        let n = keys.len();
        if buffer_ptrs.len() != n || sizes.len() != n {
            return vec![code(ErrorCode::INVALID_PARAMS); n];
        }
        let cfg = wire_config(config);
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return vec![code(e); n],
        };
        py.allow_threads(|| {
            let mut out = vec![0i64; n];
            let mut items = Vec::with_capacity(n);
            let mut idx = Vec::with_capacity(n);
            for i in 0..n {
                if !c.is_registered(buffer_ptrs[i], sizes[i]) || sizes[i] == 0 {
                    out[i] = code(ErrorCode::INVALID_PARAMS);
                    continue;
                }
                // SAFETY: registered caller memory, kept alive by the caller for the call.
                let s = unsafe { std::slice::from_raw_parts(buffer_ptrs[i] as *const u8, sizes[i] as usize) };
                items.push((keys[i].as_str(), s));
                idx.push(i);
            }
            for (r, i) in c.write_batch(mode(upsert), &items, &cfg, false).into_iter().zip(idx) {
                out[i] = status(r);
            }
            out
        })
    }

    // ---- reads ----

    /// The value of `key`, or `b""` when it is missing or cannot be read.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyBytes>> {
        let empty = || PyBytes::new(py, b"");
        let Ok(c) = self.client() else { return Ok(empty()) };
        let c2 = c.clone();
        let Ok(lookup) = py.allow_threads(|| c2.lookup(key)) else { return Ok(empty()) };
        let size = lookup.size() as usize;
        // SAFETY: a fresh bytes object of `size` bytes that no one else sees until returned.
        let obj = unsafe { ffi::PyBytes_FromStringAndSize(std::ptr::null(), size as ffi::Py_ssize_t) };
        let obj = unsafe { Bound::from_owned_ptr_or_err(py, obj)? };
        let ptr = unsafe { ffi::PyBytes_AsString(obj.as_ptr()) } as usize;
        let read = py.allow_threads(|| {
            // SAFETY: the bytes object above owns `size` writable bytes at `ptr`.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, size) };
            c.read_lookup(&lookup, dst)
        });
        match read {
            Ok(_) => Ok(obj.downcast_into::<PyBytes>()?),
            Err(_) => Ok(empty()),
        }
    }

    /// Values of many keys; `b""` for each one missing.
    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let Ok(c) = self.client() else { return Ok(keys.iter().map(|_| PyBytes::new(py, b"")).collect()) };
        let results = py.allow_threads(|| {
            let ks: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            c.get_batch(&ks)
        });
        Ok(results.into_iter().map(|r| PyBytes::new(py, r.as_deref().unwrap_or(b""))).collect())
    }

    /// Reads `key` into registered memory; bytes read or a negative code.
    fn get_into(&self, py: Python<'_>, key: &str, buffer_ptr: u64, size: u64) -> i64 {
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return code(e),
        };
        // SAFETY: registered caller memory (checked inside), alive for the call.
        py.allow_threads(|| unsafe { c.read_into(key, buffer_ptr, size) }).map_or_else(code, |n| n as i64)
    }

    /// Reads many keys into registered memory; per key, bytes read or a negative code.
    fn batch_get_into(&self, py: Python<'_>, keys: Vec<String>, buffer_ptrs: Vec<u64>, sizes: Vec<u64>) -> Vec<i64> {
        let n = keys.len();
        if buffer_ptrs.len() != n || sizes.len() != n {
            return vec![code(ErrorCode::INVALID_PARAMS); n];
        }
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return vec![code(e); n],
        };
        py.allow_threads(|| {
            let mut out = vec![0i64; n];
            let mut ks = Vec::new();
            let mut dsts = Vec::new();
            let mut idx = Vec::new();
            for i in 0..n {
                if !c.is_registered(buffer_ptrs[i], sizes[i]) {
                    out[i] = code(ErrorCode::INVALID_PARAMS);
                    continue;
                }
                // SAFETY: registered caller memory, distinct per key by the caller's contract.
                dsts.push(unsafe { std::slice::from_raw_parts_mut(buffer_ptrs[i] as *mut u8, sizes[i] as usize) });
                ks.push(keys[i].as_str());
                idx.push(i);
            }
            for (r, i) in c.get_batch_into(&ks, dsts).into_iter().zip(idx) {
                out[i] = r.map_or_else(code, |n| n as i64);
            }
            out
        })
    }

    /// Gathers byte ranges of objects into registered buffers (Mooncake's buffer-major shape).
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffer_ptrs: Vec<u64>,
        all_keys: Vec<Vec<String>>,
        all_dst_offsets: Vec<Vec<Vec<u64>>>,
        all_src_offsets: Vec<Vec<Vec<u64>>>,
        all_sizes: Vec<Vec<Vec<u64>>>,
    ) -> Vec<Vec<Vec<i64>>> {
        let bad = code(ErrorCode::INVALID_PARAMS);
        let shape_ok = all_keys.len() == buffer_ptrs.len()
            && all_dst_offsets.len() == buffer_ptrs.len()
            && all_src_offsets.len() == buffer_ptrs.len()
            && all_sizes.len() == buffer_ptrs.len();
        if !shape_ok {
            // Mooncake's answer: one code per buffer.
            return buffer_ptrs.iter().map(|_| vec![vec![bad]]).collect();
        }
        let c = self.client();
        py.allow_threads(|| {
            let mut out = Vec::with_capacity(buffer_ptrs.len());
            for (i, &buf) in buffer_ptrs.iter().enumerate() {
                let mut per_key = Vec::new();
                for (j, key) in all_keys[i].iter().enumerate() {
                    let (dsts, srcs, sizes) =
                        (all_dst_offsets[i].get(j), all_src_offsets[i].get(j), all_sizes[i].get(j));
                    // A key whose lists disagree in length gets one code in its slot, as in
                    // Mooncake; the other keys are still read.
                    let (Some(dsts), Some(srcs), Some(sizes)) = (dsts, srcs, sizes) else {
                        per_key.push(vec![bad]);
                        continue;
                    };
                    if dsts.len() != sizes.len() || srcs.len() != sizes.len() {
                        per_key.push(vec![bad]);
                        continue;
                    }
                    let c = match &c {
                        Ok(c) => c,
                        Err(e) => {
                            per_key.push(vec![code(*e); sizes.len()]);
                            continue;
                        }
                    };
                    let lookup = c.lookup(key);
                    let mut frags = Vec::with_capacity(sizes.len());
                    for k in 0..sizes.len() {
                        let r = match &lookup {
                            Err(e) => code(*e),
                            Ok(l) => {
                                let dst_addr = buf.checked_add(dsts[k]);
                                match dst_addr.filter(|&a| c.is_registered(a, sizes[k])) {
                                    None => code(ErrorCode::BUFFER_OVERFLOW),
                                    Some(a) => {
                                        // SAFETY: inside a registered buffer (checked above).
                                        let dst =
                                            unsafe { std::slice::from_raw_parts_mut(a as *mut u8, sizes[k] as usize) };
                                        c.read_range(l, srcs[k], dst).map_or_else(code, |n| n as i64)
                                    }
                                }
                            }
                        };
                        frags.push(r);
                    }
                    per_key.push(frags);
                }
                out.push(per_key);
            }
            out
        })
    }

    /// Stores, per key, the concatenation of its registered buffers; one code per key. Lists
    /// of different lengths fail every key with INVALID_PARAMS, as in Mooncake.
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config = None))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<u64>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i64> {
        let n = keys.len();
        let shape_ok = all_buffer_ptrs.len() == n
            && all_sizes.len() == n
            && all_buffer_ptrs.iter().zip(&all_sizes).all(|(p, s)| p.len() == s.len());
        if !shape_ok {
            return vec![code(ErrorCode::INVALID_PARAMS); n];
        }
        let cfg = wire_config(config);
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return vec![code(e); n],
        };
        py.allow_threads(|| {
            let mut out = vec![0i64; n];
            let mut parts: Vec<Vec<&[u8]>> = Vec::with_capacity(n);
            let mut idx = Vec::with_capacity(n);
            for i in 0..n {
                let ranges: Vec<(u64, u64)> =
                    all_buffer_ptrs[i].iter().copied().zip(all_sizes[i].iter().copied()).collect();
                if ranges.iter().any(|&(a, l)| !c.is_registered(a, l)) {
                    out[i] = code(ErrorCode::INVALID_PARAMS);
                    continue;
                }
                // SAFETY: registered caller memory, kept alive by the caller for the call.
                parts.push(
                    ranges
                        .iter()
                        .map(|&(a, l)| unsafe { std::slice::from_raw_parts(a as *const u8, l as usize) })
                        .collect(),
                );
                idx.push(i);
            }
            let items: Vec<(&str, &[&[u8]])> =
                idx.iter().zip(&parts).map(|(&i, p)| (keys[i].as_str(), &p[..])).collect();
            for (r, &i) in c.write_batch_parts(WriteMode::Put, &items, &cfg, false).into_iter().zip(&idx) {
                out[i] = status(r);
            }
            out
        })
    }

    /// Reads, per key, the object scattered over its registered buffers in order; per key the
    /// object size or a negative code (INVALID_PARAMS when the buffers are too small in total).
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node = false))]
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<u64>>,
        prefer_alloc_in_same_node: bool,
    ) -> Vec<i64> {
        // Reads always prefer a replica on this host; the flag has nothing left to choose.
        let _ = prefer_alloc_in_same_node;
        let n = keys.len();
        let shape_ok = all_buffer_ptrs.len() == n
            && all_sizes.len() == n
            && all_buffer_ptrs.iter().zip(&all_sizes).all(|(p, s)| p.len() == s.len());
        if !shape_ok {
            return vec![code(ErrorCode::INVALID_PARAMS); n];
        }
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return vec![code(e); n],
        };
        py.allow_threads(|| {
            let mut out = vec![0i64; n];
            let mut ks = Vec::with_capacity(n);
            let mut dsts = Vec::with_capacity(n);
            let mut idx = Vec::with_capacity(n);
            for i in 0..n {
                let ranges: Vec<(u64, u64)> =
                    all_buffer_ptrs[i].iter().copied().zip(all_sizes[i].iter().copied()).collect();
                if ranges.iter().any(|&(a, l)| !c.is_registered(a, l)) {
                    out[i] = code(ErrorCode::INVALID_PARAMS);
                    continue;
                }
                // SAFETY: registered caller memory, distinct per buffer by the caller's contract.
                dsts.push(
                    ranges
                        .iter()
                        .map(|&(a, l)| unsafe { std::slice::from_raw_parts_mut(a as *mut u8, l as usize) })
                        .collect(),
                );
                ks.push(keys[i].as_str());
                idx.push(i);
            }
            for (r, i) in c.get_batch_into_scattered(&ks, dsts).into_iter().zip(idx) {
                out[i] = r.map_or_else(code, |n| n as i64);
            }
            out
        })
    }

    /// Ranged writes into objects a put session reserved (`batch_put_session_start`): per key,
    /// buffer `j` (registered) goes to object offset `all_dst_offsets[i][j]`; per key the bytes
    /// written, or INVALID_PARAMS for a key without a session, lists of different lengths, an
    /// unregistered buffer or a range past the object's end.
    fn batch_put_from_multi_buffer_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<u64>>,
        all_dst_offsets: Vec<Vec<u64>>,
    ) -> Vec<i64> {
        let n = keys.len();
        let bad = code(ErrorCode::INVALID_PARAMS);
        if all_buffer_ptrs.len() != n || all_sizes.len() != n || all_dst_offsets.len() != n {
            return vec![bad; n];
        }
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return vec![code(e); n],
        };
        py.allow_threads(|| {
            (0..n)
                .map(|i| {
                    let (ptrs, sizes, offs) = (&all_buffer_ptrs[i], &all_sizes[i], &all_dst_offsets[i]);
                    if ptrs.len() != sizes.len() || offs.len() != sizes.len() {
                        return bad;
                    }
                    if ptrs.iter().zip(sizes).any(|(&a, &l)| !c.is_registered(a, l)) {
                        return bad;
                    }
                    // SAFETY: registered caller memory, kept alive by the caller for the call.
                    let ranges: Vec<(u64, &[u8])> = ptrs
                        .iter()
                        .zip(sizes)
                        .zip(offs)
                        .map(|((&a, &l), &at)| (at, unsafe { std::slice::from_raw_parts(a as *const u8, l as usize) }))
                        .collect();
                    c.put_session_write(&keys[i], &ranges).map_or_else(code, |n| n as i64)
                })
                .collect()
        })
    }

    /// Starts a put session: reserves `keys` with their `sizes` and moves no bytes (write them
    /// with `batch_put_from_multi_buffer_ranges`, then end or revoke the session). Per key 0,
    /// OBJECT_ALREADY_EXISTS, or INVALID_PARAMS (a size of 0, a key twice or in a session
    /// already, lists of different lengths).
    #[pyo3(signature = (keys, sizes, config = None))]
    fn batch_put_session_start(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        sizes: Vec<u64>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i64> {
        let cfg = wire_config(config);
        self.per_key(py, &keys, |c, ks| c.put_session_start(ks, &sizes, &cfg).into_iter().map(status).collect())
    }

    /// Ends put sessions: bytes no ranged write covered are zeros, the objects become
    /// readable. Per key 0 or a negative code (INVALID_PARAMS for a key without a session).
    fn batch_put_session_end(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(py, &keys, |c, ks| c.put_session_end(ks).into_iter().map(status).collect())
    }

    /// Revokes put sessions: nothing is committed. Per key 0 or INVALID_PARAMS (no session).
    fn batch_put_session_revoke(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(py, &keys, |c, ks| c.put_session_revoke(ks).into_iter().map(status).collect())
    }

    /// Starts a get session: asks for the replicas of `keys` once; this store's reads reuse
    /// them while their lease allows. Per key 0 or a negative code (OBJECT_NOT_FOUND).
    fn batch_get_session_start(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(py, &keys, |c, ks| c.get_session_start(ks).into_iter().map(status).collect())
    }

    /// Ends a get session: the next reads of `keys` ask the master. 0.
    fn batch_get_session_end(&self, keys: Vec<String>) -> i64 {
        if let Ok(c) = self.client() {
            let ks: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            c.get_session_end(&ks);
        }
        0
    }

    /// Per key, reads `all_sizes[i][j]` bytes at object offset `all_src_offsets[i][j]` into the
    /// registered buffer `all_buffer_ptrs[i][j]`; per key the bytes read or a negative code.
    /// Without a get session the replicas are asked of the master once per call.
    fn batch_get_into_multi_buffer_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<u64>>,
        all_src_offsets: Vec<Vec<u64>>,
    ) -> Vec<i64> {
        let n = keys.len();
        let bad = code(ErrorCode::INVALID_PARAMS);
        if all_buffer_ptrs.len() != n || all_sizes.len() != n || all_src_offsets.len() != n {
            return vec![bad; n];
        }
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return vec![code(e); n],
        };
        py.allow_threads(|| {
            let ks: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            let lookups = c.lookup_batch(&ks);
            let mut out = Vec::with_capacity(n);
            for (i, lookup) in lookups.iter().enumerate() {
                let (ptrs, sizes, srcs) = (&all_buffer_ptrs[i], &all_sizes[i], &all_src_offsets[i]);
                if ptrs.len() != sizes.len() || srcs.len() != sizes.len() {
                    out.push(bad);
                    continue;
                }
                let l = match lookup {
                    Ok(l) => l,
                    Err(e) => {
                        out.push(code(*e));
                        continue;
                    }
                };
                let mut total = 0i64;
                for j in 0..sizes.len() {
                    if !c.is_registered(ptrs[j], sizes[j]) {
                        total = bad;
                        break;
                    }
                    // SAFETY: inside a registered buffer (checked above).
                    let dst = unsafe { std::slice::from_raw_parts_mut(ptrs[j] as *mut u8, sizes[j] as usize) };
                    match c.read_range(l, srcs[j], dst) {
                        Ok(k) => total += k as i64,
                        Err(e) => {
                            total = code(e);
                            break;
                        }
                    }
                }
                out.push(total);
            }
            out
        })
    }

    /// Stores `metadata_size` bytes at `metadata_buffer_ptr` followed by `size` bytes at
    /// `buffer_ptr` as one object; both must lie in registered buffers.
    #[pyo3(signature = (key, buffer_ptr, metadata_buffer_ptr, size, metadata_size, config = None))]
    fn put_from_with_metadata(
        &self,
        py: Python<'_>,
        key: &str,
        buffer_ptr: u64,
        metadata_buffer_ptr: u64,
        size: u64,
        metadata_size: u64,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i64 {
        let cfg = wire_config(config);
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return code(e),
        };
        let parts = [(metadata_buffer_ptr, metadata_size), (buffer_ptr, size)];
        // SAFETY: the caller registered this memory and keeps it alive (Mooncake's contract);
        // registration is checked inside.
        py.allow_threads(|| status(unsafe { c.write_parts_from(WriteMode::Put, key, &parts, &cfg) }))
    }

    /// Drops the replicas of keys this store wrote whose read lease has ended — all of each
    /// object, or only its replicas on `segment_name` — and returns the keys cleared.
    #[pyo3(signature = (keys, segment_name = ""))]
    fn batch_replica_clear(&self, py: Python<'_>, keys: Vec<String>, segment_name: &str) -> Vec<String> {
        let Ok(c) = self.client() else { return Vec::new() };
        let results = py.allow_threads(|| {
            let ks: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            c.replica_clear(&ks, segment_name)
        });
        keys.into_iter().zip(results).filter_map(|(k, r)| r.ok().map(|()| k)).collect()
    }

    /// The value of `key` as a buffer-protocol object, or None.
    fn get_buffer(&self, py: Python<'_>, key: &str) -> Option<BufferHandle> {
        let c = self.client().ok()?;
        py.allow_threads(|| c.get(key)).ok().map(BufferHandle::new)
    }

    /// Buffers of many keys, None for each one missing.
    fn batch_get_buffer(&self, py: Python<'_>, keys: Vec<String>) -> Vec<Option<BufferHandle>> {
        let Ok(c) = self.client() else { return keys.iter().map(|_| None).collect() };
        let results = py.allow_threads(|| {
            let ks: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            c.get_batch(&ks)
        });
        results.into_iter().map(|r| r.ok().map(BufferHandle::new)).collect()
    }

    /// Registers caller memory for the zero-copy calls.
    fn register_buffer(&self, buffer_ptr: u64, size: u64) -> i64 {
        match self.client() {
            Ok(c) => status(c.register_buffer(buffer_ptr, size)),
            Err(e) => code(e),
        }
    }

    /// Forgets registered memory.
    fn unregister_buffer(&self, buffer_ptr: u64) -> i64 {
        match self.client() {
            Ok(c) => status(c.unregister_buffer(buffer_ptr)),
            Err(e) => code(e),
        }
    }

    /// 1 if `key` holds a complete value, 0 if not, negative on error.
    fn is_exist(&self, py: Python<'_>, key: &str) -> i64 {
        match self.client() {
            Ok(c) => py.allow_threads(|| c.exists(key)).map_or_else(code, i64::from),
            Err(e) => code(e),
        }
    }

    /// `is_exist` for many keys.
    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.per_key(py, &keys, |c, ks| {
            c.exists_batch(ks).into_iter().map(|r| r.map_or_else(code, i64::from)).collect()
        })
    }

    /// Size of `key`'s value, or a negative code.
    fn get_size(&self, py: Python<'_>, key: &str) -> i64 {
        match self.client() {
            Ok(c) => py.allow_threads(|| c.size(key)).map_or_else(code, |n| n as i64),
            Err(e) => code(e),
        }
    }

    /// Removes `key`; a leased object only with `force`.
    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> i64 {
        match self.client() {
            Ok(c) => status(py.allow_threads(|| c.remove(key, force))),
            Err(e) => code(e),
        }
    }

    /// Removes many keys; one code per key.
    #[pyo3(signature = (keys, force = false))]
    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i64> {
        self.per_key(py, &keys, |c, ks| c.remove_batch(ks, force).into_iter().map(status).collect())
    }

    /// Removes every key matching `regex` (searched anywhere in the key, as Mooncake does);
    /// returns the count or a negative code.
    #[pyo3(signature = (regex_pattern, force = false))]
    fn remove_by_regex(&self, py: Python<'_>, regex_pattern: &str, force: bool) -> i64 {
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return code(e),
        };
        // Checked on its own before it is wrapped: wrapped, an unbalanced pattern such as
        // `a)|(.*` would compile and match every key.
        if regex_syntax::Parser::new().parse(regex_pattern).is_err() {
            return code(ErrorCode::INVALID_PARAMS);
        }
        let search = format!("(?s:.*)(?:{regex_pattern})(?s:.*)");
        removed(py.allow_threads(|| c.remove_by_regex(&search, force)))
    }

    /// Removes every object, at every primary; returns the count or a negative code.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        match self.client() {
            Ok(c) => removed(py.allow_threads(|| c.remove_all(force))),
            Err(e) => code(e),
        }
    }

    // ---- copy and move tasks ----

    /// Asks for copies of `key` on the `targets` segments (by name, as `get_hostname` gives
    /// them): `((high, low) task id, 0)`, or `((0, 0), negative code)`.
    fn create_copy_task(&self, py: Python<'_>, key: &str, targets: Vec<String>) -> ((u64, u64), i64) {
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return ((0, 0), code(e)),
        };
        py.allow_threads(|| c.create_copy_task(key, &targets))
            .map_or_else(|e| ((0, 0), code(e)), |id| (uuid_pair(id), 0))
    }

    /// Asks for `key`'s replica on segment `source` to move to segment `target`: as
    /// `create_copy_task` answers.
    fn create_move_task(&self, py: Python<'_>, key: &str, source: &str, target: &str) -> ((u64, u64), i64) {
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return ((0, 0), code(e)),
        };
        py.allow_threads(|| c.create_move_task(key, source, target))
            .map_or_else(|e| ((0, 0), code(e)), |id| (uuid_pair(id), 0))
    }

    /// Where task `task_id` (a `(high, low)` pair) stands: `(QueryTaskResponse, 0)`, or
    /// `(None, negative code)`.
    fn query_task(&self, py: Python<'_>, task_id: (u64, u64)) -> (Option<QueryTaskResponse>, i64) {
        let c = match self.client() {
            Ok(c) => c,
            Err(e) => return (None, code(e)),
        };
        let id = (u128::from(task_id.0) << 64) | u128::from(task_id.1);
        match py.allow_threads(|| c.query_task(id)) {
            Ok(t) => (Some(t.into()), 0),
            Err(e) => (None, code(e)),
        }
    }

    /// Replica descriptors of `key` (empty when missing).
    fn get_replica_desc(&self, py: Python<'_>, key: &str) -> Vec<ReplicaDescriptor> {
        let Ok(c) = self.client() else { return Vec::new() };
        py.allow_threads(|| c.replicas(key)).map(|r| r.iter().map(descriptor).collect()).unwrap_or_default()
    }

    /// `{key: [ReplicaDescriptor]}` for the keys that exist.
    fn batch_get_replica_desc<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let Ok(c) = self.client() else { return Ok(d) };
        let found = py.allow_threads(|| {
            let ks: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            c.lookup_batch(&ks)
        });
        for (k, l) in keys.iter().zip(found) {
            if let Ok(l) = l {
                let descs: Vec<ReplicaDescriptor> = l.replicas().iter().map(descriptor).collect();
                d.set_item(k, descs)?;
            }
        }
        Ok(d)
    }
}

/// The dict `mount_segment` (and, with `with_size`, `allocate_and_mount_segment`) returns.
fn mount_answer<'py>(
    py: Python<'py>,
    result: Result<tycho_proto::SegmentDesc, ErrorCode>,
    with_size: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let (ret, ids, size) = match result {
        Ok(desc) => (0, vec![desc.id.to_string()], desc.size),
        Err(e) => (code(e), Vec::new(), 0),
    };
    d.set_item("ret", ret)?;
    d.set_item("segment_ids", ids)?;
    if with_size {
        d.set_item("allocated_size", size)?;
    }
    Ok(d)
}

/// A segment id as `mount_segment` prints it (32 hex digits).
fn parse_segment_id(s: &str) -> Option<tycho_proto::SegmentId> {
    (s.len() == 32).then(|| u128::from_str_radix(s, 16).ok()).flatten().map(tycho_proto::SegmentId)
}

/// Parses `"16MB"`, `"1 GiB"`, `1048576`.
#[pyfunction]
fn parse_size(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = value.extract::<u64>() {
        return Ok(n);
    }
    let s: String = value.extract()?;
    tycho_client::parse_size(&s).map_err(PyValueError::new_err)
}

#[pymodule]
fn _tycho(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    m.add_class::<ReplicateConfig>()?;
    m.add_class::<SoftPinAction>()?;
    m.add_class::<ReplicaDescriptor>()?;
    m.add_class::<MemoryDescriptor>()?;
    m.add_class::<BufferDescriptor>()?;
    m.add_class::<BufferHandle>()?;
    m.add_class::<TaskType>()?;
    m.add_class::<TaskStatus>()?;
    m.add_class::<ReplicaStatus>()?;
    m.add_class::<QueryTaskResponse>()?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    Ok(())
}
