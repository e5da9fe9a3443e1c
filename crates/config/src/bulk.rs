//! The TMA bulk-copy ring that comm CTAs run in their dynamic shared memory (device
//! `comm::bulk::BulkRing`): `BULK_STAGES` stages of `BULK_STAGE_BYTES`, one mbarrier per stage.
//! Loads run `BULK_LOOKAHEAD` pieces ahead; the other stages are read by stores in flight (a store
//! to a peer finishes reading shared memory only as NVLink takes the data, so a CTA's bandwidth
//! grows with the bytes it keeps in flight).
use core::mem::offset_of;

/// Stages of the ring.
pub const BULK_STAGES: u32 = 12;
/// Bytes per stage (a multiple of 16).
pub const BULK_STAGE_BYTES: u32 = 16 << 10;
/// Pieces loaded ahead of the one being stored.
pub const BULK_LOOKAHEAD: u32 = 3;
const _: () = assert!(BULK_STAGE_BYTES.is_multiple_of(16) && BULK_LOOKAHEAD >= 1 && BULK_LOOKAHEAD < BULK_STAGES);

/// The ring in shared memory (at offset 0 of a comm CTA's dynamic shared memory).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BulkSmem {
    pub stages: [[u8; BULK_STAGE_BYTES as usize]; BULK_STAGES as usize],
    /// One mbarrier per stage, completed by the bytes of its load.
    pub bars: [u64; BULK_STAGES as usize],
}

/// Offset of the stages' mbarriers.
pub const BULK_BARS_OFFSET: u32 = offset_of!(BulkSmem, bars) as u32;
/// Bytes of the ring.
pub const BULK_SMEM_BYTES: u32 = core::mem::size_of::<BulkSmem>() as u32;
