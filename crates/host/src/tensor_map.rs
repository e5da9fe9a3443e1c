//! TMA descriptors (`CUtensorMap`) for the kernels' 2D bf16 tiles, encoded with
//! `cuTensorMapEncodeTiled`. The kernels read them from global memory by pointer (a 128-byte,
//! 64-byte aligned struct cannot be a kernel parameter of rustc's nvptx ABI).
use crate::error::{Error, Result};
use cudarc::driver::sys;

/// One encoded descriptor.
pub type TensorMap = sys::CUtensorMap;

/// The descriptor's 128 bytes, as the kernels read them from global memory.
pub fn bytes(m: &TensorMap) -> &[u8] {
    bytemuck::cast_slice(&m.opaque)
}

/// A row-major 2D bf16 tensor as TMA sees it.
#[derive(Clone, Copy, Debug)]
pub struct Tensor2d {
    /// Device address of element (0, 0); 16-byte aligned.
    pub ptr: u64,
    /// Elements per row (the contiguous dimension).
    pub cols: u64,
    /// Rows.
    pub rows: u64,
    /// Bytes between rows; a multiple of 16.
    pub row_stride_bytes: u64,
}

/// Encodes a descriptor for boxes of `box_rows x box_cols` bf16 elements with 128-byte swizzle
/// (so `box_cols * 2` must be 128) and zero fill outside the tensor.
pub fn encode_bf16_sw128(t: Tensor2d, box_cols: u32, box_rows: u32) -> Result<TensorMap> {
    let bad = |reason: String| Error::Shape {
        op: "tensor map",
        reason,
    };
    crate::check::aligned16("tensor map", &[("tensor", t.ptr)])?;
    if t.row_stride_bytes % 16 != 0 {
        return Err(bad(format!(
            "row stride {} bytes is not a multiple of 16 (row length must be a multiple of 8 bf16)",
            t.row_stride_bytes
        )));
    }
    sw128_box(box_cols, box_rows)?;
    if t.cols == 0 || t.rows == 0 || t.cols >= 1 << 32 || t.rows >= 1 << 32 {
        return Err(bad(format!("{}x{} tensor is empty or too large", t.rows, t.cols)));
    }
    encode_tiled(t.ptr, [t.cols, t.rows], &[t.row_stride_bytes], [box_cols, box_rows])
}

/// [`encode_bf16_sw128`] of a packed row-major `rows x cols` bf16 tensor (rows `2 cols` bytes
/// apart), the layout of every 2D operand the plans map.
pub fn encode_bf16_sw128_packed(ptr: u64, cols: u64, rows: u64, box_cols: u32, box_rows: u32) -> Result<TensorMap> {
    encode_bf16_sw128(
        Tensor2d {
            ptr,
            cols,
            rows,
            row_stride_bytes: 2 * cols,
        },
        box_cols,
        box_rows,
    )
}

/// A bf16 tensor `[rows][heads][cols]` (cols contiguous) as a 3D TMA tensor.
#[derive(Clone, Copy, Debug)]
pub struct Tensor3d {
    /// Device address of element (0, 0, 0); 16-byte aligned.
    pub ptr: u64,
    /// Elements per head row (the contiguous dimension).
    pub cols: u64,
    pub heads: u64,
    pub rows: u64,
}

/// Encodes a descriptor of a packed [`Tensor3d`] for boxes of `box_rows x 1 x box_cols` with
/// 128-byte swizzle (`box_cols * 2 == 128`) and zero fill outside the tensor: one box is
/// `box_rows` rows of one head's `box_cols` columns.
pub fn encode_bf16_sw128_3d(t: Tensor3d, box_cols: u32, box_rows: u32) -> Result<TensorMap> {
    let bad = |reason: String| Error::Shape {
        op: "tensor map",
        reason,
    };
    crate::check::aligned16("tensor map", &[("tensor", t.ptr)])?;
    if (t.cols * 2) % 16 != 0 {
        return Err(bad(format!(
            "head row of {} bf16 is not a multiple of 16 bytes",
            t.cols
        )));
    }
    sw128_box(box_cols, box_rows)?;
    if t.cols == 0 || t.heads == 0 || t.rows == 0 || t.rows >= 1 << 31 || t.heads >= 1 << 16 {
        return Err(bad(format!(
            "{}x{}x{} tensor is empty or too large",
            t.rows, t.heads, t.cols
        )));
    }
    encode_tiled(
        t.ptr,
        [t.cols, t.heads, t.rows],
        &[t.cols * 2, t.heads * t.cols * 2],
        [box_cols, 1, box_rows],
    )
}

/// A box of `box_rows x box_cols` bf16 fits 128-byte swizzle: 128-byte rows, 1 to 256 of them.
fn sw128_box(box_cols: u32, box_rows: u32) -> Result<()> {
    if box_cols * 2 != 128 || box_rows == 0 || box_rows > 256 {
        return Err(Error::Shape {
            op: "tensor map",
            reason: format!("box {box_rows}x{box_cols} does not fit 128-byte swizzle"),
        });
    }
    Ok(())
}

/// `cuTensorMapEncodeTiled` for a bf16 tensor of rank `R` (dimension 0 contiguous): 128-byte
/// swizzle, 256-byte L2 promotion, zero fill outside the tensor, unit element strides. The
/// callers have checked alignment, strides and box sizes.
fn encode_tiled<const R: usize>(ptr: u64, dims: [u64; R], strides: &[u64], boxes: [u32; R]) -> Result<TensorMap> {
    assert_eq!(strides.len() + 1, R, "a rank-{R} tensor map takes {} strides", R - 1);
    let mut map = TensorMap { opaque: [0; 16] };
    let elem_strides = [1u32; R];
    // SAFETY: dims, boxes and elem_strides have R entries and strides R - 1 (asserted above), as
    // the driver reads for rank R; map is writable and 64-aligned.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            R as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?;
    }
    Ok(map)
}
