//! NVIDIA MPS for `launch --share-gpu`: several rank processes run kernels on one GPU at once.
//!
//! Persistent kernels that wait on each other need their grids resident together, which time
//! slicing between contexts does not give; MPS does. [`Mps::start`] reuses a control daemon that
//! already serves this host (`CUDA_MPS_PIPE_DIRECTORY`, else the default `/tmp/nvidia-mps`) and
//! otherwise starts one in the foreground (`-f`) as a child in its own process group, with a
//! private pipe and log directory. A daemon this launcher started is always stopped: `quit`
//! through its pipe, then SIGKILL to its process group if it is still there, also from `Drop`, so
//! a failing rank, a timeout or an error on the way out cannot leave it behind.
//!
//! The private directory ([`create_private_dir`]) has a random name under the temp directory,
//! is created with mode 0700 by one `mkdir` that fails if anything (a directory, a symlink, a
//! pipe) already has that name, and is checked with `lstat` afterwards: another local user can
//! neither predict it, nor pre-create it, nor redirect it. A running daemon is reused only when
//! its pipe directory belongs to this user or root and nobody else may write into it.
use anyhow::{bail, Context, Result};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The control program, shipped with the NVIDIA driver's compute utilities.
pub const CONTROL: &str = "nvidia-cuda-mps-control";
/// The control daemon's default pipe directory.
const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// How long the daemon gets to create its control pipe, and to exit after `quit`.
const DAEMON_WAIT: Duration = Duration::from_secs(10);

/// A control daemon serving this launch's ranks.
pub struct Mps {
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    /// The daemon this launcher started (`None` when an existing one is reused).
    daemon: Option<Child>,
    /// The private directory holding `pipe/` and `log/`, removed after the daemon stops.
    own_dir: Option<PathBuf>,
}

/// `name` on `PATH`, if it is there.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// `bytes` random bytes from the kernel (`/dev/urandom`), as hex.
pub fn random_hex(bytes: usize) -> Result<String> {
    use std::io::Read;
    let mut b = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("reading /dev/urandom")?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// This process's effective uid: the owner of `/proc/self`.
fn own_uid() -> Result<u32> {
    Ok(std::fs::metadata("/proc/self").context("reading /proc/self")?.uid())
}

/// Creates the directory `path` with mode 0700 and checks it: refused when anything already
/// has that name (`mkdir` does not follow a symlink there; it fails with "exists"), or when
/// the result is not a directory of this user closed to group and others.
pub fn create_private_dir(path: &Path) -> Result<()> {
    std::fs::DirBuilder::new().mode(0o700).create(path).with_context(|| {
        format!(
            "creating the private directory {} (refused if it already exists: someone else may have created it)",
            path.display()
        )
    })?;
    check_private_dir(path, &[own_uid()?])
}

/// `path` is a directory (not a symlink to one) owned by one of `owners`, with no access for
/// group or others.
fn check_private_dir(path: &Path, owners: &[u32]) -> Result<()> {
    check_dir(path, owners, 0o077)
}

/// `path` is a directory (not a symlink to one) owned by one of `owners`, with none of the
/// permission bits `closed` (`0o077`: private; `0o022`: nobody else may write).
fn check_dir(path: &Path, owners: &[u32], closed: u32) -> Result<()> {
    let m = std::fs::symlink_metadata(path).with_context(|| format!("lstat {}", path.display()))?;
    if !m.file_type().is_dir() {
        bail!("{} is not a directory (a symlink or another file)", path.display());
    }
    if !owners.contains(&m.uid()) {
        bail!("{} belongs to uid {}, not to {owners:?}", path.display(), m.uid());
    }
    if m.permissions().mode() & closed != 0 {
        bail!(
            "{} has mode {:o}: open to group or others",
            path.display(),
            m.permissions().mode() & 0o777
        );
    }
    Ok(())
}

/// A fresh private directory `<temp>/mkernel-mps-<128 random bits>` holding `pipe/` and `log/`
/// (each created the same way).
fn private_mps_dir() -> Result<PathBuf> {
    let own = std::env::temp_dir().join(format!("mkernel-mps-{}", random_hex(16)?));
    create_private_dir(&own)?;
    for sub in ["pipe", "log"] {
        if let Err(e) = create_private_dir(&own.join(sub)) {
            let _ = std::fs::remove_dir_all(&own);
            return Err(e);
        }
    }
    Ok(own)
}

/// Whether a control daemon answers on `pipe_dir`.
fn answers(pipe_dir: &Path) -> bool {
    if !pipe_dir.join("control").exists() {
        return false;
    }
    control(pipe_dir, "get_server_list").is_ok()
}

/// Sends one command to the daemon on `pipe_dir`; its answer.
fn control(pipe_dir: &Path, command: &str) -> Result<String> {
    use std::io::Write;
    let mut child = Command::new(CONTROL)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {CONTROL}"))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(format!("{command}\n").as_bytes())?;
    let out = wait_output(child, DAEMON_WAIT).with_context(|| format!("{CONTROL} <<< {command}"))?;
    if !out.status.success() {
        bail!(
            "{CONTROL} <<< {command}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `child`'s output, killing it after `limit`.
fn wait_output(mut child: Child, limit: Duration) -> Result<std::process::Output> {
    let start = Instant::now();
    while child.try_wait()?.is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("no answer within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(child.wait_with_output()?)
}

impl Mps {
    /// A daemon that serves this host's GPUs: the one already running, or a new private one.
    /// Errors say what is missing and how to get it; nothing is left running on an error.
    pub fn start() -> Result<Mps> {
        if find_on_path(CONTROL).is_none() {
            bail!(
                "--share-gpu needs NVIDIA MPS, but `{CONTROL}` is not on PATH. It ships with the NVIDIA driver's \
                 compute utilities (e.g. Ubuntu's nvidia-compute-utils-<driver> package, or the driver's .run \
                 installer); install it, or run with one rank per GPU (without --share-gpu)"
            );
        }
        let existing = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
            .map(PathBuf::from)
            .unwrap_or(DEFAULT_PIPE_DIR.into());
        // Another user's directory there could hold a pipe of their own daemon (or none that
        // is a daemon at all): only this user's or root's, writable by nobody else, is trusted.
        let trusted = match own_uid().and_then(|me| check_dir(&existing, &[me, 0], 0o022)) {
            Ok(()) => true,
            Err(e) => {
                if existing.exists() {
                    println!("launch: not using the MPS daemon at {}: {e:#}", existing.display());
                }
                false
            }
        };
        if trusted && answers(&existing) {
            let log_dir = std::env::var_os("CUDA_MPS_LOG_DIRECTORY")
                .map(PathBuf::from)
                .unwrap_or("/var/log/nvidia-mps".into());
            println!(
                "launch: using the MPS control daemon already serving {}",
                existing.display()
            );
            return Ok(Mps {
                pipe_dir: existing,
                log_dir,
                daemon: None,
                own_dir: None,
            });
        }
        let own = private_mps_dir()?;
        let (pipe_dir, log_dir) = (own.join("pipe"), own.join("log"));
        let log = match std::fs::File::create_new(log_dir.join("launcher-daemon.log")) {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&own);
                return Err(e).context("creating the daemon's log file");
            }
        };
        let mut cmd = Command::new(CONTROL);
        cmd.arg("-f")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &log_dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // Its own process group: the MPS server it spawns is stopped with it.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let daemon = match cmd.spawn() {
            Ok(d) => d,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&own);
                return Err(e).with_context(|| format!("starting {CONTROL} -f"));
            }
        };
        let mut mps = Mps {
            pipe_dir,
            log_dir,
            daemon: Some(daemon),
            own_dir: Some(own),
        };
        let start = Instant::now();
        loop {
            if let Some(status) = mps.daemon.as_mut().expect("started").try_wait()? {
                let why = mps.log_tail();
                mps.daemon = None;
                bail!(
                    "the MPS control daemon exited at once ({status}); MPS needs the right to start it (root, or the GPU's \
                     compute mode allowing it) and a driver with MPS support. Its log: {why}"
                );
            }
            if answers(&mps.pipe_dir) {
                break;
            }
            if start.elapsed() > DAEMON_WAIT {
                let why = mps.log_tail();
                mps.stop();
                bail!("the MPS control daemon did not answer within {DAEMON_WAIT:?}; its log: {why}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!(
            "launch: started an MPS control daemon (pipe {})",
            mps.pipe_dir.display()
        );
        Ok(mps)
    }

    /// The variables that connect a rank to this daemon.
    pub fn configure(&self, cmd: &mut Command) {
        cmd.env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir);
    }

    fn log_tail(&self) -> String {
        let mut text = String::new();
        for f in ["launcher-daemon.log", "control.log", "server.log"] {
            if let Ok(s) = std::fs::read_to_string(self.log_dir.join(f)) {
                text.push_str(&s);
            }
        }
        let tail: Vec<&str> = text.lines().rev().take(8).collect();
        if tail.is_empty() {
            "(empty)".into()
        } else {
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        }
    }

    /// Stops the daemon this launcher started (a reused one is left alone).
    pub fn stop(&mut self) {
        let Some(mut daemon) = self.daemon.take() else { return };
        let _ = control(&self.pipe_dir, "quit");
        let start = Instant::now();
        while start.elapsed() < DAEMON_WAIT {
            if let Ok(Some(_)) = daemon.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Whatever is left of its process group (the daemon, an MPS server it started).
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", daemon.id())])
            .stderr(Stdio::null())
            .status();
        let _ = daemon.kill();
        let _ = daemon.wait();
        if let Some(dir) = self.own_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
        println!("launch: stopped the MPS control daemon");
    }
}

impl Drop for Mps {
    fn drop(&mut self) {
        self.stop();
    }
}

/// MPS share (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) of each of `ranks` ranks on one GPU
/// (`--mps-percent` overrides): an even split for 2 ranks, no per-client cap (100) for 3 or more.
///
/// With 4 ranks at 25% a rank's launch sometimes started only part of its grid: of 25 CTAs, 9
/// entered and 16 never did while the peers' grids ran (measured on one H100 through the CTA
/// entry marks, docs/testing.md "A launch that stalls on shared GPUs"), and every peer timed out
/// on that rank's counters. Why a capped client gets fewer SMs than its share while SMs are free
/// is not documented by NVIDIA (a cap counted in whole TPCs would explain it; not measured).
/// Without the cap, grids that add up to at most 80% of the SMs ([`persistent_sm_percent`]) fit,
/// and the failing case passed that way.
pub fn default_sm_percent(ranks: usize) -> u32 {
    match ranks {
        0 | 1 => 100,
        2 => 50,
        _ => 100,
    }
}

/// Percentage of its MPS share that a rank's persistent grids use
/// (`MKERNEL_PERSISTENT_SM_PERCENT`) when `ranks` share a GPU.
///
/// The ranks' persistent grids must be resident at once, and each rank's own other GPU work
/// (the emulated wire's copies between ranks of one GPU) needs SMs while its grid runs. Measured
/// on one H100 (132 SMs, driver 580) with grids filling the share: 2 ranks at 50% ran every
/// fused test; 4 ranks at 25% and 24% did not (a grid never started); 4 at 20% (26 SMs each) ran
/// one node but not 2 emulated nodes x 2 (the wire's copies waited for the grids that waited
/// for them). Grids of 80% of the share leave both kinds of room (docs/testing.md). For 3 or
/// more ranks, which run without a per-client cap ([`default_sm_percent`]), each grid takes
/// `80 / ranks - 1` percent of the GPU (19% = 25 CTAs of 132 SMs at 4 ranks, the measured
/// setting): together under the residency check's 80% after rounding.
pub fn persistent_sm_percent(ranks: usize) -> u32 {
    match ranks {
        0 | 1 => 100,
        2 => 80,
        n => (80 / n as u32).saturating_sub(1).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn shares_split_evenly_and_grids_leave_room() {
        assert_eq!(default_sm_percent(1), 100);
        assert_eq!(default_sm_percent(2), 50);
        assert_eq!(default_sm_percent(4), 100);
        assert_eq!(persistent_sm_percent(1), 100);
        assert_eq!(persistent_sm_percent(2), 80);
        assert_eq!(persistent_sm_percent(4), 19);
        assert_eq!(persistent_sm_percent(3), 25);
        assert!(persistent_sm_percent(1000) >= 1);
        // 4 ranks on 132 SMs: 25 CTAs each, 100 in all, under 80% (105).
        assert!(4 * (132 * persistent_sm_percent(4) / 100) <= 132 * 80 / 100);
    }
    /// A fresh directory is created 0700; a name that already exists (a directory someone
    /// created first, a symlink to one, a file) is refused and left as it was.
    #[test]
    fn private_directories_are_new_and_closed() {
        let base = std::env::temp_dir().join(format!("mkernel-mps-test-{}", random_hex(8).unwrap()));
        create_private_dir(&base).unwrap();
        let m = std::fs::symlink_metadata(&base).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o700);
        let fresh = base.join("fresh");
        create_private_dir(&fresh).unwrap();
        let pre = base.join("pre-created");
        std::fs::create_dir(&pre).unwrap();
        std::fs::set_permissions(&pre, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = format!("{:#}", create_private_dir(&pre).unwrap_err());
        assert!(e.contains("exists"), "{e}");
        let link = base.join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        assert!(create_private_dir(&link).is_err());
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        let file = base.join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(create_private_dir(&file).is_err());
        // The checks themselves: a symlink, an open mode, another owner.
        assert!(check_private_dir(&link, &[own_uid().unwrap()]).is_err());
        assert!(check_private_dir(&pre, &[own_uid().unwrap()])
            .unwrap_err()
            .to_string()
            .contains("mode 777"));
        assert!(check_private_dir(&fresh, &[own_uid().unwrap() + 1]).is_err());
        // A daemon's directory others may read but not write is trusted for reuse.
        std::fs::set_permissions(&pre, std::fs::Permissions::from_mode(0o755)).unwrap();
        check_dir(&pre, &[own_uid().unwrap()], 0o022).unwrap();
        assert!(check_private_dir(&pre, &[own_uid().unwrap()]).is_err());
        std::fs::set_permissions(&pre, std::fs::Permissions::from_mode(0o775)).unwrap();
        assert!(check_dir(&pre, &[own_uid().unwrap()], 0o022).is_err());
        let dir = private_mps_dir().unwrap();
        assert!(dir.file_name().unwrap().to_str().unwrap().len() == "mkernel-mps-".len() + 32);
        for d in [&dir, &dir.join("pipe"), &dir.join("log")] {
            check_private_dir(d, &[own_uid().unwrap()]).unwrap();
        }
        std::fs::remove_dir_all(dir).unwrap();
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn missing_programs_are_not_found() {
        assert!(find_on_path("mkernel-no-such-program-here").is_none());
        assert!(find_on_path("sh").is_some());
    }
}

#[cfg(test)]
mod daemon_tests {
    use super::*;
    /// Without MPS (build hosts, CI) the error names the program and where it comes from; with
    /// it (GPU hosts) a daemon starts, answers, and is gone after `stop`.
    #[test]
    fn start_names_what_is_missing_or_stops_what_it_started() {
        match Mps::start() {
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains(CONTROL), "{e}");
            }
            Ok(mut mps) => {
                let pid = mps.daemon.as_ref().map(|d| d.id());
                mps.stop();
                if let Some(pid) = pid {
                    assert!(!Path::new(&format!("/proc/{pid}")).exists(), "daemon {pid} still runs");
                }
            }
        }
    }
}
