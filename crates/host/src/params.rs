//! Launch-parameter blocks: a kernel's arguments, tensor maps included, passed by value at
//! launch instead of uploaded into a device buffer.
//!
//! A launch builds its block from the buffers it is given, so nothing is allocated, uploaded or
//! synchronized, the buffers' cudarc guards are held exactly for the launch, and a CUDA graph
//! that captures the launch keeps its own copy of the block (it outlives nothing of the plan's).
//! The kernel reads the block in place through its generic address (`arch::param` in
//! crates/device); the PTX declares it 64-byte aligned so tensor maps at 64-byte offsets are
//! valid TMA descriptors (crates/ptx-linker, `PARAM_BLOCK_ALIGN`).
use cudarc::driver::DeviceRepr;

/// Largest parameter block a kernel takes (the driver's limit for all of a kernel's parameters
/// is 4 KiB before CUDA 12.1; blocks stay below it).
pub const MAX_PARAM_BYTES: usize = mkernel_config::MAX_PARAM_BYTES;

/// A `#[repr(C)]` plain-data block (`T: Pod`) passed by value as a kernel's parameter.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct ParamBlock<T: bytemuck::Pod>(pub T);

// SAFETY: `T` is plain data (`Pod`: no padding, no pointers the driver would need to follow,
// any bit pattern valid) and `ParamBlock` is transparent over it, so the driver's byte copy of
// `size_of::<T>()` bytes is the block the kernel declares.
unsafe impl<T: bytemuck::Pod> DeviceRepr for ParamBlock<T> {}

impl<T: bytemuck::Pod> ParamBlock<T> {
    /// The block, checked against the parameter limit at compile time.
    pub const fn new(t: T) -> Self {
        assert!(
            std::mem::size_of::<T>() <= MAX_PARAM_BYTES,
            "parameter block above 4 KiB"
        );
        ParamBlock(t)
    }
}
