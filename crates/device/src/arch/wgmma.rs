//! wgmma: warpgroup-wide asynchronous matrix multiply-accumulate on the tensor cores (sm_90a).
//!
//! Operands A and B come from shared memory through 64-bit matrix descriptors ([`smem_desc`]);
//! the accumulator tile lives in registers, spread over the 128 threads of the warpgroup. For
//! `m64nNk16` thread `t` (warp `w = t / 32`, lane `l`) holds, for every 8-column block `j`:
//! `acc[4j + 0..2]` = row `16w + l/4`, columns `8j + 2(l%4) + 0..2`;
//! `acc[4j + 2..4]` = row `16w + l/4 + 8`, same columns.
//! Index the accumulator array with constants only (unrolled code): a run-time index moves it
//! to the stack and makes ptxas serialize the wgmmas.
use super::smem::SmemAddr;
use core::arch::asm;

/// One `asm!` over the accumulator registers `acc[0..N]`, `N` = 32, 64 or 128, the operand list every wgmma and
/// operand fence below shares. The accumulators are operands `0..N`, in order, each `$dir(reg32) $acc[i]` with a
/// constant index (see the module docs). The template is the `$pre` lines, then the line
/// `$head {0}$sep{1}$sep ... {N-1}$tail`, then the `$post` lines; the operands that follow the accumulators
/// are named, so that `$tail` refers to them independently of `N`.
macro_rules! acc_asm {
    ($n:tt, $($rest:tt)*) => {
        acc_asm!(@take $n [
            [0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15
             16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31]
            [32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47
             48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63]
            [64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79
             80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95]
            [96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111
             112 113 114 115 116 117 118 119 120 121 122 123 124 125 126 127]
        ] $($rest)*)
    };
    (@take 4 [[$a0:tt $a1:tt $a2:tt $a3:tt $($a:tt)*] $($more:tt)*] $($rest:tt)*) => {
        acc_asm!(@regs [$a0 $a1 $a2 $a3] $($rest)*)
    };
    (@take 8 [[$a0:tt $a1:tt $a2:tt $a3:tt $a4:tt $a5:tt $a6:tt $a7:tt $($a:tt)*] $($more:tt)*] $($rest:tt)*) => {
        acc_asm!(@regs [$a0 $a1 $a2 $a3 $a4 $a5 $a6 $a7] $($rest)*)
    };
    (@take 16 [[$a0:tt $a1:tt $a2:tt $a3:tt $a4:tt $a5:tt $a6:tt $a7:tt
                $a8:tt $a9:tt $a10:tt $a11:tt $a12:tt $a13:tt $a14:tt $a15:tt $($a:tt)*] $($more:tt)*] $($rest:tt)*) => {
        acc_asm!(@regs [$a0 $a1 $a2 $a3 $a4 $a5 $a6 $a7 $a8 $a9 $a10 $a11 $a12 $a13 $a14 $a15] $($rest)*)
    };
    (@take 32 [[$($a:tt)*] $($more:tt)*] $($rest:tt)*) => {
        acc_asm!(@regs [$($a)*] $($rest)*)
    };
    (@take 64 [[$($a:tt)*] [$($b:tt)*] $($more:tt)*] $($rest:tt)*) => {
        acc_asm!(@regs [$($a)* $($b)*] $($rest)*)
    };
    (@take 128 [[$($a:tt)*] [$($b:tt)*] [$($c:tt)*] [$($d:tt)*]] $($rest:tt)*) => {
        acc_asm!(@regs [$($a)* $($b)* $($c)* $($d)*] $($rest)*)
    };
    (@regs [$i0:tt $($i:tt)*] $dir:ident $acc:ident, [$($pre:expr),*], $head:expr, $sep:expr, $tail:expr,
        [$($post:expr),*], $($operand:tt)*) => {
        asm!(
            $($pre,)*
            concat!($head, "{", $i0, "}", $($sep, "{", $i, "}",)* $tail),
            $($post,)*
            $dir(reg32) $acc[$i0],
            $($dir(reg32) $acc[$i],)*
            $($operand)*
        )
    };
}

/// One `wgmma.mma_async.sync.aligned.<shape>.f32.bf16.bf16` on the `N` f32 accumulator registers of `acc`, with
/// the scale-d predicate `p` (false: `D = A * B`) and scale-a = scale-b = 1. Forms: `ss` (A and B shared-memory
/// descriptors, `p` = `accumulate`, tnsp-a 0), `ss_first` (as `ss` with `p` false; `acc` is written only), `rs`
/// (A four bf16x2 registers, B a descriptor, `p` = `accumulate`), `ss_t` (as `ss` with tnsp-a the const `TRANS_A`), `ss_t_first` (as `ss_t` with `p` false, `acc` written
/// only);
/// tnsp-b is the const `TRANS_B` in each.
macro_rules! mma_bf16 {
    (ss $n:tt, $shape:literal, $acc:ident, $desc_a:ident, $desc_b:ident, $accumulate:ident, $trans_b:ident) => {
        mma_bf16!(@asm $n, inout $acc, $shape, "{scale_d}", "{desc_a}, {desc_b}, p, 1, 1, 0, {trans_b};",
            desc_a = in(reg64) $desc_a,
            desc_b = in(reg64) $desc_b,
            scale_d = in(reg32) $accumulate as u32,
            trans_b = const $trans_b,
        )
    };
    (ss_t $n:tt, $shape:literal, $acc:ident, $desc_a:ident, $desc_b:ident, $accumulate:ident, $trans_a:ident, $trans_b:ident) => {
        mma_bf16!(@asm $n, inout $acc, $shape, "{scale_d}", "{desc_a}, {desc_b}, p, 1, 1, {trans_a}, {trans_b};",
            desc_a = in(reg64) $desc_a,
            desc_b = in(reg64) $desc_b,
            scale_d = in(reg32) $accumulate as u32,
            trans_a = const $trans_a,
            trans_b = const $trans_b,
        )
    };
    (ss_t_first $n:tt, $shape:literal, $acc:ident, $desc_a:ident, $desc_b:ident, $trans_a:ident, $trans_b:ident) => {
        mma_bf16!(@asm $n, out $acc, $shape, "0", "{desc_a}, {desc_b}, p, 1, 1, {trans_a}, {trans_b};",
            desc_a = in(reg64) $desc_a,
            desc_b = in(reg64) $desc_b,
            trans_a = const $trans_a,
            trans_b = const $trans_b,
        )
    };
    (ss_first $n:tt, $shape:literal, $acc:ident, $desc_a:ident, $desc_b:ident, $trans_b:ident) => {
        mma_bf16!(@asm $n, out $acc, $shape, "0", "{desc_a}, {desc_b}, p, 1, 1, 0, {trans_b};",
            desc_a = in(reg64) $desc_a,
            desc_b = in(reg64) $desc_b,
            trans_b = const $trans_b,
        )
    };
    (rs $n:tt, $shape:literal, $acc:ident, $a:ident, $desc_b:ident, $accumulate:ident, $trans_b:ident) => {
        mma_bf16!(@asm $n, inout $acc, $shape, "{scale_d}", "{{{a0}, {a1}, {a2}, {a3}}}, {desc_b}, p, 1, 1, {trans_b};",
            a0 = in(reg32) $a[0],
            a1 = in(reg32) $a[1],
            a2 = in(reg32) $a[2],
            a3 = in(reg32) $a[3],
            desc_b = in(reg64) $desc_b,
            scale_d = in(reg32) $accumulate as u32,
            trans_b = const $trans_b,
        )
    };
    (@asm $n:tt, $dir:ident $acc:ident, $shape:literal, $scale_d:literal, $ab:literal, $($operand:tt)*) => {
        acc_asm!(
            $n, $dir $acc,
            ["{{", ".reg .pred p;", concat!("setp.ne.b32 p, ", $scale_d, ", 0;")],
            concat!("wgmma.mma_async.sync.aligned.", $shape, ".f32.bf16.bf16 {{"), ", ",
            concat!("}}, ", $ab),
            ["}}"],
            $($operand)*
            options(nostack)
        )
    };
}

/// Swizzle mode of a shared-memory operand (bits 62..64 of the descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Swizzle {
    None = 0,
    B128 = 1,
    B64 = 2,
    B32 = 3,
}

/// Matrix descriptor of a shared-memory operand:
/// bits 0..14 start address >> 4, 16..30 leading-dimension byte offset >> 4,
/// 32..46 stride-dimension byte offset >> 4, 49..52 base offset (0: 1024-aligned atoms), 62..64 swizzle.
/// For K-major 128B-swizzled tiles: `lbo` unused (1), `sbo` = 1024 (8 rows of 128 bytes).
/// For MN-major 128B-swizzled tiles: `lbo` = bytes between 64-element MN atoms, `sbo` = 1024.
#[inline(always)]
pub const fn smem_desc(addr: SmemAddr, lbo: u32, sbo: u32, swizzle: Swizzle) -> u64 {
    ((addr.0 as u64 >> 4) & 0x3fff)
        | (((lbo as u64 >> 4) & 0x3fff) << 16)
        | (((sbo as u64 >> 4) & 0x3fff) << 32)
        | ((swizzle as u64) << 62)
}

/// Orders register accesses before following wgmmas: `wgmma.fence.sync.aligned;`
#[inline(always)]
pub fn fence() {
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) };
}
/// Closes the group of wgmmas issued so far: `wgmma.commit_group.sync.aligned;`
#[inline(always)]
pub fn commit_group() {
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}
/// Waits until at most `N` groups are pending: `wgmma.wait_group.sync.aligned N;`
#[inline(always)]
pub fn wait_group<const N: u32>() {
    unsafe { asm!("wgmma.wait_group.sync.aligned {0};", const N, options(nostack)) };
}

/// `D (+)= A * B` for a 64x256 f32 tile, k = 16, bf16 operands from shared memory:
/// `wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {d0..d127}, desc_a, desc_b, p, 1, 1, 0, TRANS_B;`
/// with `p = accumulate` (false: `D = A * B`). `TRANS_B = 0`: B stored K-major (N x K);
/// `1`: B stored MN-major (K x N).
///
/// # Safety
///
/// Executed by all 128 threads of one warpgroup together (`.sync.aligned`), after [`fence`]; `desc_a` and `desc_b`
/// ([`smem_desc`]) describe bf16 tiles in this CTA's shared memory laid out as the descriptor and `TRANS_B` say,
/// written before and fenced for the async proxy, and not overwritten until [`wait_group`] retires this wgmma; `acc`
/// must not be read or written until then either.
#[inline(always)]
pub unsafe fn mma_m64n256k16_bf16<const TRANS_B: u32>(
    acc: &mut [f32; 128],
    desc_a: u64,
    desc_b: u64,
    accumulate: bool,
) {
    unsafe {
        mma_bf16!(ss 128, "m64n256k16", acc, desc_a, desc_b, accumulate, TRANS_B);
    }
}

/// `D (+)= A * B` for a 64x128 f32 tile, k = 16, bf16 A and B from shared memory:
/// `wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {d0..d63}, desc_a, desc_b, p, 1, 1, 0, TRANS_B;`
///
/// # Safety
///
/// As [`mma_m64n256k16_bf16`]: all 128 threads of the warpgroup, after [`fence`], descriptors of valid shared-memory
/// tiles that stay unchanged, and `acc` untouched until [`wait_group`] retires it.
#[inline(always)]
pub unsafe fn mma_m64n128k16_bf16<const TRANS_B: u32>(acc: &mut [f32; 64], desc_a: u64, desc_b: u64, accumulate: bool) {
    unsafe {
        mma_bf16!(ss 64, "m64n128k16", acc, desc_a, desc_b, accumulate, TRANS_B);
    }
}
/// `D (+)= A * B` for a 64x128 f32 tile, k = 16, A (bf16x2) from registers, B from shared memory:
/// `wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {d0..d63}, {a0..a3}, desc_b, p, 1, 1, TRANS_B;`
/// Thread `t`'s `a` holds A's row `16w + l/4` (`a[0]`, `a[2]`) and row `+8` (`a[1]`, `a[3]`), columns
/// `2(l%4)..+2` (`a[0]`, `a[1]`) and `8 + 2(l%4)..+2` (`a[2]`, `a[3]`): the accumulator layout of an
/// `m64n16` tile, so an f32 accumulator packed pairwise to bf16x2 is an A operand as it stands.
///
/// # Safety
///
/// As [`mma_m64n256k16_bf16`] for the accumulator and B: all 128 threads of the warpgroup, after [`fence`], `desc_b` a
/// valid shared-memory tile unchanged until [`wait_group`] retires the wgmma, `acc` untouched until then; `a` holds
/// this thread's part of A in the layout above.
#[inline(always)]
pub unsafe fn mma_m64n128k16_bf16_rs<const TRANS_B: u32>(
    acc: &mut [f32; 64],
    a: [u32; 4],
    desc_b: u64,
    accumulate: bool,
) {
    unsafe {
        mma_bf16!(rs 64, "m64n128k16", acc, a, desc_b, accumulate, TRANS_B);
    }
}
/// As [`mma_m64n128k16_bf16_rs`] for a 64x64 f32 tile:
/// `wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {d0..d31}, {a0..a3}, desc_b, p, 1, 1, TRANS_B;`
///
/// # Safety
///
/// As [`mma_m64n128k16_bf16_rs`].
#[inline(always)]
pub unsafe fn mma_m64n64k16_bf16_rs<const TRANS_B: u32>(
    acc: &mut [f32; 32],
    a: [u32; 4],
    desc_b: u64,
    accumulate: bool,
) {
    unsafe {
        mma_bf16!(rs 32, "m64n64k16", acc, a, desc_b, accumulate, TRANS_B);
    }
}
/// Pins the 64 registers of `acc` at this point of the program: an empty `asm!` that
/// reads and writes each of them (a PTX comment naming them; no instruction). Ordered with the other `asm!`s, it keeps
/// the compiler from moving arithmetic on an accumulator across the `wgmma.wait_group` that
/// makes it valid (the wgmma writes it asynchronously).
#[inline(always)]
pub fn fence_operands_64(acc: &mut [f32; 64]) {
    unsafe {
        acc_asm!(64, inout acc, [], "// ", " ", "", [], options(nostack, nomem));
    }
}
/// Pins the 32 registers of `acc` at this point of the program: an empty `asm!` that
/// reads and writes each of them (a PTX comment naming them; no instruction). Ordered with the other `asm!`s, it keeps
/// the compiler from moving arithmetic on an accumulator across the `wgmma.wait_group` that
/// makes it valid (the wgmma writes it asynchronously).
#[inline(always)]
pub fn fence_operands_32(acc: &mut [f32; 32]) {
    unsafe {
        acc_asm!(32, inout acc, [], "// ", " ", "", [], options(nostack, nomem));
    }
}

/// As [`mma_m64n128k16_bf16`] with `D = A * B` (scale-d 0): the accumulator is written only, so
/// the wgmma does not depend on what the registers held before (a masked score tile, say).
///
/// # Safety
///
/// As [`mma_m64n128k16_bf16`].
#[inline(always)]
pub unsafe fn mma_m64n128k16_bf16_first<const TRANS_B: u32>(acc: &mut [f32; 64], desc_a: u64, desc_b: u64) {
    unsafe {
        mma_bf16!(ss_first 64, "m64n128k16", acc, desc_a, desc_b, TRANS_B);
    }
}

/// `D (+)= A * B` for a 64 x N f32 tile, k = 16, A and B from shared memory, either transposed:
/// `wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16 {d..}, desc_a, desc_b, p, 1, 1, TRANS_A, TRANS_B;`
/// for the narrow N of the decode GEMM. Implemented for `[f32; N / 2]`, N = 8, 16, 32, 64, 128, 256.
pub trait MmaTile: Sized {
    /// Accumulator registers per thread (N / 2).
    const LEN: usize;
    /// The wgmma N.
    const N: u32;
    /// Every accumulator 0.
    const ZERO: Self;
    /// # Safety
    ///
    /// As [`mma_m64n256k16_bf16`], with `TRANS_A = 1` for an A tile stored MN-major.
    unsafe fn mma<const TRANS_A: u32, const TRANS_B: u32>(&mut self, desc_a: u64, desc_b: u64, accumulate: bool);
}

macro_rules! mma_tile_impl {
    ($($n:literal $len:tt $shape:literal),*) => {$(
        impl MmaTile for [f32; $len] {
            const LEN: usize = $len;
            const N: u32 = $n;
            const ZERO: Self = [0.0; $len];
            #[inline(always)]
            unsafe fn mma<const TRANS_A: u32, const TRANS_B: u32>(&mut self, desc_a: u64, desc_b: u64, accumulate: bool) {
                let acc = self;
                unsafe {
                    mma_bf16!(ss_t $len, $shape, acc, desc_a, desc_b, accumulate, TRANS_A, TRANS_B);
                }
            }
        }
    )*};
}
mma_tile_impl!(8 4 "m64n8k16", 16 8 "m64n16k16", 32 16 "m64n32k16", 64 32 "m64n64k16", 128 64 "m64n128k16", 256 128 "m64n256k16");
/// `D (+)= A * B` for a 64x64 f32 tile, k = 16, bf16 A and B from shared memory, either operand K-major
/// (`TRANS_* = 0`) or MN-major (`1`):
/// `wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {d0..d31}, desc_a, desc_b, p, 1, 1, TRANS_A, TRANS_B;`
///
/// # Safety
///
/// As [`mma_m64n256k16_bf16`]: all 128 threads of the warpgroup, after [`fence`], descriptors of valid shared-memory
/// tiles laid out as `TRANS_A` / `TRANS_B` say that stay unchanged, and `acc` untouched until [`wait_group`] retires it.
#[inline(always)]
pub unsafe fn mma_m64n64k16_bf16_ss<const TRANS_A: u32, const TRANS_B: u32>(
    acc: &mut [f32; 32],
    desc_a: u64,
    desc_b: u64,
    accumulate: bool,
) {
    unsafe {
        mma_bf16!(ss_t 32, "m64n64k16", acc, desc_a, desc_b, accumulate, TRANS_A, TRANS_B);
    }
}

/// As [`mma_m64n64k16_bf16_ss`] with `D = A * B` (scale-d 0): the accumulator is written only, so its earlier values
/// are not kept alive for the wgmma.
///
/// # Safety
///
/// As [`mma_m64n64k16_bf16_ss`].
#[inline(always)]
pub unsafe fn mma_m64n64k16_bf16_ss_first<const TRANS_A: u32, const TRANS_B: u32>(
    acc: &mut [f32; 32],
    desc_a: u64,
    desc_b: u64,
) {
    unsafe {
        mma_bf16!(ss_t_first 32, "m64n64k16", acc, desc_a, desc_b, TRANS_A, TRANS_B);
    }
}
