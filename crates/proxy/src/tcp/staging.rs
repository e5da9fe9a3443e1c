//! The GPU side of the TCP transport, behind a small trait: copies between this rank's
//! registered memory (the GPU heap) and host staging buffers, and the flag store.
use crate::emulated::CpuFabric;
use crate::error::TransportError;
use std::sync::Arc;

/// Copies between this rank's data region and host buffers, and stores into its flag array.
///
/// The real one (`crates/host`) uses pinned host buffers, `cuMemcpyDtoHAsync` /
/// `cuMemcpyHtoDAsync` and a 4-byte `cuMemsetD32Async` for flags, on streams, with one event
/// per call; [`CpuStaging`] does the same synchronously on a [`CpuFabric`] for the tests.
///
/// Contract:
/// * `write_flag` becomes visible only after the data of every earlier `to_device` call;
/// * every call's `token` is reported exactly once by `poll` once the call has completed
///   (`to_host`: the bytes are in the buffer; `to_device`: the buffer may be reused);
/// * the caller does not touch a buffer between a call that uses it and its completion.
pub trait DeviceStaging: Send {
    /// Allocates `count` host buffers of `bytes` each (pinned, for the GPU). Called once,
    /// before any copy; buffers are then named by index `0..count`.
    fn alloc_buffers(&mut self, count: usize, bytes: usize) -> Result<(), TransportError>;
    /// Host buffer `i` (valid while no call using it is in flight).
    fn buffer(&mut self, i: usize) -> &mut [u8];
    /// Starts copying `len` bytes of the local data region at `src_offset` into buffer `buf`.
    fn to_host(&mut self, token: u64, src_offset: u64, buf: usize, len: usize) -> Result<(), TransportError>;
    /// Starts copying the first `len` bytes of buffer `buf` into the local data region at `dst_offset`.
    fn to_device(&mut self, token: u64, buf: usize, dst_offset: u64, len: usize) -> Result<(), TransportError>;
    /// Stores `value` into the local flag word at `flag_offset`, after every earlier `to_device`.
    fn write_flag(&mut self, token: u64, flag_offset: u64, value: u64) -> Result<(), TransportError>;
    /// Appends the tokens of calls that completed since the last poll.
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError>;
}

/// [`DeviceStaging`] on one rank's memory in a [`CpuFabric`]: copies run at once on the calling
/// thread; the flag is a release store after them.
pub struct CpuStaging {
    fabric: Arc<CpuFabric>,
    rank: usize,
    buffers: Vec<Vec<u8>>,
    completed: Vec<u64>,
}

impl CpuStaging {
    /// Staging for `rank`'s memory in `fabric`.
    pub fn new(fabric: Arc<CpuFabric>, rank: usize) -> CpuStaging {
        CpuStaging {
            fabric,
            rank,
            buffers: Vec::new(),
            completed: Vec::new(),
        }
    }

    fn check(&self, buf: usize, len: usize) -> Result<(), TransportError> {
        match self.buffers.get(buf) {
            Some(b) if len <= b.len() => Ok(()),
            _ => Err(TransportError::Copy(format!(
                "buffer {buf} of {} cannot hold {len} bytes",
                self.buffers.len()
            ))),
        }
    }
}

impl DeviceStaging for CpuStaging {
    fn alloc_buffers(&mut self, count: usize, bytes: usize) -> Result<(), TransportError> {
        self.buffers = (0..count).map(|_| vec![0u8; bytes]).collect();
        Ok(())
    }
    fn buffer(&mut self, i: usize) -> &mut [u8] {
        &mut self.buffers[i]
    }
    fn to_host(&mut self, token: u64, src_offset: u64, buf: usize, len: usize) -> Result<(), TransportError> {
        self.check(buf, len)?;
        let bytes = self.fabric.read(self.rank, src_offset, len)?;
        self.buffers[buf][..len].copy_from_slice(&bytes);
        self.completed.push(token);
        Ok(())
    }
    fn to_device(&mut self, token: u64, buf: usize, dst_offset: u64, len: usize) -> Result<(), TransportError> {
        self.check(buf, len)?;
        self.fabric.write(self.rank, dst_offset, &self.buffers[buf][..len])?;
        self.completed.push(token);
        Ok(())
    }
    fn write_flag(&mut self, token: u64, flag_offset: u64, value: u64) -> Result<(), TransportError> {
        self.fabric.store_flag(self.rank, flag_offset, value)?;
        self.completed.push(token);
        Ok(())
    }
    fn poll(&mut self, completed: &mut Vec<u64>) -> Result<(), TransportError> {
        completed.append(&mut self.completed);
        Ok(())
    }
}
