//! Real processes, as `cargo xtask launch -n 4 --nodes 2` starts them: this test binary runs
//! itself four times with the launcher's variables; each child bootstraps, shares a memfd with
//! its local peer, writes through the peer's descriptor and reads its own.
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mkernel_bootstrap::Bootstrap;

const CHILD: &str = "MKBS_TEST_CHILD";
const T: Duration = Duration::from_secs(20);

fn memfd(name: &str) -> File {
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: `name` is a valid C string; a non-negative result is a new descriptor.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: the descriptor is new and owned by nobody else.
    File::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The body of one rank; runs only inside a child.
#[test]
fn child_rank() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let mut boot = Bootstrap::from_env(T).unwrap();
    let (rank, local, lws) = (
        boot.info().rank(),
        boot.info().local_rank(),
        boot.info().local_world_size(),
    );
    let mut mine = memfd("mkbs-test");
    mine.write_all(format!("rank{rank}").as_bytes()).unwrap();
    mine.set_len(64).unwrap();

    let all = boot.exchange_fds(&[mine.as_fd()], T).unwrap();
    assert_eq!(all.len(), lws);
    for (peer_local, fds) in all.into_iter().enumerate() {
        // Descriptors passed over a socket share the file offset: use positioned I/O.
        let f = File::from(fds.into_iter().next().unwrap());
        let mut head = [0u8; 5];
        f.read_exact_at(&mut head, 0).unwrap();
        let owner = boot.info().node_rank() * lws + peer_local;
        assert_eq!(
            &head,
            format!("rank{owner}").as_bytes(),
            "rank {rank} reading local rank {peer_local}'s memfd"
        );
        // Mark it through the received descriptor.
        f.write_at(&[b'A' + local as u8], 32 + local as u64).unwrap();
    }
    boot.store().barrier("marked", T).unwrap();
    let mut marks = vec![0u8; lws];
    mine.read_exact_at(&mut marks, 32).unwrap();
    let want: Vec<u8> = (0..lws).map(|l| b'A' + l as u8).collect();
    assert_eq!(marks, want, "rank {rank}: every local peer wrote through its copy");

    let all = boot.store().all_gather("ranks", &[rank as u8], T).unwrap();
    assert_eq!(all, (0..4u8).map(|r| vec![r]).collect::<Vec<_>>());
    boot.store().barrier("end", T).unwrap();
    println!("child rank {rank} passed");
}

#[test]
fn four_processes_on_two_emulated_nodes() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut key = [0u8; 16];
    File::open("/dev/urandom").unwrap().read_exact(&mut key).unwrap();
    let key: String = key.iter().map(|b| format!("{b:02x}")).collect();
    let (n, nodes) = (4usize, 2usize);
    let local = n / nodes;
    let mut children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&exe)
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", (r % local).to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_WORLD_SIZE", local.to_string())
                .env("NODE_RANK", (r / local).to_string())
                .env("NNODES", nodes.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("MKERNEL_JOB_KEY", &key)
                .env("MKERNEL_DEVICE", r.to_string())
                .env("MKERNEL_EMULATED_NODES", nodes.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    let mut failures = vec![];
    for (r, child) in children.iter_mut().enumerate() {
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            if start.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut out = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut out);
        }
        if !status.is_some_and(|s| s.success()) || !out.contains(&format!("child rank {r} passed")) {
            failures.push(format!("rank {r} ({status:?}):\n{out}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
