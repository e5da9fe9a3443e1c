//! `mk_iota_u32`: out[i] = i + offset. The smallest end-to-end check of the Rust -> PTX -> launch
//! pipeline (used by the runtime tests).
use crate::arch::ids;

/// # Safety
///
/// The launch contract (`crate::kernels`); `out` is a 4-byte aligned device address of `len` writable `u32`s (the grid
/// may cover more threads than `len`: the rest write nothing).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn mk_iota_u32(out: *mut u32, len: u32, offset: u32) {
    let i = ids::block_idx() * ids::block_dim() + ids::thread_idx();
    if i < len {
        unsafe { out.add(i as usize).write(i + offset) };
    }
}
