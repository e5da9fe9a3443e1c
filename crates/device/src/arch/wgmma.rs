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
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, {130}, 0;",
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}, {64}, {65}, {66}, {67}, {68}, {69}, {70}, {71}, {72}, {73}, {74}, {75}, {76}, {77}, {78}, {79}, {80}, {81}, {82}, {83}, {84}, {85}, {86}, {87}, {88}, {89}, {90}, {91}, {92}, {93}, {94}, {95}, {96}, {97}, {98}, {99}, {100}, {101}, {102}, {103}, {104}, {105}, {106}, {107}, {108}, {109}, {110}, {111}, {112}, {113}, {114}, {115}, {116}, {117}, {118}, {119}, {120}, {121}, {122}, {123}, {124}, {125}, {126}, {127}}}, {128}, {129}, p, 1, 1, 0, {131};",
            "}}",
            inout(reg32) acc[0],
            inout(reg32) acc[1],
            inout(reg32) acc[2],
            inout(reg32) acc[3],
            inout(reg32) acc[4],
            inout(reg32) acc[5],
            inout(reg32) acc[6],
            inout(reg32) acc[7],
            inout(reg32) acc[8],
            inout(reg32) acc[9],
            inout(reg32) acc[10],
            inout(reg32) acc[11],
            inout(reg32) acc[12],
            inout(reg32) acc[13],
            inout(reg32) acc[14],
            inout(reg32) acc[15],
            inout(reg32) acc[16],
            inout(reg32) acc[17],
            inout(reg32) acc[18],
            inout(reg32) acc[19],
            inout(reg32) acc[20],
            inout(reg32) acc[21],
            inout(reg32) acc[22],
            inout(reg32) acc[23],
            inout(reg32) acc[24],
            inout(reg32) acc[25],
            inout(reg32) acc[26],
            inout(reg32) acc[27],
            inout(reg32) acc[28],
            inout(reg32) acc[29],
            inout(reg32) acc[30],
            inout(reg32) acc[31],
            inout(reg32) acc[32],
            inout(reg32) acc[33],
            inout(reg32) acc[34],
            inout(reg32) acc[35],
            inout(reg32) acc[36],
            inout(reg32) acc[37],
            inout(reg32) acc[38],
            inout(reg32) acc[39],
            inout(reg32) acc[40],
            inout(reg32) acc[41],
            inout(reg32) acc[42],
            inout(reg32) acc[43],
            inout(reg32) acc[44],
            inout(reg32) acc[45],
            inout(reg32) acc[46],
            inout(reg32) acc[47],
            inout(reg32) acc[48],
            inout(reg32) acc[49],
            inout(reg32) acc[50],
            inout(reg32) acc[51],
            inout(reg32) acc[52],
            inout(reg32) acc[53],
            inout(reg32) acc[54],
            inout(reg32) acc[55],
            inout(reg32) acc[56],
            inout(reg32) acc[57],
            inout(reg32) acc[58],
            inout(reg32) acc[59],
            inout(reg32) acc[60],
            inout(reg32) acc[61],
            inout(reg32) acc[62],
            inout(reg32) acc[63],
            inout(reg32) acc[64],
            inout(reg32) acc[65],
            inout(reg32) acc[66],
            inout(reg32) acc[67],
            inout(reg32) acc[68],
            inout(reg32) acc[69],
            inout(reg32) acc[70],
            inout(reg32) acc[71],
            inout(reg32) acc[72],
            inout(reg32) acc[73],
            inout(reg32) acc[74],
            inout(reg32) acc[75],
            inout(reg32) acc[76],
            inout(reg32) acc[77],
            inout(reg32) acc[78],
            inout(reg32) acc[79],
            inout(reg32) acc[80],
            inout(reg32) acc[81],
            inout(reg32) acc[82],
            inout(reg32) acc[83],
            inout(reg32) acc[84],
            inout(reg32) acc[85],
            inout(reg32) acc[86],
            inout(reg32) acc[87],
            inout(reg32) acc[88],
            inout(reg32) acc[89],
            inout(reg32) acc[90],
            inout(reg32) acc[91],
            inout(reg32) acc[92],
            inout(reg32) acc[93],
            inout(reg32) acc[94],
            inout(reg32) acc[95],
            inout(reg32) acc[96],
            inout(reg32) acc[97],
            inout(reg32) acc[98],
            inout(reg32) acc[99],
            inout(reg32) acc[100],
            inout(reg32) acc[101],
            inout(reg32) acc[102],
            inout(reg32) acc[103],
            inout(reg32) acc[104],
            inout(reg32) acc[105],
            inout(reg32) acc[106],
            inout(reg32) acc[107],
            inout(reg32) acc[108],
            inout(reg32) acc[109],
            inout(reg32) acc[110],
            inout(reg32) acc[111],
            inout(reg32) acc[112],
            inout(reg32) acc[113],
            inout(reg32) acc[114],
            inout(reg32) acc[115],
            inout(reg32) acc[116],
            inout(reg32) acc[117],
            inout(reg32) acc[118],
            inout(reg32) acc[119],
            inout(reg32) acc[120],
            inout(reg32) acc[121],
            inout(reg32) acc[122],
            inout(reg32) acc[123],
            inout(reg32) acc[124],
            inout(reg32) acc[125],
            inout(reg32) acc[126],
            inout(reg32) acc[127],
            in(reg64) desc_a,
            in(reg64) desc_b,
            in(reg32) accumulate as u32,
            const TRANS_B,
            options(nostack)
        );
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
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, {66}, 0;",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}, {64}, {65}, p, 1, 1, 0, {67};",
            "}}",
            inout(reg32) acc[0],
            inout(reg32) acc[1],
            inout(reg32) acc[2],
            inout(reg32) acc[3],
            inout(reg32) acc[4],
            inout(reg32) acc[5],
            inout(reg32) acc[6],
            inout(reg32) acc[7],
            inout(reg32) acc[8],
            inout(reg32) acc[9],
            inout(reg32) acc[10],
            inout(reg32) acc[11],
            inout(reg32) acc[12],
            inout(reg32) acc[13],
            inout(reg32) acc[14],
            inout(reg32) acc[15],
            inout(reg32) acc[16],
            inout(reg32) acc[17],
            inout(reg32) acc[18],
            inout(reg32) acc[19],
            inout(reg32) acc[20],
            inout(reg32) acc[21],
            inout(reg32) acc[22],
            inout(reg32) acc[23],
            inout(reg32) acc[24],
            inout(reg32) acc[25],
            inout(reg32) acc[26],
            inout(reg32) acc[27],
            inout(reg32) acc[28],
            inout(reg32) acc[29],
            inout(reg32) acc[30],
            inout(reg32) acc[31],
            inout(reg32) acc[32],
            inout(reg32) acc[33],
            inout(reg32) acc[34],
            inout(reg32) acc[35],
            inout(reg32) acc[36],
            inout(reg32) acc[37],
            inout(reg32) acc[38],
            inout(reg32) acc[39],
            inout(reg32) acc[40],
            inout(reg32) acc[41],
            inout(reg32) acc[42],
            inout(reg32) acc[43],
            inout(reg32) acc[44],
            inout(reg32) acc[45],
            inout(reg32) acc[46],
            inout(reg32) acc[47],
            inout(reg32) acc[48],
            inout(reg32) acc[49],
            inout(reg32) acc[50],
            inout(reg32) acc[51],
            inout(reg32) acc[52],
            inout(reg32) acc[53],
            inout(reg32) acc[54],
            inout(reg32) acc[55],
            inout(reg32) acc[56],
            inout(reg32) acc[57],
            inout(reg32) acc[58],
            inout(reg32) acc[59],
            inout(reg32) acc[60],
            inout(reg32) acc[61],
            inout(reg32) acc[62],
            inout(reg32) acc[63],
            in(reg64) desc_a,
            in(reg64) desc_b,
            in(reg32) accumulate as u32,
            const TRANS_B,
            options(nostack)
        );
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
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, {69}, 0;",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}, {{{64}, {65}, {66}, {67}}}, {68}, p, 1, 1, {70};",
            "}}",
            inout(reg32) acc[0],
            inout(reg32) acc[1],
            inout(reg32) acc[2],
            inout(reg32) acc[3],
            inout(reg32) acc[4],
            inout(reg32) acc[5],
            inout(reg32) acc[6],
            inout(reg32) acc[7],
            inout(reg32) acc[8],
            inout(reg32) acc[9],
            inout(reg32) acc[10],
            inout(reg32) acc[11],
            inout(reg32) acc[12],
            inout(reg32) acc[13],
            inout(reg32) acc[14],
            inout(reg32) acc[15],
            inout(reg32) acc[16],
            inout(reg32) acc[17],
            inout(reg32) acc[18],
            inout(reg32) acc[19],
            inout(reg32) acc[20],
            inout(reg32) acc[21],
            inout(reg32) acc[22],
            inout(reg32) acc[23],
            inout(reg32) acc[24],
            inout(reg32) acc[25],
            inout(reg32) acc[26],
            inout(reg32) acc[27],
            inout(reg32) acc[28],
            inout(reg32) acc[29],
            inout(reg32) acc[30],
            inout(reg32) acc[31],
            inout(reg32) acc[32],
            inout(reg32) acc[33],
            inout(reg32) acc[34],
            inout(reg32) acc[35],
            inout(reg32) acc[36],
            inout(reg32) acc[37],
            inout(reg32) acc[38],
            inout(reg32) acc[39],
            inout(reg32) acc[40],
            inout(reg32) acc[41],
            inout(reg32) acc[42],
            inout(reg32) acc[43],
            inout(reg32) acc[44],
            inout(reg32) acc[45],
            inout(reg32) acc[46],
            inout(reg32) acc[47],
            inout(reg32) acc[48],
            inout(reg32) acc[49],
            inout(reg32) acc[50],
            inout(reg32) acc[51],
            inout(reg32) acc[52],
            inout(reg32) acc[53],
            inout(reg32) acc[54],
            inout(reg32) acc[55],
            inout(reg32) acc[56],
            inout(reg32) acc[57],
            inout(reg32) acc[58],
            inout(reg32) acc[59],
            inout(reg32) acc[60],
            inout(reg32) acc[61],
            inout(reg32) acc[62],
            inout(reg32) acc[63],
            in(reg32) a[0],
            in(reg32) a[1],
            in(reg32) a[2],
            in(reg32) a[3],
            in(reg64) desc_b,
            in(reg32) accumulate as u32,
            const TRANS_B,
            options(nostack)
        );
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
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, {37}, 0;",
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}}}, {{{32}, {33}, {34}, {35}}}, {36}, p, 1, 1, {38};",
            "}}",
            inout(reg32) acc[0],
            inout(reg32) acc[1],
            inout(reg32) acc[2],
            inout(reg32) acc[3],
            inout(reg32) acc[4],
            inout(reg32) acc[5],
            inout(reg32) acc[6],
            inout(reg32) acc[7],
            inout(reg32) acc[8],
            inout(reg32) acc[9],
            inout(reg32) acc[10],
            inout(reg32) acc[11],
            inout(reg32) acc[12],
            inout(reg32) acc[13],
            inout(reg32) acc[14],
            inout(reg32) acc[15],
            inout(reg32) acc[16],
            inout(reg32) acc[17],
            inout(reg32) acc[18],
            inout(reg32) acc[19],
            inout(reg32) acc[20],
            inout(reg32) acc[21],
            inout(reg32) acc[22],
            inout(reg32) acc[23],
            inout(reg32) acc[24],
            inout(reg32) acc[25],
            inout(reg32) acc[26],
            inout(reg32) acc[27],
            inout(reg32) acc[28],
            inout(reg32) acc[29],
            inout(reg32) acc[30],
            inout(reg32) acc[31],
            in(reg32) a[0],
            in(reg32) a[1],
            in(reg32) a[2],
            in(reg32) a[3],
            in(reg64) desc_b,
            in(reg32) accumulate as u32,
            const TRANS_B,
            options(nostack)
        );
    }
}
/// Pins the 64 registers of `acc` at this point of the program: an empty `asm!` that
/// reads and writes each of them (a PTX comment naming them; no instruction). Ordered with the other `asm!`s, it keeps
/// the compiler from moving arithmetic on an accumulator across the `wgmma.wait_group` that
/// makes it valid (the wgmma writes it asynchronously).
#[inline(always)]
pub fn fence_operands_64(acc: &mut [f32; 64]) {
    unsafe {
        asm!(
            "// {0} {1} {2} {3} {4} {5} {6} {7} {8} {9} {10} {11} {12} {13} {14} {15} {16} {17} {18} {19} {20} {21} {22} {23} {24} {25} {26} {27} {28} {29} {30} {31} {32} {33} {34} {35} {36} {37} {38} {39} {40} {41} {42} {43} {44} {45} {46} {47} {48} {49} {50} {51} {52} {53} {54} {55} {56} {57} {58} {59} {60} {61} {62} {63}",
            inout(reg32) acc[0],
            inout(reg32) acc[1],
            inout(reg32) acc[2],
            inout(reg32) acc[3],
            inout(reg32) acc[4],
            inout(reg32) acc[5],
            inout(reg32) acc[6],
            inout(reg32) acc[7],
            inout(reg32) acc[8],
            inout(reg32) acc[9],
            inout(reg32) acc[10],
            inout(reg32) acc[11],
            inout(reg32) acc[12],
            inout(reg32) acc[13],
            inout(reg32) acc[14],
            inout(reg32) acc[15],
            inout(reg32) acc[16],
            inout(reg32) acc[17],
            inout(reg32) acc[18],
            inout(reg32) acc[19],
            inout(reg32) acc[20],
            inout(reg32) acc[21],
            inout(reg32) acc[22],
            inout(reg32) acc[23],
            inout(reg32) acc[24],
            inout(reg32) acc[25],
            inout(reg32) acc[26],
            inout(reg32) acc[27],
            inout(reg32) acc[28],
            inout(reg32) acc[29],
            inout(reg32) acc[30],
            inout(reg32) acc[31],
            inout(reg32) acc[32],
            inout(reg32) acc[33],
            inout(reg32) acc[34],
            inout(reg32) acc[35],
            inout(reg32) acc[36],
            inout(reg32) acc[37],
            inout(reg32) acc[38],
            inout(reg32) acc[39],
            inout(reg32) acc[40],
            inout(reg32) acc[41],
            inout(reg32) acc[42],
            inout(reg32) acc[43],
            inout(reg32) acc[44],
            inout(reg32) acc[45],
            inout(reg32) acc[46],
            inout(reg32) acc[47],
            inout(reg32) acc[48],
            inout(reg32) acc[49],
            inout(reg32) acc[50],
            inout(reg32) acc[51],
            inout(reg32) acc[52],
            inout(reg32) acc[53],
            inout(reg32) acc[54],
            inout(reg32) acc[55],
            inout(reg32) acc[56],
            inout(reg32) acc[57],
            inout(reg32) acc[58],
            inout(reg32) acc[59],
            inout(reg32) acc[60],
            inout(reg32) acc[61],
            inout(reg32) acc[62],
            inout(reg32) acc[63],
            options(nostack, nomem)
        );
    }
}
/// Pins the 32 registers of `acc` at this point of the program: an empty `asm!` that
/// reads and writes each of them (a PTX comment naming them; no instruction). Ordered with the other `asm!`s, it keeps
/// the compiler from moving arithmetic on an accumulator across the `wgmma.wait_group` that
/// makes it valid (the wgmma writes it asynchronously).
#[inline(always)]
pub fn fence_operands_32(acc: &mut [f32; 32]) {
    unsafe {
        asm!(
            "// {0} {1} {2} {3} {4} {5} {6} {7} {8} {9} {10} {11} {12} {13} {14} {15} {16} {17} {18} {19} {20} {21} {22} {23} {24} {25} {26} {27} {28} {29} {30} {31}",
            inout(reg32) acc[0],
            inout(reg32) acc[1],
            inout(reg32) acc[2],
            inout(reg32) acc[3],
            inout(reg32) acc[4],
            inout(reg32) acc[5],
            inout(reg32) acc[6],
            inout(reg32) acc[7],
            inout(reg32) acc[8],
            inout(reg32) acc[9],
            inout(reg32) acc[10],
            inout(reg32) acc[11],
            inout(reg32) acc[12],
            inout(reg32) acc[13],
            inout(reg32) acc[14],
            inout(reg32) acc[15],
            inout(reg32) acc[16],
            inout(reg32) acc[17],
            inout(reg32) acc[18],
            inout(reg32) acc[19],
            inout(reg32) acc[20],
            inout(reg32) acc[21],
            inout(reg32) acc[22],
            inout(reg32) acc[23],
            inout(reg32) acc[24],
            inout(reg32) acc[25],
            inout(reg32) acc[26],
            inout(reg32) acc[27],
            inout(reg32) acc[28],
            inout(reg32) acc[29],
            inout(reg32) acc[30],
            inout(reg32) acc[31],
            options(nostack, nomem)
        );
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
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, 0, 0;",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}, {16}, {17}, {18}, {19}, {20}, {21}, {22}, {23}, {24}, {25}, {26}, {27}, {28}, {29}, {30}, {31}, {32}, {33}, {34}, {35}, {36}, {37}, {38}, {39}, {40}, {41}, {42}, {43}, {44}, {45}, {46}, {47}, {48}, {49}, {50}, {51}, {52}, {53}, {54}, {55}, {56}, {57}, {58}, {59}, {60}, {61}, {62}, {63}}}, {64}, {65}, p, 1, 1, 0, {66};",
            "}}",
            out(reg32) acc[0],
            out(reg32) acc[1],
            out(reg32) acc[2],
            out(reg32) acc[3],
            out(reg32) acc[4],
            out(reg32) acc[5],
            out(reg32) acc[6],
            out(reg32) acc[7],
            out(reg32) acc[8],
            out(reg32) acc[9],
            out(reg32) acc[10],
            out(reg32) acc[11],
            out(reg32) acc[12],
            out(reg32) acc[13],
            out(reg32) acc[14],
            out(reg32) acc[15],
            out(reg32) acc[16],
            out(reg32) acc[17],
            out(reg32) acc[18],
            out(reg32) acc[19],
            out(reg32) acc[20],
            out(reg32) acc[21],
            out(reg32) acc[22],
            out(reg32) acc[23],
            out(reg32) acc[24],
            out(reg32) acc[25],
            out(reg32) acc[26],
            out(reg32) acc[27],
            out(reg32) acc[28],
            out(reg32) acc[29],
            out(reg32) acc[30],
            out(reg32) acc[31],
            out(reg32) acc[32],
            out(reg32) acc[33],
            out(reg32) acc[34],
            out(reg32) acc[35],
            out(reg32) acc[36],
            out(reg32) acc[37],
            out(reg32) acc[38],
            out(reg32) acc[39],
            out(reg32) acc[40],
            out(reg32) acc[41],
            out(reg32) acc[42],
            out(reg32) acc[43],
            out(reg32) acc[44],
            out(reg32) acc[45],
            out(reg32) acc[46],
            out(reg32) acc[47],
            out(reg32) acc[48],
            out(reg32) acc[49],
            out(reg32) acc[50],
            out(reg32) acc[51],
            out(reg32) acc[52],
            out(reg32) acc[53],
            out(reg32) acc[54],
            out(reg32) acc[55],
            out(reg32) acc[56],
            out(reg32) acc[57],
            out(reg32) acc[58],
            out(reg32) acc[59],
            out(reg32) acc[60],
            out(reg32) acc[61],
            out(reg32) acc[62],
            out(reg32) acc[63],
            in(reg64) desc_a,
            in(reg64) desc_b,
            const TRANS_B,
            options(nostack)
        );
    }
}
