//! The job directory: a private directory per job and node that holds the local ranks' Unix
//! sockets.
//!
//! It lives in `$XDG_RUNTIME_DIR` when that is a private directory of ours, else in
//! `/tmp/mkernel-<uid>/` (created with mode 0700); its name is `mkernel-<tag>`, where the tag
//! is an HMAC of the store address and node rank under the job key, so it reveals nothing of
//! the key, differs between jobs and between emulated nodes on one host.
//!
//! `/tmp/mkernel-<uid>` has a predictable name, so another local user can create it (or a
//! symbolic link by that name) first. It is then refused, and the job directory goes straight
//! into the temporary directory as `/tmp/mkernel-<uid>-<tag>`: a name derived from the job key,
//! which nobody without the key can predict and so pre-create.
//!
//! Both the base and the job directory must be directories (not symbolic links) owned by this
//! process's uid with no permission bits for group or others; anything else is refused, so no
//! other user can connect to the sockets or swap them.
use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::auth::{self, JobKey};
use crate::env::RankInfo;
use crate::error::{Error, Result};
use crate::sys;

/// Longest socket path the kernel accepts (`sun_path` holds 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// A checked private directory for the job's Unix sockets.
#[derive(Debug, Clone)]
pub struct JobDir {
    path: PathBuf,
}

impl JobDir {
    /// The directory of `info`'s job and node, created if missing (see the module docs).
    pub fn for_rank(info: &RankInfo) -> Result<Self> {
        let xdg = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from);
        let tag = dir_tag(info.job_key(), &info.store_addr(), info.node_rank());
        Self::open(choose_path(xdg, &std::env::temp_dir(), sys::euid(), &tag)?)
    }

    /// Creates `path` with mode 0700 if it is missing (its parent must exist) and checks that
    /// it is private to this user.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        ensure_private_dir(&path)?;
        let longest = path.join("local9999.sock");
        if longest.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(Error::job_dir(
                &path,
                format!("too long for Unix sockets in it (at most {MAX_SOCKET_PATH} bytes per socket path)"),
            ));
        }
        Ok(JobDir { path })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The socket of local rank `local_rank`: `local<LOCAL_RANK>.sock`.
    pub fn socket_path(&self, local_rank: usize) -> PathBuf {
        self.path.join(format!("local{local_rank}.sock"))
    }

    /// Re-creates the directory if it was removed (by a peer's clean-up) and re-checks it.
    pub(crate) fn ensure(&self) -> Result<()> {
        ensure_private_dir(&self.path)
    }
}

/// Checks that `path` is a directory (not a symbolic link) owned by this process's uid and
/// not accessible by group or others.
pub fn check_private_dir(path: &Path) -> Result<()> {
    let meta = fs::symlink_metadata(path).map_err(|e| Error::job_dir(path, format!("cannot inspect it: {e}")))?;
    if meta.file_type().is_symlink() {
        return Err(Error::job_dir(path, "is a symbolic link; refusing it"));
    }
    if !meta.is_dir() {
        return Err(Error::job_dir(path, "is not a directory"));
    }
    let own = sys::euid();
    if meta.uid() != own {
        return Err(Error::job_dir(
            path,
            format!(
                "is owned by uid {}, not by this process's uid {own}; refusing it",
                meta.uid()
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(Error::job_dir(
            path,
            format!("is accessible by group or others (mode {mode:04o}); it must be 0700 (chmod 700 it or remove it)"),
        ));
    }
    Ok(())
}

/// Creates `path` with mode 0700 unless it exists, then checks it.
fn ensure_private_dir(path: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {
            // The umask may have removed owner bits; it cannot have added others.
            fs::set_permissions(path, fs::Permissions::from_mode(0o700))
                .map_err(|e| Error::job_dir(path, format!("cannot set mode 0700: {e}")))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::job_dir(path, format!("cannot create it: {e}"))),
    }
    check_private_dir(path)
}

/// Where the job directory `mkernel-<tag>` goes: in `xdg` when that is a private directory of
/// ours; else in `<temp>/mkernel-<uid>` (created if missing); else, when that base is not ours
/// (another user made it, or made a symbolic link there), `<temp>/mkernel-<uid>-<tag>`.
fn choose_path(xdg: Option<PathBuf>, temp: &Path, uid: u32, tag: &str) -> Result<PathBuf> {
    let name = format!("mkernel-{tag}");
    if let Some(xdg) = xdg {
        if xdg.is_absolute() && check_private_dir(&xdg).is_ok() {
            return Ok(xdg.join(name));
        }
    }
    let base = temp.join(format!("mkernel-{uid}"));
    match ensure_private_dir(&base) {
        Ok(()) => Ok(base.join(name)),
        Err(e) if hijacked(&base, uid) => {
            let fallback = temp.join(format!("mkernel-{uid}-{tag}"));
            tracing::warn!(
                "{e}; another user seems to have created it: using {} instead (remove {} to go back)",
                fallback.display(),
                base.display()
            );
            Ok(fallback)
        }
        Err(e) => Err(e),
    }
}

/// Whether `path` exists as something another user controls: owned by another uid, or a
/// symbolic link (which we never create).
fn hijacked(path: &Path, uid: u32) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink() || m.uid() != uid)
}

/// 24 hex digits from the job key, the store address and the node.
fn dir_tag(key: &JobKey, store_addr: &str, node_rank: usize) -> String {
    let t = auth::tag(
        key,
        auth::label::JOB_DIR,
        &[store_addr.as_bytes(), &(node_rank as u64).to_le_bytes()],
    );
    t[..12].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;

    #[test]
    fn creates_a_private_directory() {
        let tmp = TempDir::new("jobdir-create");
        let dir = JobDir::open(tmp.path().join("job")).unwrap();
        let mode = fs::metadata(dir.path()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert_eq!(dir.socket_path(3), tmp.path().join("job/local3.sock"));
        // Opening it again checks and accepts it.
        JobDir::open(dir.path()).unwrap();
    }

    #[test]
    fn refuses_a_directory_others_can_open() {
        let tmp = TempDir::new("jobdir-0755");
        let path = tmp.path().join("job");
        fs::create_dir(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        let e = JobDir::open(&path).unwrap_err().to_string();
        assert!(e.contains("accessible by group or others (mode 0755)"), "{e}");
    }

    #[test]
    fn refuses_symlinks_files_and_missing_parents() {
        let tmp = TempDir::new("jobdir-odd");
        let real = tmp.path().join("real");
        JobDir::open(&real).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(JobDir::open(&link).unwrap_err().to_string().contains("symbolic link"));
        let file = tmp.path().join("file");
        fs::write(&file, b"x").unwrap();
        assert!(JobDir::open(&file).unwrap_err().to_string().contains("not a directory"));
        assert!(JobDir::open(tmp.path().join("no/such"))
            .unwrap_err()
            .to_string()
            .contains("cannot create"));
    }

    #[test]
    fn names_differ_by_job_and_node() {
        let k = JobKey::new("k-0123456789abcdef").unwrap();
        let a = dir_tag(&k, "h:1", 0);
        assert_eq!(a.len(), 24);
        assert_ne!(a, dir_tag(&k, "h:1", 1));
        assert_ne!(a, dir_tag(&k, "h:2", 0));
        assert_ne!(a, dir_tag(&JobKey::new("j-0123456789abcdef").unwrap(), "h:1", 0));
    }

    #[test]
    fn a_base_taken_by_another_user_is_bypassed() {
        let uid = sys::euid();
        let tmp = TempDir::new("jobdir-hijack");
        let t = tmp.path();
        // Normal case: the per-user base, created private.
        let p = choose_path(None, t, uid, "abc").unwrap();
        assert_eq!(p, t.join(format!("mkernel-{uid}/mkernel-abc")));
        // Another user's symbolic link where our base would be (a link we never make).
        let t2 = TempDir::new("jobdir-hijack-link");
        let elsewhere = t2.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, t2.path().join(format!("mkernel-{uid}"))).unwrap();
        let p = choose_path(None, t2.path(), uid, "abc").unwrap();
        assert_eq!(p, t2.path().join(format!("mkernel-{uid}-abc")));
        let dir = JobDir::open(&p).unwrap();
        check_private_dir(dir.path()).unwrap();
        // A base owned by another uid (needs root to make one).
        if uid == 0 {
            let t3 = TempDir::new("jobdir-hijack-owner");
            let base = t3.path().join("mkernel-0");
            fs::create_dir(&base).unwrap();
            std::os::unix::fs::chown(&base, Some(65534), Some(65534)).unwrap();
            let p = choose_path(None, t3.path(), 0, "abc").unwrap();
            assert_eq!(p, t3.path().join("mkernel-0-abc"));
        }
        // Our own base with a bad mode is our own doing: an error that says how to fix it.
        let t4 = TempDir::new("jobdir-own-mode");
        let base = t4.path().join(format!("mkernel-{uid}"));
        fs::create_dir(&base).unwrap();
        fs::set_permissions(&base, fs::Permissions::from_mode(0o755)).unwrap();
        let e = choose_path(None, t4.path(), uid, "abc").unwrap_err().to_string();
        assert!(e.contains("chmod 700"), "{e}");
    }

    #[test]
    fn default_directory_is_private() {
        let info = RankInfo::new(0, 1, 1, "127.0.0.1", 1, JobKey::random().unwrap()).unwrap();
        let dir = JobDir::for_rank(&info).unwrap();
        check_private_dir(dir.path()).unwrap();
        fs::remove_dir(dir.path()).unwrap();
    }
}
