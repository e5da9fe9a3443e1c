//! The xtask binary as a newcomer meets it: help with no arguments (every task named, the
//! target directory `cargo metadata` reports), one-line errors, and `launch`'s GPU check.
use std::path::Path;
use std::process::{Command, Output};

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");

/// Every task of `xtask/src/main.rs` (the help must name each one).
const TASKS: [&str; 8] = [
    "ptx",
    "test",
    "bundle",
    "bench",
    "tune",
    "gpu-tests",
    "sanitize",
    "launch",
];

/// The xtask binary, or `None` (after saying why) outside `cargo test`: a test binary copied
/// into a bundle runs on a host without cargo, where the binary is not at its build path.
fn xtask() -> Option<Command> {
    if std::env::var_os("CARGO").is_none() || !Path::new(XTASK).is_file() {
        eprintln!("SKIPPED: not run by cargo in the workspace (a bundled copy of this test has no xtask or cargo)");
        return None;
    }
    Some(Command::new(XTASK))
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn no_arguments_print_help_naming_every_task_and_the_target_dir() {
    let Some(mut cmd) = xtask() else { return };
    let dir = std::env::temp_dir().join(format!("mkernel-xtask-target-{}", std::process::id()));
    let out = cmd.env("CARGO_TARGET_DIR", &dir).output().unwrap();
    let help = text(&out);
    // clap's code for "arguments required": 2.
    assert_eq!(out.status.code(), Some(2), "{help}");
    let first = help.lines().next().unwrap_or_default();
    for task in TASKS {
        assert!(
            first.split([' ', ',']).any(|w| w == task),
            "the first help line does not name `{task}`: {first}"
        );
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(&format!("{task} "))),
            "no help entry for `{task}`:\n{help}"
        );
    }
    assert!(
        help.contains(&format!("Target directory: {}", dir.display())),
        "help does not show CARGO_TARGET_DIR:\n{help}"
    );
    assert!(!dir.exists(), "printing help created {}", dir.display());
}

#[test]
fn errors_are_one_line_without_backtrace() {
    let Some(mut cmd) = xtask() else { return };
    let out = cmd
        .args(["bundle", "--variant", "../x"])
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LIB_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: --variant \"../x\""), "{err}");
}

#[test]
fn launch_checks_for_gpus_before_starting_ranks() {
    let Some(mut cmd) = xtask() else { return };
    let dir = std::env::temp_dir().join(format!("mkernel-xtask-launch-{}", std::process::id()));
    let marker = dir.join("started");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let touch = format!("touch {}", marker.display());
    let has_driver = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success());
    if has_driver {
        // A GPU host: the launch names what it found.
        let out = cmd.args(["launch", "-n", "1", "--", "true"]).output().unwrap();
        assert!(text(&out).contains("launch: NVIDIA driver "), "{}", text(&out));
    } else {
        let out = cmd
            .args(["launch", "-n", "2", "--", "sh", "-c", &touch])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("NVIDIA driver") && err.contains("--cpu-only"), "{err}");
        assert!(!marker.exists(), "a rank started without a GPU");
        // Programs that need no GPU start with --cpu-only.
        let out = Command::new(XTASK)
            .args(["launch", "-n", "2", "--cpu-only", "--", "sh", "-c", &touch])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        assert!(marker.exists());
        // A benchmark says so too, before building anything.
        let out = Command::new(XTASK).args(["bench", "--op", "gemm"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.starts_with("error: bench: ") && err.contains("NVIDIA driver"),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
