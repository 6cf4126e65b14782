//! `tycho fuzz`: feeds mutated bytes to every decoder that reads network input and fails on the
//! first panic. The decoders must turn any bytes into a value or an error.
//!
//! Targets: `frame` (frame headers and RPC messages), `transfer` (transfer request, answer and
//! trailer), `handshake` (all three greeting messages), `capability` (a capability checked
//! against a segment key). Inputs are seeds from a corpus directory, and mutations of them (bit
//! flips, byte overwrites with edge values, insertions, deletions, truncations, splices) drawn
//! from a seeded generator, so a run is reproducible from its seed. A failing input is written
//! to `<corpus>/../crashes/` and its hex printed.
//!
//! ```text
//! tycho fuzz --corpus fuzz/corpus                       # every target, until a failure or Ctrl-C
//! tycho fuzz --corpus fuzz/corpus --iterations 20000 --seed 1   # bounded (what scripts/test runs)
//! tycho fuzz --write-seeds fuzz/corpus                  # regenerate the seed corpus
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use tycho_proto::auth::capability::{Capability, SegmentKey, RIGHT_READ, RIGHT_WRITE};
use tycho_proto::auth::handshake::{self, ClientSide, Identity, ServerSide, Service};
use tycho_proto::auth::{ResolvedAuth, Secret};
use tycho_proto::frame::{decode_payload, encode_frame, split_frame, FrameKind};
use tycho_proto::*;
use tycho_transfer::wire::{decode_answer, encode_answer, XferOp, XferRequest, ANSWER_LEN, REQUEST_LEN};

/// `tycho fuzz` flags.
#[derive(Args, Debug)]
pub struct FuzzArgs {
    /// One target (frame, transfer, handshake, capability) or all.
    #[arg(long, default_value = "all")]
    pub target: String,
    /// Directory with one sub-directory of seed files per target.
    #[arg(long, default_value = "fuzz/corpus")]
    pub corpus: PathBuf,
    /// Mutated inputs per target; 0 runs until a failure or until interrupted.
    #[arg(long, default_value_t = 0)]
    pub iterations: u64,
    /// Seed of the mutation generator (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Write the seed corpus into this directory and exit.
    #[arg(long = "write-seeds")]
    pub write_seeds: Option<PathBuf>,
}

const TARGETS: &[&str] = &["frame", "transfer", "handshake", "capability"];

/// A xorshift generator: small, seedable, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn secret() -> Arc<Secret> {
    Arc::new(Secret::from_text(b"fuzzing-cluster-secret-of-enough-length").expect("long enough"))
}

/// Runs one input through `target`'s decoders. Decoding errors are fine; only a panic fails.
fn run_one(target: &str, input: &[u8]) {
    match target {
        "frame" => {
            if let Ok(Some((_, payload, _))) = split_frame(input, 1 << 20) {
                let _ = decode_payload::<Request>(payload);
                let _ = decode_payload::<Response>(payload);
            }
            let _ = decode_payload::<Request>(input);
            let _ = decode_payload::<Response>(input);
        }
        "transfer" => {
            let mut head = [0u8; REQUEST_LEN];
            let n = input.len().min(REQUEST_LEN);
            head[..n].copy_from_slice(&input[..n]);
            if let Ok(r) = XferRequest::decode(&head) {
                let _ = r.within_grant();
            }
            let mut answer = [0u8; ANSWER_LEN];
            let n = input.len().min(ANSWER_LEN);
            answer[..n].copy_from_slice(&input[input.len() - n..]);
            let _ = decode_answer(&answer);
        }
        "handshake" => {
            let payload = handshake::split_hello(input).unwrap_or(input);
            let s = secret();
            let (server, _) = ServerSide::start(Service::Rpc, Some(s.clone())).expect("random nonce");
            let _ = server.finish(payload);
            let auth = ResolvedAuth { secret: Some(s.clone()), origin: "fuzz".into() };
            let id = Identity::Client { client: 7, tenant: "t".into(), credential: handshake::credential(&s, 7, "t") };
            if let Ok((client, _)) = ClientSide::answer(Service::Rpc, payload, &auth, Some(&id)) {
                let _ = client.finish(payload);
            }
        }
        "capability" => {
            let mut head = [0u8; REQUEST_LEN];
            let n = input.len().min(REQUEST_LEN);
            head[..n].copy_from_slice(&input[..n]);
            head[0..4].copy_from_slice(b"TYXF");
            head[5] = tycho_transfer::wire::XFER_VERSION;
            if let Ok(r) = XferRequest::decode(&head) {
                let key = SegmentKey::new(&secret(), r.segment, r.incarnation);
                let verdict = key.check(r.grant_offset, r.grant_len, r.gen, &r.cap, RIGHT_READ, 0);
                // A MAC the fuzzer made up must never pass (2^-128 by chance).
                assert!(verdict.is_err(), "a capability from random bytes was accepted");
            }
            let _ = decode_payload::<Capability>(input);
        }
        other => panic!("unknown target {other}"),
    }
}

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut v = if seeds.is_empty() { Vec::new() } else { seeds[rng.below(seeds.len())].clone() };
    for _ in 0..1 + rng.below(8) {
        let len = v.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = [0, 1, 0x7f, 0x80, 0xff][rng.below(5)];
            }
            2 => {
                let i = rng.below(len + 1);
                v.insert(i, rng.next() as u8);
            }
            3 if len > 0 => {
                v.remove(rng.below(len));
            }
            4 => v.truncate(rng.below(len + 1)),
            5 if len >= 4 => {
                // A length-like field set to an edge value.
                let i = rng.below(len - 3);
                let edge = [0u32, 1, 0xffff, 0x7fff_ffff, u32::MAX][rng.below(5)];
                v[i..i + 4].copy_from_slice(&edge.to_le_bytes());
            }
            _ => {
                if let Some(other) = seeds.get(rng.below(seeds.len().max(1))) {
                    let cut = rng.below(other.len() + 1);
                    v.extend_from_slice(&other[cut..]);
                }
            }
        }
    }
    v.truncate(4096);
    v
}

fn load_seeds(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

fn fails(target: &str, input: &[u8]) -> bool {
    std::panic::catch_unwind(|| run_one(target, input)).is_err()
}

fn report(target: &str, input: &[u8], corpus: &Path) {
    let dir = corpus.parent().unwrap_or(Path::new(".")).join("crashes");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!(
        "{target}-{:016x}",
        input.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3))
    ));
    let _ = std::fs::write(&path, input);
    eprintln!("FAILED {target}: input saved to {}", path.display());
    eprintln!("  hex: {}", tycho_proto::auth::hex(input));
}

/// Runs the fuzzer; the exit code is 1 on the first failing input.
pub fn run(args: FuzzArgs) -> i32 {
    if let Some(dir) = &args.write_seeds {
        return match write_seeds(dir) {
            Ok(n) => {
                println!("wrote {n} seed files under {}", dir.display());
                0
            }
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        };
    }
    let targets: Vec<&str> = match args.target.as_str() {
        "all" => TARGETS.to_vec(),
        t if TARGETS.contains(&t) => vec![t],
        t => {
            eprintln!("error: unknown target {t:?}; use one of {TARGETS:?} or all");
            return 2;
        }
    };
    // Panics are the findings: keep their messages short.
    std::panic::set_hook(Box::new(|info| eprintln!("panic: {info}")));
    let seed = args.seed.unwrap_or_else(|| tycho_proto::auth::capability::unix_ms() | 1);
    println!("tycho fuzz: seed {seed}, targets {targets:?}");
    let seeds: Vec<Vec<Vec<u8>>> = targets.iter().map(|t| load_seeds(&args.corpus.join(t))).collect();
    for (t, s) in targets.iter().zip(&seeds) {
        for input in s {
            if fails(t, input) {
                report(t, input, &args.corpus);
                return 1;
            }
        }
        println!("  {t}: {} corpus inputs ok", s.len());
    }
    let mut rng = Rng(seed);
    let mut done = 0u64;
    loop {
        for (t, s) in targets.iter().zip(&seeds) {
            let input = mutate(&mut rng, s);
            if fails(t, &input) {
                report(t, &input, &args.corpus);
                return 1;
            }
        }
        done += 1;
        if args.iterations > 0 && done >= args.iterations {
            println!("  {done} mutated inputs per target ok");
            return 0;
        }
        if args.iterations == 0 && done.is_multiple_of(1_000_000) {
            println!("  {done} mutated inputs per target ok so far");
        }
    }
}

/// Valid encodings of each target's messages, as starting points for mutation.
fn write_seeds(dir: &Path) -> std::io::Result<usize> {
    let mut n = 0;
    let mut put = |target: &str, name: &str, bytes: &[u8]| -> std::io::Result<()> {
        let d = dir.join(target);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(name), bytes)?;
        n += 1;
        Ok(())
    };
    let key = KeyRef { key: "k".into(), route: tycho_routing::route_for("", "k", 1) };
    let requests = [
        Request::Ping { client: ClientId(1) },
        Request::GetReplicaList(KeyQuery { tenant: "t".into(), key: key.clone() }),
        Request::BatchExistKey(BatchKeyQuery { tenant: String::new(), keys: vec![key.clone(), key.clone()] }),
        Request::PutStart(WriteStart {
            client: ClientId(2),
            tenant: String::new(),
            key: key.clone(),
            size: 4096,
            config: ReplicateConfig::default(),
            write_id: 9,
        }),
        Request::RemoveByRegex { tenant: String::new(), regex: "a.*".into(), force: true },
    ];
    for (i, r) in requests.iter().enumerate() {
        let mut f = Vec::new();
        encode_frame(&mut f, FrameKind::Request, i as u64, r).expect("encodes");
        put("frame", &format!("request-{i}"), &f)?;
    }
    let replica = ReplicaDesc {
        segment: SegmentId(5),
        offset: 4096,
        len: 100,
        endpoint: "127.0.0.1:1".into(),
        host: "h".into(),
        incarnation: 1,
        gen: 2,
        cap: Capability { rights: RIGHT_READ, expires_ms: 1, epoch: 1, group: 0, tenant: 3, mac: [4; 16] },
    };
    let list = ReplicaList { size: 100, replicas: vec![replica.clone()], lease_ttl_ms: 5000 };
    let mut f = Vec::new();
    encode_frame(&mut f, FrameKind::Response, 1, &Response::Replicas(list)).expect("encodes");
    put("frame", "response-replicas", &f)?;
    let req = XferRequest {
        op: XferOp::Write,
        segment: SegmentId(5),
        offset: 4096,
        len: 100,
        incarnation: 1,
        gen: 2,
        grant_offset: 4096,
        grant_len: 100,
        cap: Capability { rights: RIGHT_WRITE, ..replica.cap },
    };
    let mut t = req.encode().to_vec();
    t.extend_from_slice(&encode_answer(Ok(100)));
    put("transfer", "write", &t)?;
    put("capability", "request", &req.encode())?;
    let s = secret();
    let (server, hello) = ServerSide::start(Service::Rpc, Some(s.clone())).expect("nonce");
    put("handshake", "server-hello", &hello)?;
    let auth = ResolvedAuth { secret: Some(s.clone()), origin: "seed".into() };
    let id = Identity::Client { client: 7, tenant: "t".into(), credential: handshake::credential(&s, 7, "t") };
    let (_, reply) = ClientSide::answer(Service::Rpc, handshake::split_hello(&hello).expect("hello"), &auth, Some(&id))
        .expect("answer");
    put("handshake", "client-hello", &reply)?;
    let (finish, _) = server.finish(handshake::split_hello(&reply).expect("reply"));
    put("handshake", "server-finish", &finish)?;
    Ok(n)
}
