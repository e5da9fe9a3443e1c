//! Where a FIFO lives, and word-level access to it with the orderings of the protocol.
//!
//! [`FifoMemory`] abstracts the buffer: [`HeapFifo`] is an ordinary 64-byte aligned heap
//! allocation (CPU tests play the GPU with threads), [`RawFifo`] wraps memory someone else
//! allocated (the real FIFO: a `cuMemHostAlloc`'d, device-mapped buffer). [`Fifo`] is a cheap,
//! cloneable handle over either that reads and writes the shared words with std atomics created
//! in place (`AtomicU64::from_ptr`), so the same code serves both.
use crate::error::{ErrorCode, ProxyError};
use crate::protocol::{
    fifo_bytes, offsets, CommandBody, ErrorRecord, FifoHeader, ERROR_MSG_BYTES, FIFO_HEADER_BYTES, FIFO_MAGIC,
    MAX_CAPACITY, MIN_CAPACITY, PROTOCOL_VERSION, SLOT_BYTES,
};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::mem::offset_of;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// Memory holding one FIFO ([`fifo_bytes`]`(capacity)` bytes laid out as in [`crate::protocol`]).
///
/// # Safety
/// Implementors guarantee that `base()` is non-null, 64-byte aligned, valid for reads and
/// writes of `fifo_bytes(capacity())` bytes for as long as the value lives, and that the memory
/// is only touched by parties that follow the protocol (atomic accesses to the shared words).
pub unsafe trait FifoMemory: Send + Sync + 'static {
    /// First byte of the FIFO (the header).
    fn base(&self) -> NonNull<u8>;
    /// Number of slots.
    fn capacity(&self) -> u32;
}

fn check_capacity(capacity: u32) -> Result<(), ProxyError> {
    if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        return Err(ProxyError::InvalidFifo(format!(
            "capacity {capacity} is not a power of two in {MIN_CAPACITY}..={MAX_CAPACITY}"
        )));
    }
    Ok(())
}

/// A FIFO in an ordinary heap allocation (zeroed, header initialized).
pub struct HeapFifo {
    ptr: NonNull<u8>,
    layout: Layout,
    capacity: u32,
}

// SAFETY: the allocation is owned and only accessed through the protocol's atomics.
unsafe impl Send for HeapFifo {}
// SAFETY: as above.
unsafe impl Sync for HeapFifo {}

impl HeapFifo {
    /// Allocates a FIFO of `capacity` slots (a power of two) owned by `rank`.
    pub fn new(capacity: u32, rank: u32) -> Result<HeapFifo, ProxyError> {
        check_capacity(capacity)?;
        let layout = Layout::from_size_align(fifo_bytes(capacity), SLOT_BYTES)
            .map_err(|e| ProxyError::InvalidFifo(e.to_string()))?;
        // SAFETY: the layout has a nonzero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| ProxyError::InvalidFifo(format!("allocation of {} bytes failed", layout.size())))?;
        // SAFETY: freshly allocated, aligned, large enough, not shared yet.
        unsafe { ptr.as_ptr().cast::<FifoHeader>().write(FifoHeader::new(capacity, rank)) };
        Ok(HeapFifo { ptr, layout, capacity })
    }
}

impl Drop for HeapFifo {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: see `HeapFifo::new`.
unsafe impl FifoMemory for HeapFifo {
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }
    fn capacity(&self) -> u32 {
        self.capacity
    }
}

/// A FIFO in memory allocated elsewhere (the real one: host-mapped pinned memory).
pub struct RawFifo {
    ptr: NonNull<u8>,
    capacity: u32,
}

// SAFETY: the creator promised (in `from_raw`) that the memory outlives this value and is used per protocol.
unsafe impl Send for RawFifo {}
// SAFETY: as above.
unsafe impl Sync for RawFifo {}

impl RawFifo {
    /// Writes a fresh header (magic, version, capacity, rank, zero counters) and zeroes every
    /// slot of the FIFO at `ptr`. Call once, before any kernel that uses it is launched.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of [`fifo_bytes`]`(capacity)` bytes, 64-byte aligned, and
    /// nobody else may access the memory during the call.
    pub unsafe fn init(ptr: *mut u8, capacity: u32, rank: u32) -> Result<(), ProxyError> {
        check_capacity(capacity)?;
        if ptr.is_null() || (ptr as usize) & (SLOT_BYTES - 1) != 0 {
            return Err(ProxyError::InvalidFifo(format!(
                "FIFO pointer {ptr:p} is null or not 64-byte aligned"
            )));
        }
        // SAFETY: guaranteed by the caller.
        unsafe {
            std::ptr::write_bytes(ptr, 0, fifo_bytes(capacity));
            ptr.cast::<FifoHeader>().write(FifoHeader::new(capacity, rank));
        }
        Ok(())
    }

    /// Wraps an initialized FIFO (see [`RawFifo::init`]) of `capacity` slots at `ptr`.
    /// The header's magic, version and capacity are checked by [`Fifo::new`].
    ///
    /// # Safety
    /// `ptr` must stay valid for reads and writes of [`fifo_bytes`]`(capacity)` bytes for the
    /// whole life of the returned value (and of every [`Fifo`] made from it), be 64-byte
    /// aligned, and be accessed by others only as the protocol says.
    pub unsafe fn from_raw(ptr: *mut u8, capacity: u32) -> Result<RawFifo, ProxyError> {
        check_capacity(capacity)?;
        let ptr = NonNull::new(ptr).ok_or_else(|| ProxyError::InvalidFifo("null FIFO pointer".into()))?;
        if (ptr.as_ptr() as usize) & (SLOT_BYTES - 1) != 0 {
            return Err(ProxyError::InvalidFifo(format!(
                "FIFO pointer {:p} is not 64-byte aligned",
                ptr.as_ptr()
            )));
        }
        Ok(RawFifo { ptr, capacity })
    }
}

// SAFETY: guaranteed by the caller of `from_raw`.
unsafe impl FifoMemory for RawFifo {
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }
    fn capacity(&self) -> u32 {
        self.capacity
    }
}

/// A shared handle on a FIFO: the protocol's loads and stores on its words.
///
/// Cloning is cheap (an `Arc`); the consumer, the producers of CPU tests and the host's
/// monitoring code each hold one.
pub struct Fifo<M: FifoMemory> {
    mem: Arc<M>,
    mask: u64,
}

impl<M: FifoMemory> Clone for Fifo<M> {
    fn clone(&self) -> Self {
        Fifo {
            mem: self.mem.clone(),
            mask: self.mask,
        }
    }
}

impl<M: FifoMemory> Fifo<M> {
    /// Checks the header of `mem` (magic, version, capacity) and returns a handle.
    pub fn new(mem: M) -> Result<Self, ProxyError> {
        check_capacity(mem.capacity())?;
        let f = Fifo {
            mask: u64::from(mem.capacity()) - 1,
            mem: Arc::new(mem),
        };
        let (magic, version, cap) = (
            f.u32_at(offsets::MAGIC).load(Ordering::Acquire),
            f.u32_at(offsets::VERSION).load(Ordering::Acquire),
            f.u32_at(offsets::CAPACITY).load(Ordering::Acquire),
        );
        if magic != FIFO_MAGIC {
            return Err(ProxyError::InvalidFifo(format!(
                "magic {magic:#010x}, expected {FIFO_MAGIC:#010x} (was RawFifo::init called?)"
            )));
        }
        if version != PROTOCOL_VERSION {
            return Err(ProxyError::InvalidFifo(format!(
                "protocol version {version}, this proxy speaks {PROTOCOL_VERSION}"
            )));
        }
        if cap != f.mem.capacity() {
            return Err(ProxyError::InvalidFifo(format!(
                "header says {cap} slots, memory has {}",
                f.mem.capacity()
            )));
        }
        Ok(f)
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off & 7 == 0 && off + 8 <= fifo_bytes(self.mem.capacity()));
        // SAFETY: in bounds and 8-byte aligned (offsets come from the layout); the memory lives
        // as long as `self.mem`; every access to this word is atomic.
        unsafe { AtomicU64::from_ptr(self.mem.base().as_ptr().add(off).cast()) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off & 3 == 0 && off + 4 <= fifo_bytes(self.mem.capacity()));
        // SAFETY: as in `u64_at`.
        unsafe { AtomicU32::from_ptr(self.mem.base().as_ptr().add(off).cast()) }
    }

    fn slot_offset(&self, seq: u64) -> usize {
        FIFO_HEADER_BYTES + ((seq & self.mask) as usize) * SLOT_BYTES
    }

    /// Number of slots.
    pub fn capacity(&self) -> u32 {
        self.mem.capacity()
    }

    /// The rank written into the header at initialization.
    pub fn rank(&self) -> u32 {
        self.u32_at(offsets::RANK).load(Ordering::Relaxed)
    }

    /// Address of the FIFO (what the device is given, after mapping).
    pub fn base_ptr(&self) -> *mut u8 {
        self.mem.base().as_ptr()
    }

    /// The producers' claim counter.
    pub fn head(&self) -> &AtomicU64 {
        self.u64_at(offsets::HEAD)
    }

    /// The consumer's tail (next sequence number to consume).
    pub fn tail(&self) -> &AtomicU64 {
        self.u64_at(offsets::TAIL)
    }

    /// The local-completion watermark.
    pub fn done(&self) -> &AtomicU64 {
        self.u64_at(offsets::DONE)
    }

    /// The abort word.
    pub fn abort_word(&self) -> &AtomicU32 {
        self.u32_at(offsets::ABORT)
    }

    /// The commit word of the slot that sequence number `seq` maps to.
    pub fn slot_header(&self, seq: u64) -> &AtomicU64 {
        self.u64_at(self.slot_offset(seq))
    }

    /// Reads the body of `seq`'s slot.
    ///
    /// # Safety
    /// The caller must have observed `slot_header(seq) == seq + 1` with an acquire load and the
    /// producer must not write the slot until the consumer releases it (the protocol's rule).
    pub unsafe fn read_body(&self, seq: u64) -> CommandBody {
        // SAFETY: in bounds, aligned; no concurrent writer by the caller's guarantee.
        unsafe { self.body_ptr(seq).read_volatile() }
    }

    /// The body of `seq`'s slot (in bounds and aligned for every `seq`).
    fn body_ptr(&self, seq: u64) -> *mut CommandBody {
        let off = self.slot_offset(seq) + offsets::CMD_BODY;
        // SAFETY: `slot_offset` is inside the mapping and a slot holds a whole command.
        unsafe { self.mem.base().as_ptr().add(off).cast::<CommandBody>() }
    }

    /// Writes the body of `seq`'s slot (the producer's step 3).
    ///
    /// # Safety
    /// The caller must own slot `seq`: it claimed `seq` from `head` and saw
    /// `seq - tail < capacity` with an acquire load, and has not committed it yet.
    pub unsafe fn write_body(&self, seq: u64, body: &CommandBody) {
        // SAFETY: in bounds, aligned; the caller owns the slot.
        unsafe { self.body_ptr(seq).write_volatile(*body) }
    }

    /// The abort code (0 while running), with acquire ordering.
    pub fn abort_code(&self) -> u32 {
        self.abort_word().load(Ordering::Acquire)
    }

    /// Writes the error record and raises `abort`, unless someone already did; returns whether
    /// this call did. Never blocks.
    pub fn raise_abort(&self, code: ErrorCode, rank: u32, seq: u64, message: &str) -> bool {
        if self
            .u32_at(offsets::ERROR_CLAIM)
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let e = offsets::ERROR;
        self.u32_at(e + offset_of!(ErrorRecord, code))
            .store(code as u32, Ordering::Relaxed);
        self.u32_at(e + offset_of!(ErrorRecord, rank))
            .store(rank, Ordering::Relaxed);
        self.u64_at(e + offset_of!(ErrorRecord, seq))
            .store(seq, Ordering::Relaxed);
        let mut n = message.len().min(ERROR_MSG_BYTES);
        while !message.is_char_boundary(n) {
            n -= 1;
        }
        let msg_base = e + offset_of!(ErrorRecord, msg);
        for (i, b) in message.as_bytes()[..n].iter().enumerate() {
            // SAFETY: in bounds of the record's message; byte atomics need no alignment.
            unsafe { AtomicU8::from_ptr(self.mem.base().as_ptr().add(msg_base + i)) }.store(*b, Ordering::Relaxed);
        }
        self.u32_at(e + offset_of!(ErrorRecord, msg_len))
            .store(n as u32, Ordering::Relaxed);
        self.abort_word().store(code as u32, Ordering::Release);
        true
    }

    /// The error record, once `abort` is nonzero.
    pub fn error_record(&self) -> Option<ErrorRecord> {
        if self.abort_code() == 0 {
            return None;
        }
        let e = offsets::ERROR;
        let mut rec = ErrorRecord {
            code: self.u32_at(e + offset_of!(ErrorRecord, code)).load(Ordering::Relaxed),
            rank: self.u32_at(e + offset_of!(ErrorRecord, rank)).load(Ordering::Relaxed),
            seq: self.u64_at(e + offset_of!(ErrorRecord, seq)).load(Ordering::Relaxed),
            msg_len: self
                .u32_at(e + offset_of!(ErrorRecord, msg_len))
                .load(Ordering::Relaxed),
            ..Default::default()
        };
        let msg_base = e + offset_of!(ErrorRecord, msg);
        for (i, b) in rec.msg.iter_mut().enumerate() {
            // SAFETY: in bounds of the record's message.
            *b = unsafe { AtomicU8::from_ptr(self.mem.base().as_ptr().add(msg_base + i)) }.load(Ordering::Relaxed);
        }
        Some(rec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_fifo_header_is_initialized() {
        let f = Fifo::new(HeapFifo::new(16, 3).unwrap()).unwrap();
        assert_eq!((f.capacity(), f.rank()), (16, 3));
        assert_eq!(f.base_ptr() as usize % 64, 0);
        assert_eq!(f.tail().load(Ordering::Relaxed), 0);
        assert!(f.error_record().is_none());
    }

    #[test]
    fn bad_capacities_are_refused() {
        assert!(HeapFifo::new(3, 0).is_err());
        assert!(HeapFifo::new(1, 0).is_err());
        assert!(HeapFifo::new(MAX_CAPACITY * 2, 0).is_err());
    }

    #[test]
    fn raw_fifo_checks_magic_and_alignment() {
        let heap = HeapFifo::new(8, 0).unwrap();
        let p = heap.base().as_ptr();
        // SAFETY: `heap` outlives the RawFifo handles below.
        unsafe {
            assert!(RawFifo::from_raw(p.add(8), 8).is_err());
            p.cast::<u32>().add(offsets::MAGIC / 4).write(0);
            assert!(Fifo::new(RawFifo::from_raw(p, 8).unwrap()).is_err());
            RawFifo::init(p, 8, 5).unwrap();
            let f = Fifo::new(RawFifo::from_raw(p, 8).unwrap()).unwrap();
            assert_eq!(f.rank(), 5);
            assert!(Fifo::new(RawFifo::from_raw(p, 4).unwrap()).is_err());
        }
        drop(heap);
    }

    #[test]
    fn only_the_first_abort_writes_the_record() {
        let f = Fifo::new(HeapFifo::new(4, 1).unwrap()).unwrap();
        let long = "é".repeat(100);
        assert!(f.raise_abort(ErrorCode::BadOpcode, 1, 7, &long));
        assert!(!f.raise_abort(ErrorCode::HostAbort, 2, 9, "second"));
        let r = f.error_record().unwrap();
        assert_eq!((r.code, r.rank, r.seq), (ErrorCode::BadOpcode as u32, 1, 7));
        assert!(r.msg_len as usize <= ERROR_MSG_BYTES && r.message().chars().all(|c| c == 'é'));
        assert_eq!(f.abort_code(), ErrorCode::BadOpcode as u32);
    }
}
