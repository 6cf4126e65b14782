//! Cluster authentication.
//!
//! - [`Secret`]: the cluster secret, and the keys derived from it (one per purpose, so that a
//!   key leaked from one use cannot be replayed in another).
//! - [`handshake`]: the greeting every RPC and transfer connection starts with; both sides
//!   prove that they hold the secret without sending it.
//! - [`capability`]: the grant a master attaches to each replica range and the segment holder
//!   checks on every transfer, without asking the master.
//! - [`files`]: where processes of one user on one host find the secret by themselves.
//!
//! See `docs/security.md` for what this protects and what it does not.

pub mod capability;
pub mod files;
pub mod gcm_hash;
pub mod handshake;
pub mod session;
pub mod stream;

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Environment variable naming a file that holds the cluster secret.
pub const SECRET_FILE_ENV: &str = "TYCHO_SECRET_FILE";
/// Environment variable holding the cluster secret itself.
pub const SECRET_ENV: &str = "TYCHO_SECRET";
/// Environment variable that, set to `1`, turns authentication off in a client.
pub const INSECURE_ENV: &str = "TYCHO_INSECURE";
/// Shortest secret accepted, in bytes of text: 32 hex digits hold 128 bits. A recorded greeting
/// lets whoever holds it test guesses offline, so a secret must be too large to guess, not only
/// hard to type.
pub const MIN_SECRET_LEN: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// The cluster secret. Every process of a cluster holds the same one; it never travels on
/// the wire. Its `Debug` form shows a fingerprint only.
#[derive(Clone)]
pub struct Secret {
    key: [u8; 32],
}

impl Secret {
    /// A secret from its text form (a file's contents or an environment variable). Surrounding
    /// whitespace is ignored, so that a file ending in a newline and the same text in a
    /// variable are one secret.
    pub fn from_text(text: &[u8]) -> Result<Secret, AuthError> {
        let t = text.trim_ascii();
        if t.len() < MIN_SECRET_LEN {
            return Err(AuthError::WeakSecret(t.len()));
        }
        let mut h = Sha256::new();
        h.update(b"tycho cluster secret v1\0");
        h.update(t);
        Ok(Secret { key: h.finalize().into() })
    }

    /// The key the secret stands for, to hand to a process of the same user over a local
    /// socket (`tycho node` to an attaching Python process); never sent over the network.
    pub fn key(&self) -> [u8; 32] {
        self.key
    }

    /// A secret from the key [`Secret::key`] gave.
    pub fn from_key(key: [u8; 32]) -> Secret {
        Secret { key }
    }

    /// A fresh random secret and its text form (64 hex digits).
    pub fn generate() -> Result<(Secret, String), AuthError> {
        let mut raw = [0u8; 32];
        random_bytes(&mut raw)?;
        let text = hex(&raw);
        Ok((Secret::from_text(text.as_bytes())?, text))
    }

    /// A key for one purpose: HMAC-SHA256 of the label and the length-prefixed parts, keyed
    /// by the secret. Different labels or parts give independent keys.
    pub fn derive(&self, label: &str, parts: &[&[u8]]) -> [u8; 32] {
        mac32(&self.key, label, parts)
    }

    /// A short, non-secret name of the secret, for logs: two processes that print the same
    /// fingerprint hold the same secret.
    pub fn fingerprint(&self) -> String {
        hex(&self.derive("fingerprint", &[])[..6])
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({})", self.fingerprint())
    }
}

/// HMAC-SHA256 keyed by `key` over a label and length-prefixed parts (so that moving bytes
/// between parts changes the result).
pub fn mac32(key: &[u8], label: &str, parts: &[&[u8]]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label.as_bytes());
    m.update(&[0]);
    for p in parts {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Compares two MACs in time independent of where they differ.
pub fn same_mac(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Fills `out` from the kernel's random source.
pub fn random_bytes(out: &mut [u8]) -> Result<(), AuthError> {
    let mut done = 0;
    while done < out.len() {
        let rest = &mut out[done..];
        // SAFETY: the pointer and length describe `rest`, which is writable.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(AuthError::Io(format!("getrandom: {e}")));
        }
        done += n as usize;
    }
    Ok(())
}

/// The credential an operator's tools show the master's admin HTTP server (`Authorization:
/// Bearer <it>`): derived from the secret, so that the secret itself never travels over HTTP,
/// and good for nothing but the admin HTTP server (`tycho admin-token` prints it).
pub fn admin_http_token(secret: &Secret) -> String {
    hex(&secret.derive("admin http token v1", &[]))
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Why authentication could not be set up or did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The secret text is too short to be a secret.
    #[error(
        "the cluster secret is {0} characters long; it must be at least {MIN_SECRET_LEN} (128 bits as hex \
         digits): make a new one with `openssl rand -hex 32`, give it to every process, and restart them"
    )]
    WeakSecret(usize),
    /// A file or directory could not be read, written or trusted.
    #[error("{0}")]
    Io(String),
}

/// How a client side authenticates its connections.
#[derive(Debug, Clone, Default)]
pub enum ClientAuth {
    /// Look the secret up when connecting: `TYCHO_INSECURE=1` turns authentication off;
    /// `TYCHO_SECRET_FILE` or `TYCHO_SECRET` give it; else the file a master on this host
    /// created for the port being connected to (see [`files`]).
    #[default]
    Discover,
    /// Use this secret and insist that the server proves it holds it too.
    Secret(Arc<Secret>),
    /// Never authenticate (`--insecure` clusters only).
    Insecure,
}

/// The outcome of [`ClientAuth::resolve`] for one server address.
#[derive(Debug, Clone)]
pub struct ResolvedAuth {
    /// The secret to prove, if any.
    pub secret: Option<Arc<Secret>>,
    /// Where the secret came from, for error messages.
    pub origin: String,
}

impl ClientAuth {
    /// The secret to use towards the server at `addr` (`host:port`).
    pub fn resolve(&self, addr: &str) -> Result<ResolvedAuth, AuthError> {
        match self {
            ClientAuth::Secret(s) => {
                Ok(ResolvedAuth { secret: Some(s.clone()), origin: "the configured secret".into() })
            }
            ClientAuth::Insecure => Ok(ResolvedAuth { secret: None, origin: "insecure mode".into() }),
            ClientAuth::Discover => {
                if let Some((secret, origin)) = files::from_env()? {
                    return Ok(ResolvedAuth { secret: Some(Arc::new(secret)), origin });
                }
                if files::insecure_from_env() {
                    return Ok(ResolvedAuth { secret: None, origin: format!("{INSECURE_ENV}=1") });
                }
                let port = addr.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
                if let Some(found) = port.and_then(|p| files::find_local(&files::port_name(p))) {
                    let (secret, path) = found?;
                    return Ok(ResolvedAuth { secret: Some(Arc::new(secret)), origin: path.display().to_string() });
                }
                Ok(ResolvedAuth { secret: None, origin: "no secret found".into() })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_keys_depend_on_every_input() {
        let a = Secret::from_text(b"0123456789abcdef0123456789abcdef").unwrap();
        let b = Secret::from_text(b"0123456789abcdef0123456789abcdeF").unwrap();
        assert_eq!(
            a.derive("x", &[b"1"]),
            Secret::from_text(b" 0123456789abcdef0123456789abcdef\n").unwrap().derive("x", &[b"1"])
        );
        assert_ne!(a.derive("x", &[b"1"]), b.derive("x", &[b"1"]));
        assert_ne!(a.derive("x", &[b"1"]), a.derive("y", &[b"1"]));
        assert_ne!(a.derive("x", &[b"12", b"3"]), a.derive("x", &[b"1", b"23"]));
        assert!(matches!(Secret::from_text(b"short"), Err(AuthError::WeakSecret(5))));
        // 16 characters (the old minimum) is refused, 31 too; 32 is the least accepted.
        assert!(matches!(Secret::from_text(b"0123456789abcdef"), Err(AuthError::WeakSecret(16))));
        assert!(matches!(Secret::from_text(&[b'a'; 31]), Err(AuthError::WeakSecret(31))));
        assert!(Secret::from_text(&[b'a'; 32]).is_ok());
        assert!(!format!("{a:?}").contains("0123"));
    }

    #[test]
    fn generated_secrets_differ() {
        let (a, ta) = Secret::generate().unwrap();
        let (b, tb) = Secret::generate().unwrap();
        assert_eq!(ta.len(), 64);
        assert_ne!(ta, tb);
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert!(same_mac(&a.derive("l", &[]), &a.derive("l", &[])));
        assert!(!same_mac(&a.derive("l", &[]), &b.derive("l", &[])));
    }
}
