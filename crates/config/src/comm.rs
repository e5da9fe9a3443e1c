//! Layouts shared by the device communication layer and the host: the symmetric heap's flag
//! area, the device error record, role splits of persistent kernels, and the per-rank descriptor.
//!
//! Protocol (docs/protocol.md): every rank's symmetric heap starts with a control area of
//! `u64` flags. A flag is written only by its *source* rank (a remote `st.release.sys` over
//! NVLink into the destination's heap) and read only by its destination (a local
//! `ld.acquire.sys`). Flags carry epochs: per-CTA launch counters that only grow, so nothing is
//! reset between launches and a captured CUDA graph replays correctly.

/// Most ranks in one NVLink domain.
pub const MAX_LOCAL_RANKS: u32 = 8;
/// Most CTAs of a communication kernel (one flag per CTA per source per slot).
pub const MAX_COMM_CTAS: u32 = 256;

/// Flag slots: what a flag means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum FlagSlot {
    /// "I (source) entered epoch e: my inputs are final and my outputs may be overwritten."
    Ready = 0,
    /// "I (source) am finished with epoch e: my data is in your buffer and I no longer read
    /// yours (or, on the staged and LL paths, I consumed what you staged in my heap)."
    Done = 1,
    /// "My data of epoch e is in your staging area" (bulk staged path).
    Staged = 2,
    /// AllGather+GEMM: chunk arrival, `(Tile0, src, chunk)` = launch epoch. Epoch-valued only:
    /// never shared with a counter (a counter left at 32 would pass a wait for epoch 5).
    Tile0 = 3,
    /// GEMM+ReduceScatter/AllReduce: `(Tile1, src, row tile)` counts src's partial tiles stored
    /// here; zeroed by the receiver before it raises `FusedReady`, after which alone senders add
    /// to them. AllGather+GEMM across nodes: `(Tile1, own rank, chunk)` = launch epoch once a
    /// comm CTA staged the own chunk for the proxy (a value the zeroing can only lower).
    Tile1 = 4,
    /// Fused kernels' buffer handshake (`(FusedReady, src, 0)` = launch epoch): kept apart from
    /// the collectives' `Ready`, whose CTA-0 epochs follow another sequence. GEMM+ReduceScatter
    /// across nodes also uses `(FusedReady, own rank, 1)` locally: "the other nodes' sums of my
    /// rows have landed in this launch" (raised by CTA 0, waited for by the others).
    FusedReady = 5,
    /// GEMM+AllReduce: `(Tile2, src, row tile)` counts reduced tiles of src's chunk stored into
    /// this rank's output (zeroed like `Tile1`).
    Tile2 = 6,
    /// GEMM+ReduceScatter/AllReduce across nodes, local only: `(NodeSum, own rank, j)` counts
    /// the tiles of this rank's node block `j` that are stored (`j < nodes - 1`: the node's sum
    /// for the `j`-th other node, staged for one proxy PUT; `j = nodes - 1`: AllReduce's final
    /// rows, PUT to every remote rank). The tile that fills it posts the PUT. Zeroed at the end
    /// of each launch only (its first adds need no handshake, so a start-of-launch zeroing
    /// could erase them).
    NodeSum = 7,
    /// GEMM+ReduceScatter/AllReduce, local only: `(Outbox, d, row tile)` counts this rank's half
    /// tiles of that row tile stored for local rank `d` (in the outbox, which the comm CTAs copy
    /// on once it is full; or straight into d's buffer, which a relay warp then announces at d;
    /// `d` = own rank: AllReduce's reduced rows). Zeroed at the end of each launch only, like
    /// `NodeSum`.
    Outbox = 8,
    /// GEMM+ReduceScatter/AllReduce stream-K tail, local only: `(StreamK, wg, cta)` = launch
    /// epoch once compute CTA `cta`'s consumer warpgroup `wg` wrote its contributor partial to
    /// the workspace (`GemmRsArgs::sk_ws`). Epoch-valued only.
    StreamK = 9,
    /// Ring attention: `(RingData, src, comm CTA k)` = ring step value `(e - 1) W + t + 1` (`e`
    /// the ring launch epoch, `W` the local ranks) once src's comm CTA `k` stored its slice of
    /// the K/V shard of step `t` into this rank's receive slot `t % 2` (docs/attention.md).
    RingData = 10,
    /// Ring attention: `(RingFree, src, cta)` = the step value of the last step whose receive
    /// slot src's CTA `cta` (compute or comm) no longer reads; src is this rank's right
    /// neighbour, the rank this one writes into.
    RingFree = 11,
}

impl FlagSlot {
    /// The slot with number `v`, if any.
    pub const fn from_u32(v: u32) -> Option<FlagSlot> {
        match v {
            0 => Some(FlagSlot::Ready),
            1 => Some(FlagSlot::Done),
            2 => Some(FlagSlot::Staged),
            3 => Some(FlagSlot::Tile0),
            4 => Some(FlagSlot::Tile1),
            5 => Some(FlagSlot::FusedReady),
            6 => Some(FlagSlot::Tile2),
            7 => Some(FlagSlot::NodeSum),
            8 => Some(FlagSlot::Outbox),
            9 => Some(FlagSlot::StreamK),
            10 => Some(FlagSlot::RingData),
            11 => Some(FlagSlot::RingFree),
            _ => None,
        }
    }
}

/// Number of flag slots.
pub const FLAG_SLOTS: u32 = 12;
/// The epoch counter of latency probes: the last CTA slot, which collectives never use (they
/// launch at most `MAX_COMM_CTAS - 1` CTAs).
pub const PROBE_COUNTER: u32 = MAX_COMM_CTAS - 1;
/// Per-CTA epoch counters follow the flags (one `u64` per CTA, local use only).
pub const EPOCH_COUNTERS_OFFSET: u64 = (FLAG_SLOTS * MAX_LOCAL_RANKS * MAX_COMM_CTAS) as u64 * 8;
/// The rank's [`ErrorRecord`] follows the epoch counters (local use; the host reads it back).
pub const ERROR_RECORD_OFFSET: u64 = EPOCH_COUNTERS_OFFSET + MAX_COMM_CTAS as u64 * 8;
/// The rank's abort word (`u32`): nonzero makes every wait of the rank give up at once. Its
/// value says who raised it ([`abort_word`]).
pub const ABORT_OFFSET: u64 = ERROR_RECORD_OFFSET + 64;

/// How often a polling wait reads the host abort word (`CommDesc::host_abort`, a load across
/// PCIe): at the first clock check (after 64 polls) and then every this many polls. The heap's
/// abort word (GPU memory) is read at every clock check.
pub const HOST_ABORT_POLLS: u32 = 1024;
/// Launches of a CTA (its epoch a multiple of this) after which one thread reads the host abort
/// word at the launch's end, so that an abort also reaches launches whose waits never stall.
pub const HOST_ABORT_LAUNCHES: u64 = 16;

/// Values of the abort word (at [`ABORT_OFFSET`]): 0 while running; otherwise why the rank stops.
pub mod abort_word {
    /// A wait of this rank timed out (its error record says which).
    pub const TIMED_OUT: u32 = 1;
    /// This rank's proxy failed (the proxy's own error record says why).
    pub const PROXY_FAILED: u32 = 2;
    /// `BY_HOST | g`: `Communicator::abort` of global rank `g` (raised at every rank it reaches).
    pub const BY_HOST: u32 = 1 << 31;
    /// The abort word `Communicator::abort` of global rank `g` writes.
    pub const fn by_host(g: u32) -> u32 {
        BY_HOST | g
    }
    /// The global rank whose host aborted, if `word` was written by `Communicator::abort`.
    pub const fn host_rank(word: u32) -> Option<u32> {
        if word & BY_HOST != 0 {
            Some(word & !BY_HOST)
        } else {
            None
        }
    }
}
/// Most ranks in a job (all nodes).
pub const MAX_RANKS: u32 = 64;
/// Inter-node flags `[RemoteSlot][source global rank]` (u64 epochs), written by the *proxy*
/// (emulated wire: the sender's proxy; RC: the sender's NIC; EFA: the receiver's proxy).
pub const REMOTE_FLAGS_OFFSET: u64 = ABORT_OFFSET + 64;
/// What an inter-node flag means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum RemoteSlot {
    /// "I (source) entered epoch e: you may write into my buffers."
    Ready = 0,
    /// "My data of epoch e has landed in your buffer."
    Data = 1,
    /// Latency probes (`mk_proxy_pingpong`): values `epoch << 12 | i`, kept apart from `Data`.
    Probe = 2,
    /// Fused kernels (their own launch epochs, kept apart from the collectives'): "my buffer
    /// for your rows is free in fused epoch e".
    FusedReady = 3,
    /// Fused kernels: "my data of fused epoch e has landed in your buffer" (AllGather+GEMM: my
    /// shard; GEMM+ReduceScatter/AllReduce: my node's sum of your rows).
    FusedData = 4,
    /// GEMM+AllReduce across nodes: "my reduced rows of fused epoch e have landed in your output".
    FusedOut = 5,
    /// Ring attention across nodes: "the K/V shard of ring step t is in your receive slot
    /// `t % 2`"; value the step value `(e - 1) W + t + 1` (`e` the ring launch epoch, `W` the
    /// ranks of the job), raised by the PUT that carries the shard (docs/attention.md).
    RingData = 6,
    /// Ring attention across nodes: "every CTA of mine finished ring step t: my receive slot
    /// `t % 2` may be overwritten"; value the step value of t, raised by a SIGNAL.
    RingFree = 7,
}
/// Number of [`RemoteSlot`]s.
pub const REMOTE_SLOTS: u32 = 8;
/// Byte offset of inter-node flag (`slot`, `src` global rank) in a heap.
pub const fn remote_flag_offset(slot: RemoteSlot, src: u32) -> u64 {
    REMOTE_FLAGS_OFFSET + ((slot as u32 * MAX_RANKS + src) as u64) * 8
}
/// The device-side head of this rank's proxy FIFO (a u64 claimed with `atom.add`).
pub const FIFO_HEAD_OFFSET: u64 = REMOTE_FLAGS_OFFSET + REMOTE_SLOTS as u64 * MAX_RANKS as u64 * 8;

/// Launch epoch of the fused kernels (u64): every CTA reads it at start; the last CTA to exit
/// (counted at [`FUSED_EXITS_OFFSET`]) advances it, so all CTAs of a launch agree on it. The MoE
/// expert-parallel layer takes its launch epochs from it too (its routing kernel advances it).
pub const FUSED_EPOCH_OFFSET: u64 = FIFO_HEAD_OFFSET + 8;
/// CTAs of the current fused launch that have exited (u32).
pub const FUSED_EXITS_OFFSET: u64 = FUSED_EPOCH_OFFSET + 8;
/// Launch epoch of ring attention (u64), kept apart from the fused kernels' so that its step
/// values `(e - 1) W + t + 1` follow one launch after another without gaps: every CTA reads it
/// at start; the last warp to exit (counted at [`RING_EXITS_OFFSET`]) advances it.
pub const RING_EPOCH_OFFSET: u64 = FUSED_EXITS_OFFSET + 8;
/// Warps of the current ring-attention launch that have exited (u32).
pub const RING_EXITS_OFFSET: u64 = RING_EPOCH_OFFSET + 8;
/// Ring attention across nodes, on a rank whose left neighbour is on another node: two u64
/// counters (ring step parity) of the CTAs that finished a step; comm CTA 0 waits until a
/// step's counter holds every CTA, resets it and posts the `RemoteSlot::RingFree` SIGNAL to the
/// left neighbour.
pub const RING_FREE_COUNT_OFFSET: u64 = RING_EXITS_OFFSET + 8;
/// GEMM+ReduceScatter/AllReduce's per-CTA marks (diagnostics only; nothing waits on them): u64
/// `[2][MAX_COMM_CTAS]`, entry `b` written by thread 0 of CTA `b` when it starts a launch, exit
/// `b` by the CTA's last warp when it leaves, each [`cta_mark`]`(epoch, SM)`. A peer that timed
/// out reads them through its mapping (`Communicator::fused_snapshot`): which CTAs of a silent
/// rank's launch started, on which SMs, and which are still inside.
pub const FUSED_CTA_MARKS_OFFSET: u64 = RING_FREE_COUNT_OFFSET + 16;
/// Bytes of [`FUSED_CTA_MARKS_OFFSET`]'s area.
pub const FUSED_CTA_MARKS_BYTES: u64 = 2 * MAX_COMM_CTAS as u64 * 8;

/// A CTA mark ([`FUSED_CTA_MARKS_OFFSET`]): the launch epoch (low 48 bits) and the SM (`%smid`,
/// high 16 bits).
pub const fn cta_mark(epoch: u64, sm: u32) -> u64 {
    (epoch & ((1 << 48) - 1)) | ((sm as u64 & 0xffff) << 48)
}

/// The `(epoch, SM)` of a [`cta_mark`] (epoch 0: never written).
pub const fn cta_mark_parts(mark: u64) -> (u64, u32) {
    (mark & ((1 << 48) - 1), (mark >> 48) as u32)
}

/// Bytes of the heap's control area (flags, epoch counters, error record, abort, inter-node
/// flags, FIFO head, fused epoch and exits, CTA marks), rounded to 64 KiB. The LL and staging
/// areas follow, then user buffers.
pub const HEAP_CONTROL_BYTES: u64 = (FUSED_CTA_MARKS_OFFSET + FUSED_CTA_MARKS_BYTES).div_ceil(65536) * 65536;

/// The proxy command FIFO's wire format (defined in [`crate::fifo`]; this path is kept for the
/// kernels that name `comm::fifo::EPOCH_SEQ_*`).
pub use crate::fifo;

/// CTAs that carry the LL and staged paths. Every collective launch has at least this many
/// CTAs, so CTAs `0..STAGED_CTAS` advance their epochs in lockstep: in every launch they share
/// one epoch, and the staging credit can check all of them (a later launch may slice the slot
/// differently, so one CTA's credit alone would not cover the words it is about to overwrite).
pub const STAGED_CTAS: u32 = 4;
/// Largest message a rank sends one peer on the staged (one-hop, no handshake) path.
pub const SMALL_MSG_MAX: u64 = 256 << 10;
/// Largest message a rank sends one peer on the LL path (data + flag words: twice the bytes).
pub const LL_MSG_MAX: u64 = 64 << 10;

/// LL area: 2 epoch parities x one slot per source rank of `2 * LL_MSG_MAX` bytes. It has its
/// own area (never shared with bulk staging, whose raw data could look like a valid flag) and
/// is zeroed with the control area, so no stale word can carry a live epoch.
pub const LL_OFFSET: u64 = HEAP_CONTROL_BYTES;
/// Bytes of one LL slot.
pub const LL_SLOT_BYTES: u64 = 2 * LL_MSG_MAX;
/// Bytes of the LL area.
pub const LL_BYTES: u64 = 2 * MAX_LOCAL_RANKS as u64 * LL_SLOT_BYTES;
/// Bulk staging area: 2 epoch parities x one slot per source rank of [`SMALL_MSG_MAX`] bytes.
pub const STAGING_OFFSET: u64 = LL_OFFSET + LL_BYTES;
/// Bytes of the staging area.
pub const STAGING_BYTES: u64 = 2 * MAX_LOCAL_RANKS as u64 * SMALL_MSG_MAX;
/// Bytes the host zeroes when a communicator is created (control + LL areas).
pub const HEAP_ZEROED_BYTES: u64 = STAGING_OFFSET;
/// Bytes of every heap reserved by mkernel (control + LL + staging); user buffers follow.
pub const HEAP_RESERVED_BYTES: u64 = STAGING_OFFSET + STAGING_BYTES;

/// Offset of the bulk staging slot that `src` writes into (in the receiver's heap) in `epoch`.
pub const fn staging_offset(epoch: u64, src: u32) -> u64 {
    STAGING_OFFSET + ((epoch % 2) * MAX_LOCAL_RANKS as u64 + src as u64) * SMALL_MSG_MAX
}
/// Offset of the LL slot that `src` writes into (in the receiver's heap) in `epoch`.
pub const fn ll_offset(epoch: u64, src: u32) -> u64 {
    LL_OFFSET + ((epoch % 2) * MAX_LOCAL_RANKS as u64 + src as u64) * LL_SLOT_BYTES
}

/// Byte offset of flag (`slot`, `src` rank, `cta`) in a heap.
pub const fn flag_offset(slot: FlagSlot, src: u32, cta: u32) -> u64 {
    (((slot as u32 * MAX_LOCAL_RANKS + src) * MAX_COMM_CTAS + cta) as u64) * 8
}

/// What a device-side wait reports when it gives up. Lives in the rank's own heap at
/// [`ERROR_RECORD_OFFSET`]; the first failing thread of the rank claims it (`code` from 0 by
/// compare-and-swap), fills the rest, then raises the abort word so the other waiters stop at once.
/// The host reads it after the stream synchronizes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct ErrorRecord {
    /// 0 = no error; see [`ErrorCode`].
    pub code: u32,
    /// Rank that stalled (the waiter).
    pub rank: u32,
    /// Role of the waiting CTA ([`Role`] as u32).
    pub role: u32,
    /// Flag slot waited on ([`FlagSlot`] as u32).
    pub slot: u32,
    /// The rank whose flag never arrived.
    pub peer: u32,
    /// CTA index of the waiter.
    pub cta: u32,
    /// Epoch expected.
    pub expected: u64,
    /// Value last seen.
    pub seen: u64,
    /// Nanoseconds waited.
    pub waited_ns: u64,
    /// [`ErrorCode::Aborted`]: the abort word the wait saw ([`abort_word`]); 0 otherwise.
    pub abort_word: u32,
    pub _pad: u32,
}

/// What a stalled wait waited for, as written into [`ErrorRecord::slot`]: a [`FlagSlot`]
/// (0..FLAG_SLOTS) or one of the inter-node waits below.
pub mod wait_code {
    /// An inter-node `Ready` flag.
    pub const REMOTE_READY: u32 = 16;
    /// An inter-node `Data` (or probe) flag.
    pub const REMOTE_DATA: u32 = 17;
    /// Space in the proxy FIFO.
    pub const FIFO_SPACE: u32 = 18;
    /// The proxy's completion watermark (`done`).
    pub const FIFO_DONE: u32 = 19;
    /// A GEMM ring slot's `full` mbarrier (the producer's TMA loads), awaited by a consumer
    /// warpgroup; `peer` is the waiting warpgroup.
    pub const RING_FULL: u32 = 20;
    /// A GEMM ring slot's `empty` mbarrier (the consumers' release), awaited by the producer;
    /// `peer` is the waiting warpgroup (0).
    pub const RING_EMPTY: u32 = 21;
    /// A consumer warpgroup's staging handshake with its stager or its own staged TMA load
    /// (`aux` mbarriers of GEMM+ReduceScatter/AllReduce); `peer` is the mbarrier's index.
    pub const STAGING: u32 = 22;
    /// A stager's wait for its consumers' ring progress (the shared-memory tick count).
    pub const RING_TICK: u32 = 23;
    /// The consumers' wait for warp 3's "the other nodes' sums landed" (`aux(0)`).
    pub const NODE_SUMS: u32 = 24;
    /// Ring attention across nodes: the inter-node `RingData` flag (a K/V shard landed).
    pub const REMOTE_RING_DATA: u32 = 25;
    /// Ring attention across nodes: the inter-node `RingFree` flag (the right neighbour's
    /// receive slot is free).
    pub const REMOTE_RING_FREE: u32 = 26;
    /// Expert-parallel MoE flags (`mkernel_config::ops::moe::EpFlag`): this code + the flag
    /// (4 codes).
    pub const MOE_EP: u32 = 32;
}

/// Error codes of [`ErrorRecord`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    None = 0,
    /// A flag did not reach the expected epoch in time.
    Timeout = 1,
    /// A wait saw the rank's abort word raised (by `Communicator::abort` of the rank in
    /// [`ErrorRecord::abort_word`], or by the rank's proxy failing) and gave up.
    Aborted = 2,
}

/// Roles a CTA of a persistent kernel can take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Role {
    /// Tensor-core math (GEMM / attention tiles).
    Compute = 0,
    /// NVLink traffic inside the node.
    IntraComm = 1,
    /// Posting inter-node sends to the proxy.
    InterSend = 2,
    /// Reducing data that arrived from other nodes.
    InterReduce = 3,
    /// GEMM+ReduceScatter/AllReduce's relay warp of a compute CTA (raises the peers' flags of
    /// finished row tiles); not a grid range of its own.
    Relay = 4,
    /// GEMM+ReduceScatter/AllReduce's stager thread of a compute CTA (issues a consumer
    /// warpgroup's epilogue bulk stores and partial loads); not a grid range of its own.
    Stager = 5,
}

impl Role {
    /// Name for error messages.
    pub const fn name(v: u32) -> &'static str {
        match v {
            0 => "compute",
            1 => "intra-node comm",
            2 => "inter-node send",
            3 => "inter-node reduce",
            4 => "relay",
            5 => "stager",
            _ => "unknown",
        }
    }
}

/// Split of a grid into contiguous role ranges, in the order compute, intra, send, reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct RoleSplit {
    pub compute: u32,
    pub intra_comm: u32,
    pub inter_send: u32,
    pub inter_reduce: u32,
}

impl RoleSplit {
    /// CTAs in the grid.
    pub const fn grid(&self) -> u32 {
        self.compute + self.intra_comm + self.inter_send + self.inter_reduce
    }
    /// Role of CTA `block` and its index among the CTAs of that role.
    pub const fn role_of(&self, block: u32) -> (Role, u32) {
        if block < self.compute {
            (Role::Compute, block)
        } else if block < self.compute + self.intra_comm {
            (Role::IntraComm, block - self.compute)
        } else if block < self.compute + self.intra_comm + self.inter_send {
            (Role::InterSend, block - self.compute - self.intra_comm)
        } else {
            (
                Role::InterReduce,
                block - self.compute - self.intra_comm - self.inter_send,
            )
        }
    }
}

/// Per-rank descriptor the communication kernels read (device memory, written once by the host).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "bytemuck", derive(bytemuck::Pod, bytemuck::Zeroable))]
#[repr(C)]
pub struct CommDesc {
    /// This rank within the NVLink domain.
    pub rank: u32,
    /// Ranks in the NVLink domain.
    pub world: u32,
    /// Timeout of every device-side wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Base address of every rank's heap as mapped in this process (index = rank).
    pub heaps: [u64; MAX_LOCAL_RANKS as usize],
    /// This rank in the whole job.
    pub global_rank: u32,
    /// Ranks in the whole job (`nnodes * world`).
    pub global_world: u32,
    /// Device address of the host-mapped proxy FIFO (0 on a single node).
    pub fifo: u64,
    /// Slots of the FIFO (a power of two).
    pub fifo_capacity: u32,
    pub _pad: u32,
    /// Device address of this rank's host abort word (a `u32` in host memory shared by the
    /// node's processes and mapped for this GPU; 0: none): `Communicator::abort` stores into it
    /// from the CPU, and the waits read it now and then ([`HOST_ABORT_POLLS`]) and copy it into
    /// the heap's abort word ([`ABORT_OFFSET`]).
    pub host_abort: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    #[allow(clippy::assertions_on_constants)] // the layout invariants, checked once more at run time
    fn flags_do_not_overlap_and_fit_the_control_area() {
        // Every slot's last flag ends inside the flag area, and every slot number is known.
        for v in 0..FLAG_SLOTS {
            let slot = FlagSlot::from_u32(v).expect("slots 0..FLAG_SLOTS are defined");
            let last = flag_offset(slot, MAX_LOCAL_RANKS - 1, MAX_COMM_CTAS - 1);
            assert!(last + 8 <= EPOCH_COUNTERS_OFFSET, "slot {slot:?}");
        }
        assert!(FlagSlot::from_u32(FLAG_SLOTS).is_none());
        assert!(EPOCH_COUNTERS_OFFSET + MAX_COMM_CTAS as u64 * 8 <= ERROR_RECORD_OFFSET);
        assert!(core::mem::size_of::<ErrorRecord>() <= 64);
        assert!(ABORT_OFFSET + 8 <= HEAP_CONTROL_BYTES);
        assert!(FIFO_HEAD_OFFSET + 8 <= HEAP_CONTROL_BYTES);
        // The CTA marks fit the 256 KiB the control area had before them.
        assert!(FUSED_CTA_MARKS_OFFSET >= RING_FREE_COUNT_OFFSET + 16);
        assert_eq!(FUSED_CTA_MARKS_OFFSET % 8, 0);
        assert_eq!(HEAP_CONTROL_BYTES, 256 << 10);
        assert_eq!(cta_mark_parts(cta_mark(12345, 131)), (12345, 131));
        assert_eq!(cta_mark_parts(cta_mark((1 << 48) + 7, 0x1_0002)), (7, 2));
        assert_eq!(
            remote_flag_offset(RemoteSlot::RingFree, MAX_RANKS - 1) + 8,
            FIFO_HEAD_OFFSET
        );
        assert_eq!(ll_offset(3, MAX_LOCAL_RANKS - 1) + LL_SLOT_BYTES, STAGING_OFFSET);
        assert_eq!(
            staging_offset(3, MAX_LOCAL_RANKS - 1) + SMALL_MSG_MAX,
            HEAP_RESERVED_BYTES
        );
        assert_eq!(staging_offset(2, 0), STAGING_OFFSET);
        assert_eq!(flag_offset(FlagSlot::Ready, 0, 1), 8);
        assert_eq!(flag_offset(FlagSlot::Ready, 1, 0), MAX_COMM_CTAS as u64 * 8);
    }
    #[test]
    fn role_split_assigns_contiguous_ranges() {
        let s = RoleSplit {
            compute: 118,
            intra_comm: 6,
            inter_send: 0,
            inter_reduce: 8,
        };
        assert_eq!(s.grid(), 132);
        assert_eq!(s.role_of(0), (Role::Compute, 0));
        assert_eq!(s.role_of(118), (Role::IntraComm, 0));
        assert_eq!(s.role_of(124), (Role::InterReduce, 0));
        assert_eq!(s.role_of(131), (Role::InterReduce, 7));
    }
}
