//! Where the cluster secret lives on a host.
//!
//! A master started without a secret creates one in the user's runtime directory
//! (`$TYCHO_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/tycho`, else `/tmp/tycho-<uid>`; when
//! another user holds that name first, `~/.local/state/tycho/run`), a directory of mode 0700
//! that this user owns, in a file of mode 0600 named after the master's RPC port
//! (`master-50051.secret`). A client connecting to that port on the same host, as the same
//! user, finds it there without being told. Processes of other users, and other hosts, must be
//! given the secret (`TYCHO_SECRET_FILE` or `TYCHO_SECRET`).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::{AuthError, Secret, INSECURE_ENV, SECRET_ENV, SECRET_FILE_ENV};

/// Environment variable overriding the runtime directory.
pub const RUNTIME_DIR_ENV: &str = "TYCHO_RUNTIME_DIR";

/// File name of the secret of the master listening on `port`.
pub fn port_name(port: u16) -> String {
    format!("master-{port}.secret")
}

/// The user's runtime directory for Tycho (not created).
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(RUNTIME_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Path::new(&d).join("tycho");
    }
    let shared = shared_tmp().join(format!("tycho-{}", uid()));
    if taken_by_another(&shared) {
        // Any user may create a name in /tmp first, to keep this user's processes from
        // starting; the home directory is this user's alone. Every process of the user sees
        // the same squatter, so they all agree on the fallback.
        if let Some(home) = home_runtime_dir() {
            return home;
        }
    }
    shared
}

/// The directory every user shares: `/tmp` (not `$TMPDIR`, which batch schedulers set per
/// job, so that processes of one user would not find each other). Test builds may name
/// another in `TYCHO_TEST_SHARED_TMP`.
fn shared_tmp() -> PathBuf {
    #[cfg(feature = "failpoints")]
    if let Some(d) = std::env::var_os("TYCHO_TEST_SHARED_TMP").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    PathBuf::from("/tmp")
}

/// `~/.local/state/tycho/run`, where the runtime directory goes when another user holds the
/// shared one's name.
fn home_runtime_dir() -> Option<PathBuf> {
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|home| Path::new(&home).join(".local/state/tycho/run"))
}

/// Whether `path` exists as something other than a directory of this user (a squatter's).
fn taken_by_another(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|md| !md.is_dir() || md.uid() != uid())
}

fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// The runtime directory, created if missing; refused unless this user owns it and nobody
/// else may enter it.
pub fn ensure_runtime_dir() -> Result<PathBuf, AuthError> {
    let dir = runtime_dir();
    let made = fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir);
    // Another user may have taken the shared name between the choice and the creation: the
    // home directory then, as `runtime_dir` will say from now on.
    if taken_by_another(&dir) {
        if let Some(home) = home_runtime_dir().filter(|h| *h != dir) {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&home)
                .map_err(|e| AuthError::Io(format!("cannot create {}: {e}", home.display())))?;
            check_private(&home, true)?;
            return Ok(home);
        }
    }
    if let Err(e) = made {
        return Err(AuthError::Io(format!("cannot create {}: {e}", dir.display())));
    }
    check_private(&dir, true)?;
    Ok(dir)
}

/// Refuses a file or directory that another user owns or may read.
fn check_private(path: &Path, dir: bool) -> Result<(), AuthError> {
    let md = fs::symlink_metadata(path).map_err(|e| AuthError::Io(format!("{}: {e}", path.display())))?;
    if md.file_type().is_symlink() || md.is_dir() != dir {
        return Err(AuthError::Io(format!(
            "{} is not a plain {}",
            path.display(),
            if dir { "directory" } else { "file" }
        )));
    }
    if md.uid() != uid() {
        return Err(AuthError::Io(format!(
            "{} belongs to uid {}, not to this user ({})",
            path.display(),
            md.uid(),
            uid()
        )));
    }
    if md.mode() & 0o077 != 0 {
        return Err(AuthError::Io(format!(
            "{} has mode {:o}; other users may read it (chmod go= it, or remove it)",
            path.display(),
            md.mode() & 0o777
        )));
    }
    Ok(())
}

/// Reads a secret file. A file other users may read is refused: the secret in it is not one.
pub fn load(path: &Path) -> Result<Secret, AuthError> {
    check_private(path, false)?;
    let text = fs::read(path).map_err(|e| AuthError::Io(format!("cannot read {}: {e}", path.display())))?;
    Secret::from_text(&text).map_err(|e| AuthError::Io(format!("{}: {e}", path.display())))
}

/// The secret the environment gives (`TYCHO_SECRET_FILE`, then `TYCHO_SECRET`), with where it
/// came from; `None` when neither is set.
pub fn from_env() -> Result<Option<(Secret, String)>, AuthError> {
    if let Some(p) = std::env::var_os(SECRET_FILE_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(p);
        return Ok(Some((load(&path)?, format!("{SECRET_FILE_ENV}={}", path.display()))));
    }
    if let Some(t) = std::env::var_os(SECRET_ENV).filter(|t| !t.is_empty()) {
        use std::os::unix::ffi::OsStrExt;
        return Ok(Some((Secret::from_text(t.as_bytes())?, SECRET_ENV.to_string())));
    }
    Ok(None)
}

/// Whether `TYCHO_INSECURE` asks for no authentication.
pub fn insecure_from_env() -> bool {
    std::env::var(INSECURE_ENV).is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes"))
}

/// The secret stored under `name` in the runtime directory, if the file exists.
pub fn find_local(name: &str) -> Option<Result<(Secret, PathBuf), AuthError>> {
    let path = runtime_dir().join(name);
    if !path.exists() {
        return None;
    }
    Some(load(&path).map(|s| (s, path)))
}

/// How a server came by its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Read from the file or variable named.
    Given(String),
    /// Found in the runtime directory, left by an earlier run on this port or name.
    Reused(PathBuf),
    /// Created now in the runtime directory.
    Created(PathBuf),
}

/// The secret of a server: the file named (`--secret-file`), else the environment, else the
/// runtime directory's file `name`, created when missing.
pub fn server_secret(file: Option<&Path>, name: &str) -> Result<(Secret, Origin), AuthError> {
    if let Some(path) = file {
        return Ok((load(path)?, Origin::Given(path.display().to_string())));
    }
    if let Some((secret, origin)) = from_env()? {
        return Ok((secret, Origin::Given(origin)));
    }
    let dir = ensure_runtime_dir()?;
    let path = dir.join(name);
    if path.exists() {
        return Ok((load(&path)?, Origin::Reused(path)));
    }
    let (secret, text) = Secret::generate()?;
    // Written under a temporary name, then linked into place: a reader never sees half a
    // file, and of two processes racing to create it, one wins and the other reads its file.
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(text.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    };
    let written = write();
    let linked = written.and_then(|()| fs::hard_link(&tmp, &path));
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok((secret, Origin::Created(path))),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok((load(&path)?, Origin::Reused(path))),
        Err(e) => Err(AuthError::Io(format!("cannot create {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_dir<T>(f: impl FnOnce(&Path) -> T) -> T {
        let dir = std::env::temp_dir().join(format!("tycho-auth-test-{}-{}", std::process::id(), line!()));
        let _ = fs::remove_dir_all(&dir);
        fs::DirBuilder::new().mode(0o700).create(&dir).unwrap();
        let out = f(&dir);
        let _ = fs::remove_dir_all(&dir);
        out
    }

    #[test]
    fn loading_refuses_files_others_can_read() {
        with_dir(|d| {
            let p = d.join("s");
            fs::write(&p, "0123456789abcdef0123456789abcdef\n").unwrap();
            fs::set_permissions(&p, fs::Permissions::from_mode(0o644)).unwrap();
            let e = load(&p).unwrap_err();
            assert!(e.to_string().contains("other users may read it"), "{e}");
            fs::set_permissions(&p, fs::Permissions::from_mode(0o600)).unwrap();
            let s = load(&p).unwrap();
            assert_eq!(s.fingerprint(), Secret::from_text(b"0123456789abcdef0123456789abcdef").unwrap().fingerprint());
        });
    }
}
