//! Randomized checks of the host-side validation (`Validator`, `Regions`, `Topology`, the FIFO
//! consumer): over random job shapes, region sizes, offsets, lengths, ranks, opcodes, flag bits
//! and epochs, nothing panics, and every accepted command stays inside the regions it may
//! touch, as recomputed here independently (128-bit arithmetic, the routing rule written out).
use mkernel_config::comm::{HEAP_RESERVED_BYTES, MAX_RANKS, REMOTE_FLAGS_OFFSET, REMOTE_SLOTS};
use mkernel_proxy::protocol::{
    CommandBody, CMD_EPOCH_SEQ_MASK, CMD_EPOCH_SEQ_SHIFT, CMD_NO_FLAG, EPOCH_SEQS, OP_NOP, OP_PUT, OP_QUIT, OP_SIGNAL,
};
use mkernel_proxy::{Checked, Fifo, FifoConsumer, FifoProducer, HeapFifo, Regions, Topology, Validator};
use proptest::prelude::*;

/// The job and the regions the proxy of `rank` checks against, plus the model of them.
#[derive(Clone, Debug)]
struct Setup {
    nnodes: usize,
    local: usize,
    rank: usize,
    layout: Layout,
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    /// mkernel's heap of this many bytes.
    Heap(u64),
    /// CPU fabric: data `[0, data)`, flags `[0, flags)`.
    Flat { data: u64, flags: u64 },
}

/// Model of the regions: (local data, peer data, peer flags, flag column rule), as half-open
/// `u128` ranges.
struct Model {
    data: (u128, u128),
    flags: (u128, u128),
    columns: Option<u128>,
}

impl Setup {
    fn topology(&self) -> Topology {
        Topology::new(self.nnodes, self.local, self.rank).unwrap()
    }
    fn regions(&self) -> Regions {
        let t = self.topology();
        match self.layout {
            Layout::Heap(bytes) => Regions::heap(&t, bytes),
            Layout::Flat { data, flags } => Regions::symmetric(&t, data, flags),
        }
    }
    fn model(&self) -> Model {
        match self.layout {
            Layout::Heap(bytes) => {
                let start = HEAP_RESERVED_BYTES as u128;
                let flags = REMOTE_FLAGS_OFFSET as u128;
                Model {
                    data: (start, (bytes as u128).max(start)),
                    flags: (flags, flags + REMOTE_SLOTS as u128 * MAX_RANKS as u128 * 8),
                    columns: Some(MAX_RANKS as u128),
                }
            }
            Layout::Flat { data, flags } => Model {
                data: (0, data as u128),
                flags: (0, flags as u128),
                columns: None,
            },
        }
    }
    fn world(&self) -> usize {
        self.nnodes * self.local
    }
    /// The routing rule: a proxy peer is a rank of another node.
    fn is_proxy_peer(&self, r: u32) -> bool {
        (r as usize) < self.world() && r as usize / self.local != self.rank / self.local
    }
}

fn setup() -> impl Strategy<Value = Setup> {
    (1usize..=4, 1usize..=4).prop_flat_map(|(nnodes, local)| {
        let layout = prop_oneof![
            prop_oneof![
                Just(HEAP_RESERVED_BYTES),
                HEAP_RESERVED_BYTES..HEAP_RESERVED_BYTES + (1 << 24),
                0..HEAP_RESERVED_BYTES,
                Just(u64::MAX),
            ]
            .prop_map(Layout::Heap),
            (0u64..8192, 0u64..512).prop_map(|(data, flags)| Layout::Flat { data, flags }),
        ];
        (0..nnodes * local, layout).prop_map(move |(rank, layout)| Setup {
            nnodes,
            local,
            rank,
            layout,
        })
    })
}

/// Offsets near every boundary of both layouts, and anything.
fn offset() -> impl Strategy<Value = u64> {
    let edges = [
        0,
        8,
        REMOTE_FLAGS_OFFSET - 8,
        REMOTE_FLAGS_OFFSET,
        REMOTE_FLAGS_OFFSET + 8 * MAX_RANKS as u64,
        REMOTE_FLAGS_OFFSET + 8 * (REMOTE_SLOTS * MAX_RANKS) as u64,
        HEAP_RESERVED_BYTES - 8,
        HEAP_RESERVED_BYTES,
        HEAP_RESERVED_BYTES + 4096,
        u64::MAX - 7,
        u64::MAX,
    ];
    prop_oneof![
        prop::sample::select(edges.to_vec()),
        (prop::sample::select(edges.to_vec()), -64i64..64).prop_map(|(e, d)| e.wrapping_add_signed(d)),
        0u64..16384,
        any::<u64>(),
    ]
}

fn length() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(8),
        0u64..(1 << 20),
        Just(u64::MAX),
        any::<u64>()
    ]
}

/// Flag offsets: anywhere, or any word of either layout's flag region (every column).
fn flag_offset() -> impl Strategy<Value = u64> {
    prop_oneof![
        offset(),
        (0..(REMOTE_SLOTS * MAX_RANKS) as u64).prop_map(|w| REMOTE_FLAGS_OFFSET + 8 * w),
        (0u64..64).prop_map(|w| 8 * w),
    ]
}

fn command(world: usize) -> impl Strategy<Value = CommandBody> {
    let opcode = prop_oneof![4 => 0u16..4, 1 => any::<u16>()];
    let flags = prop_oneof![
        4 => (0u16..3, any::<bool>()).prop_map(|(s, nf)| (s << CMD_EPOCH_SEQ_SHIFT) | nf as u16),
        1 => any::<u16>(),
    ];
    let rank = prop_oneof![8 => 0u32..(world as u32 + 2), 1 => Just(u32::MAX), 1 => any::<u32>()];
    let value = prop_oneof![Just(0u64), Just(1), any::<u64>()];
    let epoch = prop_oneof![0u64..8, (1u64 << 32) - 4..(1u64 << 32) + 4, any::<u64>()];
    let fields = (
        opcode,
        flags,
        rank,
        offset(),
        offset(),
        length(),
        flag_offset(),
        value,
        epoch,
    );
    // Most commands keep the zero fields their opcode requires, so that the range and flag
    // checks behind the field checks get exercised too.
    (fields, 0u8..4).prop_map(
        |((opcode, flags, dst_rank, src_offset, dst_offset, bytes, flag_offset, flag_value, epoch), tidy)| {
            let mut c = CommandBody {
                opcode,
                flags,
                dst_rank,
                src_offset,
                dst_offset,
                bytes,
                flag_offset,
                flag_value,
                epoch,
            };
            if tidy > 0 {
                match c.opcode {
                    OP_SIGNAL => (c.src_offset, c.dst_offset, c.bytes, c.flags) = (0, 0, 0, c.flags & !CMD_NO_FLAG),
                    OP_NOP | OP_QUIT => {
                        c = CommandBody {
                            opcode,
                            flags: flags & CMD_EPOCH_SEQ_MASK,
                            epoch,
                            ..Default::default()
                        }
                    }
                    _ => {}
                }
            }
            c
        },
    )
}

fn inside(range: (u128, u128), offset: u64, bytes: u64) -> bool {
    let (o, b) = (offset as u128, bytes as u128);
    o >= range.0 && o + b <= range.1
}

fn flag_ok(s: &Setup, m: &Model, offset: u64, value: u64) -> bool {
    offset % 8 == 0
        && inside(m.flags, offset, 8)
        && value != 0
        && m.columns
            .is_none_or(|n| (offset as u128 - m.flags.0) / 8 % n == s.rank as u128)
}

/// Checks one accepted command against the model; `last` holds the accepted epochs.
fn accepted_is_legal(s: &Setup, m: &Model, c: &CommandBody, got: Checked, last: &mut [u64; EPOCH_SEQS]) {
    let seq = ((c.flags & CMD_EPOCH_SEQ_MASK) >> CMD_EPOCH_SEQ_SHIFT) as usize;
    assert!(seq < EPOCH_SEQS, "accepted epoch sequence {seq}: {c:?}");
    assert!(
        c.epoch >= last[seq],
        "accepted epoch {} after {}: {c:?}",
        c.epoch,
        last[seq]
    );
    last[seq] = c.epoch;
    assert_eq!(
        c.flags & !(CMD_NO_FLAG | CMD_EPOCH_SEQ_MASK),
        0,
        "unknown flags accepted: {c:?}"
    );
    match got {
        Checked::Put {
            dst,
            src_offset,
            dst_offset,
            bytes,
            flag,
        } => {
            assert_eq!(c.opcode, OP_PUT);
            assert!(s.is_proxy_peer(c.dst_rank) && dst == c.dst_rank as usize, "{c:?}");
            assert_eq!((src_offset, dst_offset, bytes), (c.src_offset, c.dst_offset, c.bytes));
            assert!(
                inside(m.data, src_offset, bytes),
                "source outside the data region: {c:?}"
            );
            assert!(
                inside(m.data, dst_offset, bytes),
                "destination outside the data region: {c:?}"
            );
            match flag {
                Some((o, v)) => {
                    assert_eq!(c.flags & CMD_NO_FLAG, 0);
                    assert!(flag_ok(s, m, o, v), "illegal flag of a PUT: {c:?}");
                }
                None => assert!(c.flags & CMD_NO_FLAG != 0 && c.flag_offset == 0 && c.flag_value == 0),
            }
        }
        Checked::Signal {
            dst,
            flag_offset,
            value,
        } => {
            assert_eq!(c.opcode, OP_SIGNAL);
            assert!(s.is_proxy_peer(c.dst_rank) && dst == c.dst_rank as usize, "{c:?}");
            assert_eq!(
                (c.src_offset, c.dst_offset, c.bytes, c.flags & CMD_NO_FLAG),
                (0, 0, 0, 0)
            );
            assert!(flag_ok(s, m, flag_offset, value), "illegal SIGNAL flag: {c:?}");
        }
        Checked::Nop | Checked::Quit => {
            assert!(c.opcode == OP_NOP || c.opcode == OP_QUIT);
            let bare = CommandBody {
                opcode: c.opcode,
                flags: c.flags,
                epoch: c.epoch,
                ..Default::default()
            };
            assert_eq!(*c, bare, "NOP/QUIT with fields accepted");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, max_global_rejects: 1 << 20, ..ProptestConfig::default() })]

    /// Random commands: never a panic, never an accepted out-of-range request.
    #[test]
    fn random_commands_are_refused_or_legal(
        s in setup(),
        cmds in prop::collection::vec(command(16), 1..24),
    ) {
        let mut v = Validator::new(s.regions());
        let m = s.model();
        let mut last = [0u64; EPOCH_SEQS];
        for c in &cmds {
            if let Ok(got) = v.check(c) {
                accepted_is_legal(&s, &m, c, got, &mut last);
            }
        }
    }

    /// Commands built to be legal are accepted (the checks are not stricter than the rules).
    #[test]
    fn legal_commands_are_accepted(
        s in setup(),
        picks in prop::collection::vec((any::<prop::sample::Index>(), any::<u64>(), any::<u64>(), any::<u64>(), 0u32..6, any::<bool>()), 1..16),
    ) {
        let m = s.model();
        let peers: Vec<u32> = (0..s.world() as u32).filter(|&r| s.is_proxy_peer(r)).collect();
        let flag_words = (m.flags.1 - m.flags.0) / 8;
        let data_len = m.data.1 - m.data.0;
        prop_assume!(!peers.is_empty() && flag_words > 0);
        let mut v = Validator::new(s.regions());
        for (k, (peer, a, b, c, slot, signal)) in picks.into_iter().enumerate() {
            let dst = peers[peer.index(peers.len())];
            // A flag word this rank may raise.
            let word = match m.columns {
                Some(n) => {
                    if (s.rank as u128) >= n.min(flag_words) { continue; }
                    (slot as u128 % (flag_words / n).max(1)) * n + s.rank as u128
                }
                None => a as u128 % flag_words,
            };
            let flag = (m.flags.0 + word * 8) as u64;
            let epoch = k as u64 + (1 << 32) - 3;
            let cmd = if signal {
                CommandBody::signal(dst, flag, epoch | 1, epoch)
            } else {
                let bytes = if data_len == 0 { 0 } else { (b as u128 % (data_len + 1)) as u64 };
                let room = data_len - bytes as u128;
                let src = (m.data.0 + c as u128 % (room + 1)) as u64;
                let dsto = (m.data.0 + a as u128 % (room + 1)) as u64;
                CommandBody::put(dst, src, dsto, bytes, flag, epoch | 1, epoch)
            };
            prop_assert!(v.check(&cmd).is_ok(), "refused a legal command {:?}: {:?}", cmd, v.check(&cmd));
        }
    }

    /// Garbage in the FIFO's slots (wrong commit words, random bodies): the consumer returns
    /// commands, nothing, or an error with `abort` raised; it never panics or hands out an
    /// illegal command.
    #[test]
    fn garbage_slots_never_panic_the_consumer(
        s in setup(),
        slots in prop::collection::vec((prop_oneof![Just(None), any::<u64>().prop_map(Some)], command(16)), 1..12),
    ) {
        let fifo = Fifo::new(HeapFifo::new(16, s.rank as u32).unwrap()).unwrap();
        let producer = FifoProducer::new(fifo.clone());
        let m = s.model();
        let mut last = [0u64; EPOCH_SEQS];
        let mut consumer = FifoConsumer::new(fifo.clone(), Validator::new(s.regions())).unwrap();
        for (header, body) in slots {
            let seq = consumer.next_seq();
            match header {
                // A well-behaved producer's commit.
                None => { producer.try_push(&body).ok(); }
                // A rogue commit word over a random body.
                Some(h) => {
                    // SAFETY: this thread plays the only producer; the consumer has not taken `seq`.
                    unsafe { fifo.write_body(seq, &body) };
                    fifo.slot_header(seq).store(h, std::sync::atomic::Ordering::Release);
                }
            }
            match consumer.poll() {
                Ok(Some((got_seq, got))) => {
                    prop_assert_eq!(got_seq, seq);
                    accepted_is_legal(&s, &m, &body, got, &mut last);
                }
                Ok(None) => {}
                Err(_) => {
                    prop_assert!(fifo.abort_code() != 0, "an error without abort");
                    break;
                }
            }
            consumer.publish();
        }
    }

    /// Topologies and heap regions of any size: construction refuses or succeeds, never panics.
    #[test]
    fn any_topology_and_heap_size(nnodes in 0usize..70, local in 0usize..70, rank in 0usize..5000, heap in any::<u64>()) {
        if let Ok(t) = Topology::new(nnodes, local, rank) {
            let r = Regions::heap(&t, heap);
            prop_assert_eq!(r.world_size(), nnodes * local);
            for q in 0..t.world_size() {
                prop_assert_eq!(r.peer(q).is_some(), q / local != rank / local);
            }
        }
    }
}
