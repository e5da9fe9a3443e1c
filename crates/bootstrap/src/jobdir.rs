//! The job directory: a private directory per job and node that holds the local ranks' Unix
//! sockets.
//!
//! It lives in `$XDG_RUNTIME_DIR` when that is a private directory of ours, else in
//! `/tmp/mkernel-<uid>/` (created with mode 0700); its name is `mkernel-<tag>`, where the tag
//! is an HMAC of the store address and node rank under the job key, so it reveals nothing of
//! the key, differs between jobs and between emulated nodes on one host.
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
        let base = default_base()?;
        Self::open(base.join(dir_name(info.job_key(), &info.store_addr(), info.node_rank())))
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

/// `$XDG_RUNTIME_DIR` when it is private to us, else `/tmp/mkernel-<uid>`.
fn default_base() -> Result<PathBuf> {
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        if xdg.is_absolute() && check_private_dir(&xdg).is_ok() {
            return Ok(xdg);
        }
    }
    let base = std::env::temp_dir().join(format!("mkernel-{}", sys::euid()));
    ensure_private_dir(&base)?;
    Ok(base)
}

/// `mkernel-<24 hex digits>`, from the job key, the store address and the node.
fn dir_name(key: &JobKey, store_addr: &str, node_rank: usize) -> String {
    let t = auth::tag(
        key,
        auth::label::JOB_DIR,
        &[store_addr.as_bytes(), &(node_rank as u64).to_le_bytes()],
    );
    let hex: String = t[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("mkernel-{hex}")
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
        let a = dir_name(&k, "h:1", 0);
        assert_eq!(a.len(), "mkernel-".len() + 24);
        assert_ne!(a, dir_name(&k, "h:1", 1));
        assert_ne!(a, dir_name(&k, "h:2", 0));
        assert_ne!(a, dir_name(&JobKey::new("j-0123456789abcdef").unwrap(), "h:1", 0));
    }

    #[test]
    fn default_directory_is_private() {
        let info = RankInfo::new(0, 1, 1, "127.0.0.1", 1, JobKey::random().unwrap()).unwrap();
        let dir = JobDir::for_rank(&info).unwrap();
        check_private_dir(dir.path()).unwrap();
        fs::remove_dir(dir.path()).unwrap();
    }
}
