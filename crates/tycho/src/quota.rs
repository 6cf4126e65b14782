//! `tycho plan-quota`: the one-time planner of the static VSegment quota (spec 01's
//! PartitionQuotaPlanner; docs/vsegment.md).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use clap::Args;
use tycho_master::ownership::{cluster_meta, ClusterKeys};
use tycho_master::segments::{list_segments, publish_quota, read_quota};
use tycho_meta::MetaStore;
use tycho_proto::quota::{plan, Medium, PartitionQuota, Profile};

/// `tycho plan-quota` flags.
#[derive(Args, Debug)]
pub struct PlanQuotaArgs {
    /// etcd client URLs, comma-separated (the masters' `--etcd-endpoints`).
    #[arg(long = "etcd-endpoints", value_delimiter = ',', required = true, value_name = "URLS")]
    etcd_endpoints: Vec<String>,
    /// Name of the cluster in etcd (the masters' `--cluster-name`).
    #[arg(long = "cluster-name", default_value = "tycho", value_name = "NAME")]
    cluster_name: String,
    /// A profile, as `NAME:members=N,extent=SIZE,stripe=SIZE,medium=dram|file,per-segment=K`
    /// (e.g. `dram_default:members=4,extent=1GiB,stripe=1MiB,medium=dram,per-segment=1`):
    /// VSegments of N members, each an extent of SIZE bytes in stripes of SIZE, taking K extents
    /// from the end of every stable segment of the medium. Repeat for more profiles.
    #[arg(long = "profile", required = true, value_name = "SPEC", value_parser = parse_profile)]
    profiles: Vec<Profile>,
    /// Print the plan and publish nothing.
    #[arg(long)]
    dry_run: bool,
    /// TLS and authentication to etcd.
    #[command(flatten)]
    etcd_access: crate::master_cmd::EtcdAccess,
}

/// A profile from its command-line form.
pub fn parse_profile(spec: &str) -> Result<Profile, String> {
    let (name, fields) = spec.split_once(':').ok_or("a profile is NAME:members=N,extent=SIZE,stripe=SIZE,...")?;
    let mut p =
        Profile { name: name.to_owned(), members: 0, extent: 0, stripe: 0, medium: Medium::Dram, per_segment: 1 };
    let mut seen = BTreeSet::new();
    for field in fields.split(',').filter(|f| !f.is_empty()) {
        let (k, v) = field.split_once('=').ok_or_else(|| format!("{field:?} is not KEY=VALUE"))?;
        if !seen.insert(k) {
            return Err(format!("{k} given twice"));
        }
        let number = |v: &str| v.parse::<u32>().map_err(|_| format!("{k}={v}: not a whole number"));
        match k {
            "members" => p.members = number(v)?,
            "per-segment" => p.per_segment = number(v)?,
            "extent" => p.extent = tycho_client::parse_size(v)?,
            "stripe" => p.stripe = tycho_client::parse_size(v)?,
            "medium" => p.medium = v.parse()?,
            other => {
                return Err(format!("unknown profile field {other:?} (members, extent, stripe, medium, per-segment)"))
            }
        }
    }
    for needed in ["members", "extent", "stripe"] {
        if !seen.contains(needed) {
            return Err(format!("profile {name}: {needed}= is missing"));
        }
    }
    p.check().map_err(|e| e.to_string())?;
    Ok(p)
}

/// Bytes as a short figure (GiB, MiB or KiB when whole, bytes otherwise).
fn size(b: u64) -> String {
    for (unit, name) in [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")] {
        if b >= unit && b.is_multiple_of(unit) {
            return format!("{} {name}", b / unit);
        }
    }
    format!("{b} B")
}

/// The plan as a table: per profile, each group's extents, bytes and hosts, then where the
/// extents sit in each segment.
pub fn describe(q: &PartitionQuota) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let hosts: BTreeMap<_, _> = q.segments.iter().map(|s| (s.id, s)).collect();
    for (i, p) in q.profiles.iter().enumerate() {
        let _ = writeln!(
            out,
            "profile {}: {} members x {} extents, {} stripes, {}, {} per segment",
            p.name,
            p.members,
            size(p.extent),
            size(p.stripe),
            p.medium,
            p.per_segment
        );
        let _ =
            writeln!(out, "  {:>5}  {:>7}  {:>12}  {:>5}  {:>9}", "group", "extents", "bytes", "hosts", "vsegments");
        for g in 0..q.groups {
            let mine: Vec<_> = q.extents_of(g, i as u16).collect();
            let spans: BTreeSet<&str> = mine.iter().map(|e| hosts[&e.segment].host.as_str()).collect();
            let _ = writeln!(
                out,
                "  {g:>5}  {:>7}  {:>12}  {:>5}  {:>9}",
                mine.len(),
                size(mine.len() as u64 * p.extent),
                spans.len(),
                mine.len() / p.members as usize
            );
        }
    }
    let _ = writeln!(out, "segments:");
    for s in &q.segments {
        let carved: u64 = q.extents.iter().filter(|e| e.segment == s.id).map(|e| e.len).sum();
        let _ = writeln!(
            out,
            "  {} (host {}, {}, {}): {} for VSegments, {} left for whole-segment replicas",
            s.name,
            s.host,
            s.medium,
            size(s.size),
            size(carved),
            size(s.size - carved)
        );
    }
    out
}

/// Runs the planner: reads the cluster's group count and stable segments, plans, prints the
/// plan, and (unless `--dry-run`) publishes it if no plan is published yet.
pub fn plan_quota(a: PlanQuotaArgs) -> i32 {
    match run(a) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn run(a: PlanQuotaArgs) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let options = a.etcd_access.options(&a.etcd_endpoints)?;
    rt.block_on(async {
        let store: Arc<dyn MetaStore> =
            Arc::new(tycho_meta::EtcdStore::connect(options).await.map_err(|e| format!("etcd: {e}"))?);
        let keys = ClusterKeys::new(&a.cluster_name);
        let meta = cluster_meta(&*store, &keys)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("no cluster {:?} in etcd: start its first master first", a.cluster_name))?;
        if let Some((_, revision)) = read_quota(&*store, &keys).await.map_err(|e| e.to_string())? {
            return Err(already(&a.cluster_name, revision));
        }
        let segments = list_segments(&*store, &keys).await.map_err(|e| e.to_string())?;
        if segments.is_empty() {
            return Err("the cluster has no stable segment: start its nodes with --stable-id first".into());
        }
        let now = tycho_proto::auth::capability::unix_ms();
        let q = plan(meta.groups, &segments, &a.profiles, now).map_err(|e| format!("no plan: {e}"))?;
        print!("{}", describe(&q));
        if a.dry_run {
            println!("dry run: nothing published");
            return Ok(());
        }
        match publish_quota(&*store, &keys, &q).await.map_err(|e| e.to_string())? {
            None => {
                println!(
                    "published the quota of {} groups over {} stable segments to {}",
                    q.groups,
                    q.segments.len(),
                    String::from_utf8_lossy(&keys.quota())
                );
                Ok(())
            }
            Some(revision) => Err(already(&a.cluster_name, revision)),
        }
    })
}

fn already(cluster: &str, revision: i64) -> String {
    format!(
        "cluster {cluster:?} has a published quota already (etcd revision {revision}); a quota is planned once. \
         Re-planning needs the cluster drained and the old quota removed (docs/vsegment.md)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_parse_and_bad_ones_say_why() {
        let p = parse_profile("dram_default:members=4,extent=1GiB,stripe=1MiB,medium=dram,per-segment=2").unwrap();
        assert_eq!((p.members, p.extent, p.stripe, p.medium, p.per_segment), (4, 1 << 30, 1 << 20, Medium::Dram, 2));
        assert_eq!(parse_profile("f:members=2,extent=8MiB,stripe=64KiB,medium=file").unwrap().per_segment, 1);
        for (bad, says) in [
            ("nocolon", "NAME:"),
            ("p:members=4,extent=1GiB", "stripe= is missing"),
            ("p:members=4,extent=1GiB,stripe=1MiB,colour=red", "unknown profile field"),
            ("p:members=4,members=5,extent=1GiB,stripe=1MiB", "twice"),
            ("p:members=1,extent=1GiB,stripe=1MiB", "members"),
            ("p:members=2,extent=1GiB,stripe=1MiB,medium=tape", "unknown medium"),
            ("p:members=x,extent=1GiB,stripe=1MiB", "whole number"),
        ] {
            let e = parse_profile(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
