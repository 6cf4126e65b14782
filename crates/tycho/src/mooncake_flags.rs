//! `mooncake_master`'s command line, accepted by `tycho master`.
//!
//! Launch scripts written for `mooncake_master` (0.3.13.post1 lists 134 flags in `--help`) run
//! unchanged. Each of its flags is one of three kinds:
//!
//! - **native**: Tycho implements it; `--rpc_port=50051` and `-rpc_port=50051` become the clap
//!   flag of [`crate::master_cmd::MasterArgs`] that carries the same meaning;
//! - **ignored**: it configures something Tycho does not have or does differently (RDMA, SSD
//!   offload, glog); accepted and reported once at startup;
//! - **refused when on**: turning it on would change durability or safety in a way Tycho does not
//!   provide yet (HA, OpLog, snapshots, strict tenant quotas), or it names a file of further
//!   flags that would otherwise be skipped silently. The master exits with a message that says
//!   what Tycho does instead.
//!
//! The split happens before clap sees the arguments, so the flags need no clap fields of their
//! own and `tycho master --help` lists only what Tycho implements.

use std::ffi::OsString;

/// How Tycho treats one `mooncake_master` flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Implemented; handed to clap under this (long) name.
    Native(&'static str),
    /// Accepted and reported as ignored, with the reason.
    Ignored(&'static str),
    /// Refused when set to true (bools) or to a non-empty value (strings), with what Tycho does
    /// instead; accepted (and ignored) when off.
    RefusedWhenOn(&'static str),
}

use Kind::*;

const HA: &str = "Tycho's master turns HA on with --etcd-endpoints URLS (and --cluster-name, \
                  or Mooncake's --cluster_id); it logs every mutation to etcd whenever it has \
                  them, so drop this flag";
const SNAPSHOT: &str = "Tycho snapshots each group's metadata when HA is on and it is given \
                        --snapshot-dir DIR (a directory every master shares) and, optionally, \
                        --snapshot-every RECORDS; drop this flag";
const NO_SSD: &str = "Tycho has no SSD or file tier: objects live in DRAM segments";
const NO_CXL: &str = "Tycho has no CXL segments";
const NO_NOF: &str = "Tycho has no NVMe-oF segments";
const NO_KV_EVENTS: &str = "Tycho does not publish KV events";
const GLOG: &str = "Tycho logs through RUST_LOG (for example RUST_LOG=debug), not glog";
const GFLAGS: &str = "a gflags feature Tycho's command line does not have";
const NO_HTTP_META: &str = "Tycho needs no metadata server: segments carry their own endpoints";

/// Every flag `mooncake_master --help` lists, and what Tycho does with it.
const FLAGS: &[(&str, bool, Kind)] = &[
    // (name, is a bool flag, kind)
    ("allocation_strategy", false, Native("allocation-strategy")),
    ("allow_evict_soft_pinned_objects", true, Native("allow-evict-soft-pinned-objects")),
    ("batch_oplog_retry_timeout_sec", false, Ignored(HA)),
    ("client_ttl", false, Native("client-ttl")),
    ("cluster_id", false, Native("cluster-name")),
    ("config_path", false, RefusedWhenOn("Tycho reads no master config file: pass the flags on the command line")),
    ("cxl_path", false, Ignored(NO_CXL)),
    ("cxl_size", false, Ignored(NO_CXL)),
    ("default_kv_lease_ttl", false, Native("default-kv-lease-ttl")),
    ("default_kv_soft_pin_ttl", false, Native("default-kv-soft-pin-ttl")),
    ("dynamic_replication_admission_qps_threshold", false, Native("dynamic-replication-admission-qps-threshold")),
    ("dynamic_replication_heat_window_seconds", false, Native("dynamic-replication-heat-window-seconds")),
    ("dynamic_replication_max_memory_replicas", false, Native("dynamic-replication-max-memory-replicas")),
    ("dynamic_replication_mode", false, Native("dynamic-replication-mode")),
    ("enable_cxl", true, Ignored(NO_CXL)),
    ("enable_disk_eviction", true, Ignored(NO_SSD)),
    ("enable_ha", true, Native("enable-ha")),
    ("enable_http_metadata_server", true, Ignored(NO_HTTP_META)),
    ("enable_kv_events", true, Ignored(NO_KV_EVENTS)),
    ("enable_metadata_cleanup_on_timeout", true, Ignored(NO_HTTP_META)),
    ("enable_metric_reporting", true, Ignored("Tycho serves its metrics at /metrics instead of logging them")),
    (
        "enable_multi_tenants",
        true,
        RefusedWhenOn(
            "Tycho keeps tenants' keys apart (tenant_id) but enforces no per-tenant quota yet; \
             strict multi-tenant admission comes with the security work (issue 11)",
        ),
    ),
    ("enable_offload", true, Ignored(NO_SSD)),
    ("enable_oplog", true, RefusedWhenOn(HA)),
    ("enable_snapshot", true, RefusedWhenOn(SNAPSHOT)),
    ("enable_snapshot_restore", true, RefusedWhenOn(SNAPSHOT)),
    ("etcd_endpoints", false, Native("etcd-endpoints")),
    ("eviction_high_watermark_ratio", false, Native("eviction-high-watermark-ratio")),
    ("eviction_ratio", false, Native("eviction-ratio")),
    ("global_file_segment_size", false, Ignored(NO_SSD)),
    ("ha_backend_connstring", false, Ignored(HA)),
    ("ha_backend_type", false, Ignored(HA)),
    ("http_metadata_server_host", false, Ignored(NO_HTTP_META)),
    ("http_metadata_server_port", false, Ignored(NO_HTTP_META)),
    ("kv_events_additional_salt", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_backend_id", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_bind_endpoint", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_block_size", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_dp_rank", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_emit_legacy_compat", true, Ignored(NO_KV_EVENTS)),
    ("kv_events_emit_object_key", true, Ignored(NO_KV_EVENTS)),
    ("kv_events_lora_name", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_model_name", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_queue_capacity", false, Ignored(NO_KV_EVENTS)),
    ("kv_events_tenant_id", false, Ignored(NO_KV_EVENTS)),
    ("max_kv_soft_pin_ttl", false, Native("max-kv-soft-pin-ttl")),
    ("max_retry_attempts", false, Ignored("a failed copy or move task is not retried: create another")),
    ("max_threads", false, Ignored("Mooncake's deprecated spelling of --rpc_thread_num, which Tycho reads")),
    ("max_total_finished_tasks", false, Native("max-total-finished-tasks")),
    ("max_total_pending_tasks", false, Native("max-total-pending-tasks")),
    ("max_total_processing_tasks", false, Native("max-total-processing-tasks")),
    ("memory_allocator", false, Ignored("Tycho has one segment allocator")),
    ("metrics_host", false, Native("metrics-address")),
    ("metrics_port", false, Native("metrics-port")),
    ("mmap_arena_pool_size", false, Ignored("Tycho has no mmap arena allocator")),
    ("nof_eviction_high_watermark_ratio", false, Ignored(NO_NOF)),
    ("nof_eviction_ratio", false, Ignored(NO_NOF)),
    ("nof_heartbeat_failures_threshold", false, Ignored(NO_NOF)),
    ("nof_heartbeat_interval_sec", false, Ignored(NO_NOF)),
    ("nof_heartbeat_probe_timeout_ms", false, Ignored(NO_NOF)),
    ("offload_cap_ratio", false, Ignored(NO_SSD)),
    ("offload_force_evict", true, Ignored(NO_SSD)),
    ("offload_on_evict", true, Ignored(NO_SSD)),
    ("offloading_queue_limit", false, Ignored(NO_SSD)),
    ("oplog_batch_max_entries", false, Ignored(HA)),
    ("oplog_poll_interval_ms", false, Ignored(HA)),
    ("pending_task_timeout_sec", false, Native("pending-task-timeout-sec")),
    ("pod_name", false, Ignored("Tycho does no Kubernetes label routing")),
    ("pod_namespace", false, Ignored("Tycho does no Kubernetes label routing")),
    ("port", false, Native("rpc-port")),
    ("processing_task_timeout_sec", false, Native("processing-task-timeout-sec")),
    ("promotion_admission_threshold", false, Ignored(NO_SSD)),
    ("promotion_max_per_heartbeat", false, Ignored(NO_SSD)),
    ("promotion_on_hit", true, Ignored(NO_SSD)),
    ("promotion_queue_limit", false, Ignored(NO_SSD)),
    ("put_start_discard_timeout_sec", false, Native("put-start-discard-timeout-sec")),
    ("put_start_release_timeout_sec", false, Native("put-start-release-timeout-sec")),
    ("quota_bytes", false, Ignored(NO_SSD)),
    ("root_fs_dir", false, Ignored(NO_SSD)),
    ("rpc_address", false, Native("rpc-address")),
    ("rpc_conn_timeout_seconds", false, Ignored("Tycho closes idle RPC connections on its own schedule")),
    ("rpc_enable_tcp_no_delay", true, Ignored("Tycho always sets TCP_NODELAY")),
    ("rpc_interface", false, Ignored("pass --rpc-address with the interface's address")),
    ("rpc_port", false, Native("rpc-port")),
    ("rpc_thread_num", false, Native("rpc-thread-num")),
    ("snapshot_backup_dir", false, Ignored(SNAPSHOT)),
    ("snapshot_catalog_backend_connstring", false, Ignored(SNAPSHOT)),
    ("snapshot_catalog_backend_type", false, Ignored(SNAPSHOT)),
    ("snapshot_catalog_store_connstring", false, Ignored(SNAPSHOT)),
    ("snapshot_catalog_store_type", false, Ignored(SNAPSHOT)),
    ("snapshot_child_timeout_seconds", false, Ignored(SNAPSHOT)),
    ("snapshot_interval_seconds", false, Ignored(SNAPSHOT)),
    ("snapshot_object_store_type", false, Ignored(SNAPSHOT)),
    ("snapshot_payload_backend_type", false, Ignored(SNAPSHOT)),
    ("snapshot_payload_store_type", false, Ignored(SNAPSHOT)),
    ("snapshot_retention_count", false, Ignored(SNAPSHOT)),
    ("tenant_quota_connector_type", false, Ignored("Tycho has no tenant quota connector")),
    ("tenant_quota_connector_uri", false, Ignored("Tycho has no tenant quota connector")),
    ("use_mmap_arena_allocator", true, Ignored("Tycho has no mmap arena allocator")),
    // gflags' own flags.
    ("flagfile", false, RefusedWhenOn("Tycho reads no flag file: pass the flags on the command line")),
    ("fromenv", false, RefusedWhenOn("Tycho reads no flags from the environment: pass them on the command line")),
    ("tryfromenv", false, Ignored(GFLAGS)),
    ("undefok", false, Ignored(GFLAGS)),
    ("tab_completion_columns", false, Ignored(GFLAGS)),
    ("tab_completion_word", false, Ignored(GFLAGS)),
    ("help", true, Native("help")),
    ("helpfull", true, Native("help")),
    ("helpmatch", false, Ignored(GFLAGS)),
    ("helpon", false, Ignored(GFLAGS)),
    ("helppackage", true, Native("help")),
    ("helpshort", true, Native("help")),
    ("helpxml", true, Ignored(GFLAGS)),
    ("version", true, Ignored("`tycho --version` prints Tycho's version")),
    // glog's flags.
    ("alsologtoemail", false, Ignored(GLOG)),
    ("alsologtostderr", true, Ignored(GLOG)),
    ("colorlogtostderr", true, Ignored(GLOG)),
    ("drop_log_memory", true, Ignored(GLOG)),
    ("log_backtrace_at", false, Ignored(GLOG)),
    ("log_dir", false, Ignored(GLOG)),
    ("log_link", false, Ignored(GLOG)),
    ("log_prefix", true, Ignored(GLOG)),
    ("logbuflevel", false, Ignored(GLOG)),
    ("logbufsecs", false, Ignored(GLOG)),
    ("logemaillevel", false, Ignored(GLOG)),
    ("logfile_mode", false, Ignored(GLOG)),
    ("logmailer", false, Ignored(GLOG)),
    ("logtostderr", true, Ignored(GLOG)),
    ("max_log_size", false, Ignored(GLOG)),
    ("minloglevel", false, Ignored(GLOG)),
    ("stderrthreshold", false, Ignored(GLOG)),
    ("stop_logging_if_full_disk", true, Ignored(GLOG)),
    ("symbolize_stacktrace", true, Ignored(GLOG)),
    ("v", false, Ignored(GLOG)),
    ("vmodule", false, Ignored(GLOG)),
];

/// A Mooncake flag that clap does not see: ignored, or refused when on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unhandled {
    /// Flag name, as Mooncake spells it.
    pub name: String,
    /// Its value as given (`true` for a bare bool flag).
    pub value: String,
    refusal: Option<&'static str>,
    reason: &'static str,
}

fn lookup(name: &str) -> Option<(bool, Kind)> {
    FLAGS.iter().find(|(n, _, _)| *n == name).map(|&(_, b, k)| (b, k))
}

/// gflags' spelling of a boolean: true, false, yes, no, 1, 0 (any case).
fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "yes" | "1" | "t" | "y" => Some(true),
        "false" | "no" | "0" | "f" | "n" => Some(false),
        _ => None,
    }
}

/// Splits the arguments of `tycho master` (everything after the subcommand) into what clap
/// parses and the Mooncake flags Tycho does not implement. Mooncake spellings of native flags
/// (`-rpc_port=1`, `--rpc_port 1`, a bare `--enable_ha`) are rewritten to Tycho's.
pub fn split(args: Vec<OsString>) -> (Vec<OsString>, Vec<Unhandled>) {
    let mut kept = Vec::with_capacity(args.len());
    let mut unhandled = Vec::new();
    let mut it = args.into_iter().peekable();
    while let Some(arg) = it.next() {
        let Some(text) = arg.to_str() else {
            kept.push(arg);
            continue;
        };
        if text == "--" {
            kept.push(arg);
            kept.extend(it);
            break;
        }
        let body = text.strip_prefix("--").or_else(|| text.strip_prefix('-')).filter(|b| !b.is_empty());
        let Some(body) = body else {
            kept.push(arg);
            continue;
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        // gflags' negated bool: --noenable_ha.
        let (name, inline) = match (lookup(name), name.strip_prefix("no").and_then(lookup)) {
            (None, Some((true, _))) if inline.is_none() => (&name[2..], Some("false".to_string())),
            _ => (name, inline),
        };
        let Some((is_bool, kind)) = lookup(name) else {
            kept.push(arg);
            continue;
        };
        let value = match inline {
            Some(v) => Some(v),
            // As in gflags, a bool standing alone is true and never takes the next argument.
            None if is_bool => Some("true".to_string()),
            None => it.next_if(|n| n.to_str().is_some_and(|s| !s.starts_with('-'))).and_then(|n| n.into_string().ok()),
        };
        match kind {
            Native("help") => kept.push("--help".into()),
            Native(long) => match value {
                // gflags' spellings of a bool (1, yes, t, ...) become clap's true / false.
                Some(v) if is_bool => {
                    let v = parse_bool(&v).map_or(v, |b| b.to_string());
                    kept.push(format!("--{long}={v}").into())
                }
                Some(v) => kept.push(format!("--{long}={v}").into()),
                None => kept.push(format!("--{long}").into()),
            },
            Ignored(reason) => unhandled.push(Unhandled {
                name: name.to_string(),
                value: value.unwrap_or_default(),
                refusal: None,
                reason,
            }),
            RefusedWhenOn(instead) => unhandled.push(Unhandled {
                name: name.to_string(),
                value: value.unwrap_or_default(),
                refusal: Some(instead),
                reason: instead,
            }),
        }
    }
    (kept, unhandled)
}

/// Refuses the flags that are on and would change durability or safety; reports the rest once
/// each as ignored. A flag given more than once counts with its last value, as in gflags.
pub fn check(flags: &[Unhandled]) -> Result<(), String> {
    let mut last: Vec<&Unhandled> = Vec::new();
    for f in flags {
        match last.iter_mut().find(|l| l.name == f.name) {
            Some(l) => *l = f,
            None => last.push(f),
        }
    }
    for f in &last {
        let bool_flag = lookup(&f.name).is_some_and(|(b, _)| b);
        let on = if bool_flag {
            parse_bool(&f.value).ok_or_else(|| format!("--{}={}: not a boolean", f.name, f.value))?
        } else {
            // A path or list: any value turns it on.
            !f.value.is_empty()
        };
        if let (Some(instead), true) = (f.refusal, on) {
            return Err(format!("--{}={} is not supported: {instead}", f.name, f.value));
        }
    }
    for f in &last {
        tracing::warn!("ignoring mooncake_master flag --{}={}: {}", f.name, f.value, f.reason);
    }
    Ok(())
}

/// Parses a duration flag: a bare number is in `unit_ms` milliseconds (1 for Mooncake's
/// millisecond flags, 1000 for its second flags); a number with `ms`, `s`, `m` or `h` is in that
/// unit (`500ms`, `5s`, `1.5m`, `1h`). Returns milliseconds.
pub fn parse_duration_ms(s: &str, unit_ms: u64) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let scale = match suffix.trim() {
        "" => unit_ms as f64,
        "ms" => 1.0,
        "s" => 1000.0,
        "m" => 60_000.0,
        "h" => 3_600_000.0,
        other => return Err(format!("{s:?}: unknown unit {other:?}; use ms, s, m or h, or a bare number")),
    };
    let n: f64 =
        num.parse().map_err(|_| format!("{s:?} is not a duration (a number, optionally with ms, s, m or h)"))?;
    let ms = n * scale;
    if !ms.is_finite() || ms < 0.0 || ms > u64::MAX as f64 / 2.0 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(ms.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    fn names(u: &[Unhandled]) -> Vec<(&str, &str)> {
        u.iter().map(|f| (f.name.as_str(), f.value.as_str())).collect()
    }

    #[test]
    fn every_mooncake_flag_is_known_once() {
        assert_eq!(FLAGS.len(), 134, "mooncake_master 0.3.13.post1 lists 134 flags");
        let mut n: Vec<&str> = FLAGS.iter().map(|f| f.0).collect();
        n.sort();
        n.dedup();
        assert_eq!(n.len(), FLAGS.len());
    }

    #[test]
    fn native_spellings_become_tycho_flags() {
        let (kept, un) = split(args(&[
            "-rpc_port=7",
            "--rpc_address",
            "127.0.0.1",
            "--default_kv_lease_ttl=500ms",
            "--allow_evict_soft_pinned_objects",
            "--metrics-port",
            "0",
            "--allow_evict_soft_pinned_objects=no",
        ]));
        assert!(un.is_empty());
        assert_eq!(
            kept,
            args(&[
                "--rpc-port=7",
                "--rpc-address=127.0.0.1",
                "--default-kv-lease-ttl=500ms",
                "--allow-evict-soft-pinned-objects=true",
                "--metrics-port",
                "0",
                "--allow-evict-soft-pinned-objects=false",
            ])
        );
    }

    #[test]
    fn unknown_to_tycho_flags_are_set_aside_with_their_values() {
        let (kept, un) = split(args(&[
            "--enable_offload",
            "--kv_events_model_name",
            "llama",
            "--noenable_oplog",
            "--logtostderr",
            "--client-ttl",
            "2",
        ]));
        assert_eq!(kept, args(&["--client-ttl", "2"]));
        assert_eq!(
            names(&un),
            vec![
                ("enable_offload", "true"),
                ("kv_events_model_name", "llama"),
                ("enable_oplog", "false"),
                ("logtostderr", "true"),
            ]
        );
        assert!(check(&un).is_ok());
    }

    #[test]
    fn enable_ha_is_tychos_own_flag() {
        let (kept, un) = split(args(&["--enable_ha", "--etcd_endpoints=http://e:2379", "-enable_ha=0"]));
        assert!(un.is_empty());
        assert_eq!(kept, args(&["--enable-ha=true", "--etcd-endpoints=http://e:2379", "--enable-ha=false"]));
    }

    #[test]
    fn durability_flags_are_refused_only_when_on() {
        for on in ["--enable_oplog", "--enable_oplog=true", "--enable_oplog=1", "--enable_snapshot", "--flagfile=/x"] {
            let (_, un) = split(args(&[on]));
            let err = check(&un).unwrap_err();
            assert!(err.contains("not supported"), "{on}: {err}");
        }
        let (_, un) = split(args(&["--enable_oplog=false", "--enable_snapshot=0", "--config_path="]));
        assert!(check(&un).is_ok());
        let (_, un) = split(args(&["--enable_oplog=maybe"]));
        assert!(check(&un).unwrap_err().contains("not a boolean"));
        // As gflags: a bare bool is true and leaves the next argument alone...
        let (kept, un) = split(args(&["--enable_oplog", "false"]));
        assert_eq!(kept, args(&["false"]));
        assert!(check(&un).unwrap_err().contains("not supported"));
        // ...the last occurrence wins...
        let (_, un) = split(args(&["--enable_oplog=true", "--enable_oplog=false"]));
        assert!(check(&un).is_ok());
        let (_, un) = split(args(&["--enable_snapshot=false", "--enable_oplog", "--noenable_oplog"]));
        assert!(check(&un).is_ok());
        // ...and a path is on whatever it says.
        for path in ["--flagfile=0", "--config_path=no"] {
            let (_, un) = split(args(&[path]));
            assert!(check(&un).unwrap_err().contains("not supported"), "{path}");
        }
    }

    #[test]
    fn other_arguments_pass_through() {
        let (kept, un) = split(args(&["--max-frame-bytes", "10", "--unknown_thing=1", "--", "--enable_ha"]));
        assert!(un.is_empty());
        assert_eq!(kept, args(&["--max-frame-bytes", "10", "--unknown_thing=1", "--", "--enable_ha"]));
    }

    #[test]
    fn durations_take_units_and_keep_the_flag_unit_for_bare_numbers() {
        assert_eq!(parse_duration_ms("500ms", 1), Ok(500));
        assert_eq!(parse_duration_ms("5s", 1), Ok(5000));
        assert_eq!(parse_duration_ms("1m", 1), Ok(60_000));
        assert_eq!(parse_duration_ms("1h", 1), Ok(3_600_000));
        assert_eq!(parse_duration_ms("10000", 1), Ok(10_000));
        assert_eq!(parse_duration_ms("10", 1000), Ok(10_000));
        assert_eq!(parse_duration_ms("1.5s", 1), Ok(1500));
        assert_eq!(parse_duration_ms("500ms", 1000), Ok(500));
        for bad in ["", "ms", "5d", "-1", "1e400", "abc"] {
            assert!(parse_duration_ms(bad, 1).is_err(), "{bad}");
        }
    }
}
