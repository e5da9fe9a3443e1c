//! Every kind of bad command stops the proxy with an error record that names the rank and the
//! slot sequence number, raises `abort`, and writes nothing.
mod common;
use common::{u64_at, Job, WAIT};
use mkernel_proxy::emulated::WireModel;
use mkernel_proxy::protocol::{CommandBody, NO_SEQ};
use mkernel_proxy::{ErrorCode, ProxyError};
use std::sync::atomic::Ordering;

const DATA: usize = 1024;
const FLAGS: usize = 8;

/// Job of 2 nodes x 2 GPUs; rank 0 sends two good puts to rank 2 (seq 0 and 1, epoch 5),
/// then `bad` (seq 2). Returns the error `join` gave.
fn run_bad(bad: impl FnOnce(&Job) -> CommandBody, raw_overrun: bool) -> (Job, ProxyError) {
    let mut job = Job::new(2, 2, 8, DATA, FLAGS, WireModel::unlimited());
    let p = job.producer(0);
    job.fabric.write(0, 0, &[0xab; 16]).unwrap();
    p.push(&CommandBody::put(2, 0, 0, 8, 0, 1, 5)).unwrap();
    p.push(&CommandBody::put(2, 8, 8, 8, 8, 1, 5)).unwrap();
    assert!(job.fabric.wait_flag(2, 8, 1, WAIT));
    if raw_overrun {
        // A producer that ignored backpressure: commit word of the next lap in slot 2.
        job.ranks[0].fifo.slot_header(2).store(2 + 8 + 1, Ordering::Release);
    } else {
        let c = bad(&job);
        p.push(&c).unwrap();
    }
    let err = job.take_proxy(0).join().unwrap_err();
    (job, err)
}

fn check(job: &Job, err: &ProxyError, code: ErrorCode) {
    match err {
        ProxyError::BadCommand { rank, seq, violation } => {
            assert_eq!((*rank, *seq, violation.code), (0, 2, code), "{err}");
        }
        e => panic!("expected BadCommand, got {e}"),
    }
    let fifo = &job.ranks[0].fifo;
    assert_eq!(fifo.abort_code(), code as u32);
    let rec = fifo.error_record().unwrap();
    assert_eq!((rec.code, rec.rank, rec.seq), (code as u32, 0, 2));
    assert!(!rec.message().is_empty());
    println!(
        "{code:?}: record says rank {} seq {}: {}",
        rec.rank,
        rec.seq,
        rec.message()
    );
    // Nothing but the two good puts landed anywhere.
    for r in 0..4 {
        for f in 0..FLAGS as u64 {
            let expect = if r == 2 && f < 2 { 1 } else { 0 };
            assert_eq!(job.fabric.flag(r, f * 8), expect, "rank {r} flag {f}");
        }
        let data = job.fabric.read(r, 0, DATA).unwrap();
        let nonzero: Vec<usize> = data
            .iter()
            .enumerate()
            .filter(|(_, b)| **b != 0)
            .map(|(i, _)| i)
            .collect();
        let expect: Vec<usize> = if r == 0 || r == 2 { (0..16).collect() } else { vec![] };
        assert_eq!(nonzero, expect, "rank {r} data");
    }
    assert_eq!(u64_at(&job.fabric, 2, 0), u64::from_le_bytes([0xab; 8]));
    // The device side sees the abort.
    assert!(
        matches!(job.producer(0).push(&CommandBody::nop(9)), Err(ProxyError::Aborted { code: c, seq: 2, .. }) if c == code as u32)
    );
}

#[test]
fn each_bad_command_kind() {
    let cases: Vec<(ErrorCode, CommandBody)> = vec![
        (
            ErrorCode::BadOpcode,
            CommandBody {
                opcode: 77,
                ..CommandBody::nop(5)
            },
        ),
        (ErrorCode::RankOutOfRange, CommandBody::put(4, 0, 0, 8, 0, 1, 5)),
        (ErrorCode::RankOutOfRange, CommandBody::put(u32::MAX, 0, 0, 8, 0, 1, 5)),
        (ErrorCode::NotRemotePeer, CommandBody::put(0, 0, 0, 8, 0, 1, 5)),
        (ErrorCode::NotRemotePeer, CommandBody::signal(1, 0, 1, 5)),
        (
            ErrorCode::SrcOutOfRange,
            CommandBody::put(2, DATA as u64 - 4, 0, 8, 0, 1, 5),
        ),
        (
            ErrorCode::SrcOutOfRange,
            CommandBody::put(2, u64::MAX - 2, 0, 8, 0, 1, 5),
        ),
        (
            ErrorCode::DstOutOfRange,
            CommandBody::put(3, 0, DATA as u64, 1, 0, 1, 5),
        ),
        (ErrorCode::DstOutOfRange, CommandBody::put(3, 0, u64::MAX, 2, 0, 1, 5)),
        (ErrorCode::BadFlagOffset, CommandBody::put(2, 0, 0, 8, 12, 1, 5)),
        (ErrorCode::BadFlagOffset, CommandBody::signal(3, FLAGS as u64 * 8, 1, 5)),
        (ErrorCode::BadFlagOffset, CommandBody::signal(3, u64::MAX - 7, 1, 5)),
        (ErrorCode::EpochRegressed, CommandBody::put(2, 0, 0, 8, 0, 2, 4)),
        (
            ErrorCode::BadFields,
            CommandBody {
                flags: 0x10,
                ..CommandBody::put(2, 0, 0, 8, 0, 2, 5)
            },
        ),
        (
            ErrorCode::BadFields,
            CommandBody {
                bytes: 8,
                ..CommandBody::signal(2, 0, 2, 5)
            },
        ),
        (ErrorCode::ZeroFlagValue, CommandBody::put(2, 0, 0, 8, 0, 0, 5)),
    ];
    for (code, cmd) in cases {
        let (job, err) = run_bad(|_| cmd, false);
        check(&job, &err, code);
    }
    let (job, err) = run_bad(|_| CommandBody::nop(0), true);
    check(&job, &err, ErrorCode::SlotOverrun);
}

/// The host can abort (e.g. another rank failed): the proxy stops with `Aborted` and the record
/// the host wrote; producers see the abort.
#[test]
fn host_abort_stops_the_proxy() {
    let mut job = Job::new(2, 1, 8, 64, 1, WireModel::unlimited());
    let fifo = job.ranks[0].fifo.clone();
    assert!(fifo.raise_abort(ErrorCode::HostAbort, 0, NO_SEQ, "rank 1 exited"));
    match job.take_proxy(0).join().unwrap_err() {
        ProxyError::Aborted {
            rank, code, message, ..
        } => assert_eq!(
            (rank, code, message.as_str()),
            (0, ErrorCode::HostAbort as u32, "rank 1 exited")
        ),
        e => panic!("{e}"),
    }
    assert!(job.producer(0).push(&CommandBody::nop(0)).is_err());
}
