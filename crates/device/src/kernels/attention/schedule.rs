//! The tile sequence of a CTA and the bounds of each tile.
//!
//! Tiles are numbered `t = (b * heads_q + h) * m_blocks + i`, and CTA `c` of `g` takes
//! `c, c + g, c + 2g, ...`. Inside a (sequence, head) the query blocks go from the last to the
//! first: with a causal mask the last block has the most key blocks, so every wave of CTAs
//! starts with the longest work (and the CTAs of a wave share one head's K and V in L2).
use mkernel_config::ops::attention::AttentionArgs;

/// Rows of a query tile and of a key/value block.
pub const BLOCK: u32 = 128;

/// One tile's work.
#[derive(Clone, Copy)]
pub struct Work {
    pub b: u32,
    pub h: u32,
    pub h_kv: u32,
    /// First query row of the tile inside its sequence.
    pub m0: u32,
    /// Row of the sequence's first query / key in the Q / K tensors.
    pub q_start: u32,
    pub k_start: u32,
    pub q_len: u32,
    pub k_len: u32,
    /// Key blocks the tile attends to (0: none; its rows get O = 0, LSE = -inf).
    pub n_blocks: u32,
    pub mask: Mask,
}

/// Which keys a query sees. In every case the keys query `i` sees are the first
/// [`Work::visible`]`(i)` rows of its sequence's keys, a count that does not decrease with `i`.
#[derive(Clone, Copy)]
pub enum Mask {
    /// All keys.
    None,
    /// Causal, bottom-right aligned: query `i` sees keys `j <= i + k_len - q_len`.
    BottomRight,
    /// Causal over a zigzag-sharded sequence (ring attention): the local queries are global
    /// chunks `q[0]` then `q[1]`, the keys chunks `k[0]` then `k[1]` (`k[0] < k[1]`), `chunk`
    /// rows each; a query sees the keys at global positions up to its own.
    Zigzag { chunk: u32, q: [u32; 2], k: [u32; 2] },
}

impl Work {
    /// Keys (a prefix of the sequence's) that query row `i` of the sequence sees.
    #[inline(always)]
    pub fn visible(&self, i: i32) -> i32 {
        let k_len = self.k_len as i32;
        match self.mask {
            Mask::None => k_len,
            Mask::BottomRight => (i + k_len - self.q_len as i32 + 1).clamp(0, k_len),
            Mask::Zigzag { chunk, q, k } => {
                let c = chunk as i32;
                let g = if i < c {
                    q[0] as i32 * c + i
                } else {
                    q[1] as i32 * c + i - c
                };
                (g - k[0] as i32 * c + 1).clamp(0, c) + (g - k[1] as i32 * c + 1).clamp(0, c)
            }
        }
    }
    /// Whether key block `n` needs the element mask: some of its keys are not seen by the
    /// tile's first row (past the keys, or right of its causal limit).
    #[inline(always)]
    pub fn needs_mask(&self, n: u32) -> bool {
        (n * BLOCK + BLOCK) as i32 > self.visible(self.m0 as i32)
    }
}

/// Tiles in the launch.
#[inline(always)]
pub fn total<const UNIFORM: bool>(a: &AttentionArgs) -> u32 {
    let t = a.batch * a.heads_q * a.m_blocks;
    if UNIFORM {
        uniform(t)
    } else {
        t
    }
}

/// `x` as the warp's lane 0 has it, through `shfl.sync.idx`: ptxas then knows branches on it do
/// not diverge (a wgmma path it cannot prove convergent gets serialized, C7520). Full warps only.
#[inline(always)]
pub fn uniform(x: u32) -> u32 {
    crate::arch::shuffle::shfl_idx(x, 0)
}

/// Tile `t`; `None` when its query block lies past the end of its sequence (varlen).
/// `UNIFORM` (full warps only): the values read from memory go through [`uniform`].
///
/// # Safety
/// `a` is the launch's argument block (its `cu_seqlens` pointers, when set, are readable for
/// `batch + 1` entries); `UNIFORM` only when every lane of the warp calls it.
#[inline(always)]
pub unsafe fn work<const UNIFORM: bool>(a: &AttentionArgs, t: u32) -> Option<Work> {
    unsafe { work_in::<UNIFORM>(a, t, None) }
}

/// As [`work`]; with `zigzag = Some(mask)` (a [`Mask::Zigzag`]) the causal mask is that one
/// (ring attention's step) instead of the bottom-right one.
///
/// # Safety
/// As [`work`].
#[inline(always)]
pub unsafe fn work_in<const UNIFORM: bool>(a: &AttentionArgs, t: u32, zigzag: Option<Mask>) -> Option<Work> {
    let u = |x: u32| if UNIFORM { uniform(x) } else { x };
    let (m_blocks, heads_q) = (u(a.m_blocks), u(a.heads_q));
    let bh = t / m_blocks;
    let mb = m_blocks - 1 - t % m_blocks;
    let (b, h) = (bh / heads_q, bh % heads_q);
    let (q_start, q_len, k_start, k_len) = if a.cu_seqlens_q != 0 {
        let cq = a.cu_seqlens_q as *const u32;
        let ck = a.cu_seqlens_k as *const u32;
        // The offsets come from the caller's buffer and are not checked on the host: each
        // sequence is clamped into the tensors' rows (`total_q`; `seqlen_k` holds the key rows
        // with varlen input), so bad offsets give wrong rows, never stores past O or the LSE.
        let (total_q, total_k) = (u(a.total_q), u(a.seqlen_k));
        unsafe {
            let q1 = u(cq.add(b as usize + 1).read()).min(total_q);
            let q0 = u(cq.add(b as usize).read()).min(q1);
            let k1 = u(ck.add(b as usize + 1).read()).min(total_k);
            let k0 = u(ck.add(b as usize).read()).min(k1);
            (q0, q1 - q0, k0, k1 - k0)
        }
    } else {
        let (sq, sk) = (u(a.seqlen_q), u(a.seqlen_k));
        (b * sq, sq, b * sk, sk)
    };
    let m0 = mb * BLOCK;
    if m0 >= q_len {
        return None;
    }
    let mask = match zigzag {
        Some(z) => z,
        None if u(a.causal) != 0 => Mask::BottomRight,
        None => Mask::None,
    };
    let mut w = Work {
        b,
        h,
        h_kv: h / (heads_q / u(a.heads_kv)),
        m0,
        q_start,
        k_start,
        q_len,
        k_len,
        n_blocks: 0,
        mask,
    };
    // The tile's last row sees the most keys.
    let last = (m0 + BLOCK).min(q_len) as i32 - 1;
    w.n_blocks = (w.visible(last) as u32).div_ceil(BLOCK);
    Some(w)
}
