//! The object commands of the `tycho` binary against a real master and node.

use std::process::Output;

use tycho_testkit::{run_cli, text, MasterProc, NodeProc};

const TYCHO: &str = env!("CARGO_BIN_EXE_tycho");

/// Runs `tycho <args> --master <master>` with `input` on standard input.
fn tycho(master: &str, args: &[&str], input: &[u8]) -> Output {
    run_cli(TYCHO, master, args, &[], input)
}

#[test]
fn put_says_whether_it_stored_and_rm_all_respects_the_tenant() {
    let m = MasterProc::start(TYCHO, &[]);
    let _node = NodeProc::start(TYCHO, &m.rpc, "32MB");

    let first = tycho(&m.rpc, &["put", "greeting", "-"], b"hello");
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert!(text(&first.stderr).contains("stored 5 bytes under greeting"), "{}", text(&first.stderr));
    // Put keeps the existing value, succeeds, and says so.
    let again = tycho(&m.rpc, &["put", "greeting", "-"], b"other");
    assert!(again.status.success());
    assert!(text(&again.stderr).contains("already holds a value; kept it"), "{}", text(&again.stderr));
    let got = tycho(&m.rpc, &["get", "greeting"], b"");
    assert_eq!(got.stdout, b"hello");
    let replaced = tycho(&m.rpc, &["put", "--upsert", "greeting", "-"], b"hi");
    assert!(text(&replaced.stderr).contains("stored 2 bytes"), "{}", text(&replaced.stderr));
    assert_eq!(tycho(&m.rpc, &["get", "greeting"], b"").stdout, b"hi");

    // `rm --all` with a tenant removes that tenant's objects only.
    for (tenant, key) in [("a", "k1"), ("a", "k2"), ("b", "k1")] {
        let out = tycho(&m.rpc, &["put", "--tenant", tenant, key, "-"], b"v");
        assert!(out.status.success(), "{}", text(&out.stderr));
    }
    let rm = tycho(&m.rpc, &["rm", "--tenant", "a", "--all"], b"");
    assert!(rm.status.success(), "{}", text(&rm.stderr));
    assert_eq!(text(&rm.stdout).trim(), "removed 2");
    assert_eq!(text(&tycho(&m.rpc, &["exist", "--tenant", "b", "k1"], b"").stdout).trim(), "1");
    assert_eq!(text(&tycho(&m.rpc, &["exist", "--tenant", "a", "k1"], b"").stdout).trim(), "0");
    assert_eq!(text(&tycho(&m.rpc, &["exist", "greeting"], b"").stdout).trim(), "1");
    // Without a tenant, `--all` removes everything (`--force`: the gets above hold leases).
    let all = tycho(&m.rpc, &["rm", "--all", "--force"], b"");
    assert_eq!(text(&all.stdout).trim(), "removed 2");
    assert_eq!(text(&tycho(&m.rpc, &["exist", "greeting"], b"").stdout).trim(), "0");
}
