//! The committed fuzz corpus and a fixed-seed bounded run of every network decoder: no input
//! makes a decoder panic, and no made-up capability passes. Fixed seed, so CI never turns red
//! at random; `tycho fuzz --corpus fuzz/corpus` runs open-ended (docs/security.md).

use std::process::Command;

#[test]
fn every_decoder_survives_the_corpus_and_a_seeded_run() {
    let corpus = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus");
    let out = Command::new(env!("CARGO_BIN_EXE_tycho"))
        .args(["fuzz", "--corpus", corpus, "--iterations", "200000", "--seed", "20261204"])
        .output()
        .expect("tycho fuzz runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for target in ["frame", "transfer", "handshake", "capability"] {
        assert!(stdout.contains(&format!("{target}: ")), "{target} ran: {stdout}");
    }
    assert!(stdout.contains("200000 mutated inputs per target ok"), "{stdout}");
}
