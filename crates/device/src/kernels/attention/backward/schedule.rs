//! The work of a backward CTA: one key block of [`BLOCK_N`] rows of one (sequence, key/value
//! head), against the query blocks of every query head of its group that see any of its keys.
//!
//! CTA `t` takes key block `t / (batch * heads_kv)` of (sequence, head) `t % (batch * heads_kv)`:
//! with a causal mask the first key blocks are seen by the most queries, so they start first.
use crate::kernels::attention::schedule::uniform;
use mkernel_config::ops::attention_bwd::AttentionBwdArgs;

/// Query rows of a Q / dO block.
pub const BLOCK_M: u32 = 64;
/// Key rows of a CTA.
pub const BLOCK_N: u32 = 128;

#[derive(Clone, Copy)]
pub struct BwdWork {
    pub b: u32,
    pub h_kv: u32,
    /// Query heads per key/value head.
    pub group: u32,
    /// First key row of the block inside its sequence.
    pub n0: u32,
    pub q_start: u32,
    pub q_len: u32,
    pub k_start: u32,
    pub k_len: u32,
    /// Query blocks `m_first..m_end` of each head see some key of the block.
    pub m_first: u32,
    pub m_end: u32,
    pub causal: bool,
}

impl BwdWork {
    /// Query blocks per head.
    #[inline(always)]
    pub fn m_blocks(&self) -> u32 {
        self.m_end.saturating_sub(self.m_first)
    }
    /// (Q, dO) blocks the CTA visits: every head of the group, each over its query blocks.
    #[inline(always)]
    pub fn iterations(&self) -> u32 {
        self.group * self.m_blocks()
    }
    /// Iteration `it`'s query head and first query row (inside the sequence).
    #[inline(always)]
    pub fn at(&self, it: u32) -> (u32, u32) {
        let nm = self.m_blocks();
        (self.h_kv * self.group + it / nm, (self.m_first + it % nm) * BLOCK_M)
    }
    /// Whether query `i` sees key `j` (both inside the sequence's rows).
    #[inline(always)]
    pub fn visible(&self, i: u32, j: u32) -> bool {
        i < self.q_len && j < self.k_len && (!self.causal || j + self.q_len <= i + self.k_len)
    }
}

/// CTA `t`'s work; `None` when its key block lies past its sequence's keys.
/// `UNIFORM` (full warps only): the values read from memory go through [`uniform`].
///
/// # Safety
/// `a` is the launch's argument block (its `cu_seqlens` pointers, when set, are readable for
/// `batch + 1` entries); `UNIFORM` only when every lane of the warp calls it.
#[inline(always)]
pub unsafe fn bwd_work<const UNIFORM: bool>(a: &AttentionBwdArgs, t: u32) -> Option<BwdWork> {
    let u = |x: u32| if UNIFORM { uniform(x) } else { x };
    let (batch, hq, hkv) = (u(a.batch), u(a.heads_q), u(a.heads_kv));
    let bh = batch * hkv;
    let (n, r) = (t / bh, t % bh);
    let (b, h_kv) = (r / hkv, r % hkv);
    let (q_start, q_len, k_start, k_len) = if a.cu_seqlens_q != 0 {
        let cq = a.cu_seqlens_q as *const u32;
        let ck = a.cu_seqlens_k as *const u32;
        unsafe {
            let (q0, q1) = (cq.add(b as usize).read(), cq.add(b as usize + 1).read());
            let (k0, k1) = (ck.add(b as usize).read(), ck.add(b as usize + 1).read());
            (u(q0), u(q1 - q0), u(k0), u(k1 - k0))
        }
    } else {
        let (sq, sk) = (u(a.seqlen_q), u(a.seqlen_k));
        (b * sq, sq, b * sk, sk)
    };
    let n0 = n * BLOCK_N;
    if n0 >= k_len {
        return None;
    }
    let causal = u(a.causal) != 0;
    let m_end = q_len.div_ceil(BLOCK_M);
    // Causal: the first query that sees key n0 is n0 + q_len - k_len.
    // (`n0 < k_len`, so that query lies inside the sequence.)
    let m_first = if !causal || n0 + q_len <= k_len {
        0
    } else {
        (n0 + q_len - k_len) / BLOCK_M
    };
    Some(BwdWork {
        b,
        h_kv,
        group: hq / hkv,
        n0,
        q_start,
        q_len,
        k_start,
        k_len,
        m_first,
        m_end,
        causal,
    })
}
