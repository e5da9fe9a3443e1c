//! AllReduce: its four single-node paths, the policy that picks one by message size, and the
//! launches ([`Communicator::all_reduce`], [`Communicator::all_reduce_via`]).
//!
//! | path | kernel | needs | per rank over NVLink |
//! |---|---|---|---|
//! | [`AllReducePath::Ll`] | `mk_allreduce`, bytes <= `LL_MSG_MAX` | bytes a multiple of 16 | pushes `2 x bytes` (data + flag words) to every peer |
//! | [`AllReducePath::OneShot`] | `mk_allreduce_oneshot` | `src` and `dst` disjoint | pulls `bytes` from every peer |
//! | [`AllReducePath::TwoShot`] | `mk_allreduce_twoshot` | `src` and `dst` disjoint or equal | pulls and pushes `bytes / world` per peer |
//! | [`AllReducePath::Bandwidth`] | `mk_allreduce`, bytes > `LL_MSG_MAX` (staged, then direct above `SMALL_MSG_MAX`) | bytes a multiple of 16 | as two-shot, or staged copies |
//!
//! Across nodes every AllReduce takes [`AllReducePath::InterNode`] (the node's sum by
//! `mk_allreduce`, then the exchange of node sums through the proxy): one-shot and two-shot
//! read only this node's heaps, so they are single-node paths.
use super::{check_fits, Communicator, ReduceDtype, SymBuffer};
use crate::check;
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, PushKernelArg};
use mkernel_config::comm::LL_MSG_MAX;
use mkernel_config::kernels;
use std::sync::Arc;

/// Which kernel (and which of its paths) carries an AllReduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AllReducePath {
    /// `mk_allreduce`'s LL path: data and epoch flag in one 8-byte word, pushed into every
    /// peer's LL slot; one hop, no handshake.
    Ll,
    /// `mk_allreduce_oneshot`: every rank pulls every rank's buffer and sums it.
    OneShot,
    /// `mk_allreduce_twoshot`: reduce-scatter by pull, all-gather by push.
    TwoShot,
    /// `mk_allreduce` above `LL_MSG_MAX`: its staged path up to `SMALL_MSG_MAX`, its direct
    /// (two-shot, 16-byte vectors only) path beyond.
    Bandwidth,
    /// Across nodes: `mk_allreduce` into the node sum, then `mk_allreduce_internode`.
    InterNode,
}

impl AllReducePath {
    /// The single-node paths, in the order the benchmark prints them.
    pub const SINGLE_NODE: [AllReducePath; 4] = [
        AllReducePath::Ll,
        AllReducePath::OneShot,
        AllReducePath::TwoShot,
        AllReducePath::Bandwidth,
    ];

    /// Short name (benchmark columns, `--path`).
    pub const fn name(self) -> &'static str {
        match self {
            AllReducePath::Ll => "ll",
            AllReducePath::OneShot => "oneshot",
            AllReducePath::TwoShot => "twoshot",
            AllReducePath::Bandwidth => "bandwidth",
            AllReducePath::InterNode => "internode",
        }
    }

    /// The path named `name` ([`AllReducePath::name`]).
    pub fn from_name(name: &str) -> Option<AllReducePath> {
        [
            AllReducePath::Ll,
            AllReducePath::OneShot,
            AllReducePath::TwoShot,
            AllReducePath::Bandwidth,
            AllReducePath::InterNode,
        ]
        .into_iter()
        .find(|p| p.name() == name)
    }
}

/// How an AllReduce's destination lies against its source (same offsets on every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// No byte in common.
    Disjoint,
    /// The same bytes (in place).
    InPlace,
    /// Partly overlapping: no path computes a correct sum (a rank's store would race with
    /// another rank's or CTA's load of the same words), so it is refused.
    Partial,
}

impl Overlap {
    /// The overlap of `bytes` at offsets `src` and `dst`.
    pub fn of(src: u64, dst: u64, bytes: u64) -> Overlap {
        if src == dst {
            Overlap::InPlace
        } else if src.saturating_add(bytes) <= dst || dst.saturating_add(bytes) <= src {
            Overlap::Disjoint
        } else {
            Overlap::Partial
        }
    }
}

/// What the policy looks at: one AllReduce's bytes, buffers and nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllReduceMsg {
    /// Bytes of the buffer (`count x` element size).
    pub bytes: u64,
    pub overlap: Overlap,
    /// Nodes of the job.
    pub nodes: u32,
}

impl AllReduceMsg {
    /// Why `path` cannot carry this message (`None`: it can).
    pub fn unavailable(&self, path: AllReducePath) -> Option<String> {
        let whole = self.bytes % 16 == 0;
        let single = self.nodes == 1;
        let why = match path {
            _ if self.overlap == Overlap::Partial => "source and destination partly overlap".to_string(),
            AllReducePath::InterNode if single => "the inter-node path needs a job of several nodes".into(),
            AllReducePath::InterNode if !whole => format!("{} bytes are not a multiple of 16", self.bytes),
            AllReducePath::InterNode => return None,
            _ if !single => format!("the {} path reads only this node's heaps", path.name()),
            AllReducePath::Ll | AllReducePath::Bandwidth if !whole => {
                format!("{} bytes are not a multiple of 16", self.bytes)
            }
            AllReducePath::Ll if self.bytes > LL_MSG_MAX => {
                format!("{} bytes exceed LL_MSG_MAX ({LL_MSG_MAX})", self.bytes)
            }
            AllReducePath::Bandwidth if self.bytes <= LL_MSG_MAX => {
                format!("{} bytes go to mk_allreduce's LL path (<= {LL_MSG_MAX})", self.bytes)
            }
            AllReducePath::OneShot if self.overlap != Overlap::Disjoint => {
                "one-shot cannot run in place (a rank's store would race with its peers' loads)".into()
            }
            _ => return None,
        };
        Some(why)
    }
}

/// The size thresholds between the AllReduce paths ([`AllReducePolicy::choose`]).
///
/// PROVISIONAL: [`AllReducePolicy::PROVISIONAL`] is set from what each path moves (LL doubles
/// the bytes and suits the smallest messages; one-shot reads `(world - 1) x bytes` per rank in
/// one hop; two-shot moves `2 (world - 1) / world x bytes` in two), not from measurements on
/// several GPUs. `mkernel-bench --op allreduce --ar-paths all` prints every path at every size to
/// set them from data (issue 37).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllReducePolicy {
    /// Largest message (bytes, a multiple of 16) on the LL path; capped at `LL_MSG_MAX`.
    pub ll_max: u64,
    /// Largest message on the one-shot path (source and destination disjoint).
    pub one_shot_max: u64,
    /// Largest message (a multiple of 16) on the two-shot path; larger ones take the bandwidth
    /// path. Messages that are not a multiple of 16 bytes take two-shot at any size above
    /// one-shot's range.
    pub two_shot_max: u64,
}

impl AllReducePolicy {
    /// The thresholds until measurements on several GPUs replace them (see the type's docs).
    pub const PROVISIONAL: AllReducePolicy = AllReducePolicy {
        ll_max: 16 << 10,
        one_shot_max: 256 << 10,
        two_shot_max: 4 << 20,
    };

    /// The path for `m`: across nodes the inter-node path; else LL up to `ll_max` (16-byte
    /// multiples), one-shot up to `one_shot_max` (not in place), two-shot up to `two_shot_max`
    /// (and beyond for sizes that are not a multiple of 16), then the bandwidth path. A
    /// partly overlapping message gets the path that reports why it is refused (two-shot).
    pub fn choose(&self, m: &AllReduceMsg) -> AllReducePath {
        let whole = m.bytes % 16 == 0;
        if m.nodes > 1 {
            AllReducePath::InterNode
        } else if whole && m.bytes <= self.ll_max.min(LL_MSG_MAX) && m.overlap != Overlap::Partial {
            AllReducePath::Ll
        } else if m.bytes <= self.one_shot_max && m.overlap == Overlap::Disjoint {
            AllReducePath::OneShot
        } else if !whole || m.bytes <= self.two_shot_max {
            AllReducePath::TwoShot
        } else {
            AllReducePath::Bandwidth
        }
    }
}

impl Default for AllReducePolicy {
    fn default() -> Self {
        AllReducePolicy::PROVISIONAL
    }
}

impl Communicator {
    /// The message of an AllReduce of `count` elements of `dtype` from `src` into `dst`, after
    /// the checks every path shares (heap region, sizes).
    fn all_reduce_msg(&self, src: &SymBuffer, dst: &SymBuffer, count: u64, dtype: ReduceDtype) -> Result<AllReduceMsg> {
        let op = "all_reduce";
        let bytes = check::product(op, "count x size", &[count, dtype.size()])?;
        if bytes == 0 {
            return Err(Error::Shape {
                op,
                reason: "count = 0: nothing to reduce".into(),
            });
        }
        self.check_region(op, src)?;
        self.check_region(op, dst)?;
        check_fits(op, src, bytes)?;
        check_fits(op, dst, bytes)?;
        Ok(AllReduceMsg {
            bytes,
            overlap: Overlap::of(src.offset, dst.offset, bytes),
            nodes: self.nnodes(),
        })
    }

    /// The policy's path for an AllReduce of `count` elements of `dtype` from `src` into `dst`
    /// ([`CommConfig::all_reduce_policy`](super::CommConfig::all_reduce_policy)): what
    /// [`Communicator::all_reduce`] takes with these arguments.
    pub fn all_reduce_path(
        &self,
        src: &SymBuffer,
        dst: &SymBuffer,
        count: u64,
        dtype: ReduceDtype,
    ) -> Result<AllReducePath> {
        let m = self.all_reduce_msg(src, dst, count, dtype)?;
        Ok(self.policy.choose(&m))
    }

    /// AllReduce of `count` elements from `src` into `dst` (both in the heap; the same buffer
    /// for in place; partly overlapping buffers are refused) on the path the communicator's
    /// policy picks by size ([`AllReducePolicy::choose`]; [`Communicator::all_reduce_path`]
    /// says which it takes). Any `count >= 1` on one node; across nodes `count x size` must be
    /// a multiple of 16.
    pub fn all_reduce(
        &self,
        stream: &Arc<CudaStream>,
        src: &SymBuffer,
        dst: &SymBuffer,
        count: u64,
        dtype: ReduceDtype,
        ctas: u32,
    ) -> Result<()> {
        let m = self.all_reduce_msg(src, dst, count, dtype)?;
        self.launch_all_reduce(self.policy.choose(&m), &m, stream, src, dst, count, dtype, ctas)
    }

    /// [`Communicator::all_reduce`] on the given path ([`Error::Unsupported`] when that path
    /// cannot carry the message, saying why): for benchmarks and tests of every path.
    #[allow(clippy::too_many_arguments)] // the all_reduce arguments and the path
    pub fn all_reduce_via(
        &self,
        path: AllReducePath,
        stream: &Arc<CudaStream>,
        src: &SymBuffer,
        dst: &SymBuffer,
        count: u64,
        dtype: ReduceDtype,
        ctas: u32,
    ) -> Result<()> {
        let m = self.all_reduce_msg(src, dst, count, dtype)?;
        self.launch_all_reduce(path, &m, stream, src, dst, count, dtype, ctas)
    }

    /// Launches `path` for `m` (already checked by [`Communicator::all_reduce_msg`]). No
    /// allocation, upload or synchronization: the kernel lookup (cached), the launch lock and
    /// one or two launches.
    #[allow(clippy::too_many_arguments)]
    fn launch_all_reduce(
        &self,
        path: AllReducePath,
        m: &AllReduceMsg,
        stream: &Arc<CudaStream>,
        src: &SymBuffer,
        dst: &SymBuffer,
        count: u64,
        dtype: ReduceDtype,
        ctas: u32,
    ) -> Result<()> {
        let op = "all_reduce";
        if let Some(why) = m.unavailable(path) {
            return Err(if m.overlap == Overlap::Partial || path == AllReducePath::InterNode {
                Error::Shape { op, reason: why }
            } else {
                Error::Unsupported(format!(
                    "all_reduce of {} bytes on the {} path: {why}",
                    m.bytes,
                    path.name()
                ))
            });
        }
        let (desc, src_off, dst_off, code) = (self.desc_ptr(), src.offset, dst.offset, dtype.code());
        let spec = match path {
            AllReducePath::Ll | AllReducePath::Bandwidth => &kernels::ALLREDUCE,
            AllReducePath::OneShot => &kernels::ALLREDUCE_ONESHOT,
            AllReducePath::TwoShot => &kernels::ALLREDUCE_TWOSHOT,
            AllReducePath::InterNode => return self.all_reduce_internode(stream, src, dst, count, dtype, ctas),
        };
        let (f, cfg) = self.prepare(spec, ctas)?;
        self.enqueue(op, stream, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&desc).arg(&src_off).arg(&dst_off).arg(&count).arg(&code);
            // SAFETY: mk_allreduce{,_oneshot,_twoshot}(desc, src_off, dst_off, count, dtype);
            // heap buffers checked, and their overlap allowed for this path (`unavailable`).
            unsafe { b.launch(cfg) }?;
            Ok(())
        })
    }

    /// The inter-node AllReduce: 1. the sum inside the node (NVLink) into the node-sum
    /// buffer; 2. the exchange of node sums with the rail peers through the proxy, added up in
    /// node order.
    fn all_reduce_internode(
        &self,
        stream: &Arc<CudaStream>,
        src: &SymBuffer,
        dst: &SymBuffer,
        count: u64,
        dtype: ReduceDtype,
        ctas: u32,
    ) -> Result<()> {
        let op = "all_reduce";
        let w = self
            .wire
            .as_ref()
            .ok_or_else(|| Error::Unsupported("the inter-node path needs a job of several nodes".into()))?;
        let bytes = count * dtype.size();
        if bytes > w.max_bytes {
            return Err(Error::Shape {
                op,
                reason: format!(
                    "{bytes} bytes exceed the inter-node stage of {} (CommConfig::internode_scratch_bytes)",
                    w.max_bytes
                ),
            });
        }
        let (desc, code) = (self.desc_ptr(), dtype.code());
        let (src_off, sum_off, recv_off, dst_off) = (src.offset, w.node_sum.offset, w.recv.offset, dst.offset);
        let (f, cfg) = self.prepare(&kernels::ALLREDUCE, ctas)?;
        let (f2, cfg2) = self.prepare(&kernels::ALLREDUCE_INTERNODE, ctas)?;
        self.enqueue(op, stream, || {
            let mut b = stream.launch_builder(&f);
            b.arg(&desc).arg(&src_off).arg(&sum_off).arg(&count).arg(&code);
            // SAFETY: mk_allreduce(desc, src_off, dst_off, count, dtype); heap buffers checked.
            unsafe { b.launch(cfg) }?;
            let mut b = stream.launch_builder(&f2);
            b.arg(&desc)
                .arg(&sum_off)
                .arg(&recv_off)
                .arg(&dst_off)
                .arg(&count)
                .arg(&code);
            // SAFETY: mk_allreduce_internode(desc, src_off, scratch_off, dst_off, count, dtype).
            unsafe { b.launch(cfg2) }?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(bytes: u64, overlap: Overlap) -> AllReduceMsg {
        AllReduceMsg {
            bytes,
            overlap,
            nodes: 1,
        }
    }

    #[test]
    fn the_provisional_policy_picks_by_size_alignment_and_overlap() {
        let p = AllReducePolicy::PROVISIONAL;
        let pick = |bytes, overlap| p.choose(&msg(bytes, overlap));
        use AllReducePath::*;
        use Overlap::*;
        // LL up to ll_max for 16-byte multiples, in place or not.
        assert_eq!(pick(16, Disjoint), Ll);
        assert_eq!(pick(16 << 10, Disjoint), Ll);
        assert_eq!(pick(16 << 10, InPlace), Ll);
        // Sizes that are not 16-byte multiples never take LL or the bandwidth path.
        assert_eq!(pick(8, Disjoint), OneShot);
        assert_eq!(pick(8, InPlace), TwoShot);
        assert_eq!(pick((16 << 20) + 2, Disjoint), TwoShot);
        // One-shot above LL up to one_shot_max, only out of place.
        assert_eq!(pick((16 << 10) + 16, Disjoint), OneShot);
        assert_eq!(pick(256 << 10, Disjoint), OneShot);
        assert_eq!(pick(256 << 10, InPlace), TwoShot);
        // Two-shot up to two_shot_max, then the bandwidth path.
        assert_eq!(pick((256 << 10) + 16, Disjoint), TwoShot);
        assert_eq!(pick(4 << 20, InPlace), TwoShot);
        assert_eq!(pick((4 << 20) + 16, Disjoint), Bandwidth);
        assert_eq!(pick(1 << 30, InPlace), Bandwidth);
        // Partly overlapping buffers get a path that refuses them.
        for bytes in [16, 1000, 1 << 20, 1 << 26] {
            let m = msg(bytes, Partial);
            assert!(m.unavailable(p.choose(&m)).is_some(), "{bytes}");
        }
        // Across nodes: always the inter-node path.
        let m = AllReduceMsg {
            nodes: 2,
            ..msg(4096, Disjoint)
        };
        assert_eq!(p.choose(&m), InterNode);
        // ll_max is capped at LL_MSG_MAX.
        let wide = AllReducePolicy { ll_max: u64::MAX, ..p };
        assert_eq!(wide.choose(&msg(LL_MSG_MAX, Disjoint)), Ll);
        assert_eq!(wide.choose(&msg(LL_MSG_MAX + 16, Disjoint)), OneShot);
    }

    #[test]
    fn the_chosen_path_can_always_carry_the_message() {
        let p = AllReducePolicy::PROVISIONAL;
        for nodes in [1, 2] {
            for overlap in [Overlap::Disjoint, Overlap::InPlace] {
                for bytes in (1..=24)
                    .map(|k| 1u64 << k)
                    .chain([2, 6, 10, 1002, (1 << 20) + 6, 3 << 22])
                {
                    let m = AllReduceMsg { bytes, overlap, nodes };
                    if nodes > 1 && bytes % 16 != 0 {
                        continue; // refused across nodes whatever the path
                    }
                    let path = p.choose(&m);
                    assert_eq!(m.unavailable(path), None, "{m:?} -> {path:?}");
                }
            }
        }
    }

    #[test]
    fn paths_refuse_what_they_cannot_carry() {
        use AllReducePath::*;
        let odd = msg(1002, Overlap::Disjoint);
        assert!(odd.unavailable(Ll).is_some());
        assert!(odd.unavailable(Bandwidth).is_some());
        assert!(odd.unavailable(OneShot).is_none());
        assert!(odd.unavailable(TwoShot).is_none());
        let in_place = msg(4096, Overlap::InPlace);
        assert!(in_place.unavailable(OneShot).is_some());
        assert!(in_place.unavailable(TwoShot).is_none());
        assert!(msg(LL_MSG_MAX + 16, Overlap::Disjoint).unavailable(Ll).is_some());
        assert!(msg(LL_MSG_MAX, Overlap::Disjoint).unavailable(Bandwidth).is_some());
        assert!(msg(LL_MSG_MAX + 16, Overlap::Disjoint).unavailable(Bandwidth).is_none());
        assert!(msg(4096, Overlap::Disjoint).unavailable(InterNode).is_some());
        let two = AllReduceMsg {
            nodes: 2,
            ..msg(4096, Overlap::Disjoint)
        };
        for p in AllReducePath::SINGLE_NODE {
            assert!(two.unavailable(p).is_some(), "{p:?}");
        }
        for p in AllReducePath::SINGLE_NODE.into_iter().chain([InterNode]) {
            assert_eq!(AllReducePath::from_name(p.name()), Some(p));
        }
    }

    #[test]
    fn overlap_is_classified() {
        assert_eq!(Overlap::of(1024, 1024, 512), Overlap::InPlace);
        assert_eq!(Overlap::of(1024, 1536, 512), Overlap::Disjoint);
        assert_eq!(Overlap::of(1536, 1024, 512), Overlap::Disjoint);
        assert_eq!(Overlap::of(1024, 1040, 512), Overlap::Partial);
        assert_eq!(Overlap::of(1040, 1024, 512), Overlap::Partial);
    }
}
