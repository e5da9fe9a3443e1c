//! Co-residency of the persistent grids of ranks that share one GPU.
//!
//! A fused or collective kernel waits for its peers' CTAs, so every rank's grid must be resident
//! at the same time. On a host with a GPU per rank that always holds; ranks that share a GPU
//! (NVIDIA MPS, `xtask launch --share-gpu`) hold it only while the sum of their grids fits the GPU
//! with room to spare. `Communicator::new` checks that sum here, before any kernel can wait, and
//! fails with [`Error::NotCoResident`] instead of letting the first launch time out.
use crate::error::{Error, Result};
use crate::runtime::Device;
use mkernel_bootstrap::Bootstrap;
use std::time::Duration;

/// Share of a GPU's SMs that the persistent grids of ranks sharing it may fill together.
///
/// Measured on one H100 (132 SMs, driver 580, MPS): 4 grids of 26 SMs (79%) ran together,
/// 4 grids of 33 (100%) did not (docs/testing.md, "Co-residency").
pub const SHARED_GRID_LIMIT_PERCENT: u32 = 80;

/// What one rank tells the others: its GPU, its grid, and the GPU's SMs as far as it can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    uuid: [u8; 16],
    grid: u32,
    /// The whole GPU's SMs: the reported count scaled back by this client's MPS share.
    gpu_sms: u32,
}

impl Record {
    fn to_bytes(self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..16].copy_from_slice(&self.uuid);
        b[16..20].copy_from_slice(&self.grid.to_le_bytes());
        b[20..24].copy_from_slice(&self.gpu_sms.to_le_bytes());
        b
    }
    fn from_bytes(b: &[u8]) -> Option<Record> {
        let b: &[u8; 24] = b.try_into().ok()?;
        Some(Record {
            uuid: b[..16].try_into().ok()?,
            grid: u32::from_le_bytes(b[16..20].try_into().ok()?),
            gpu_sms: u32::from_le_bytes(b[20..24].try_into().ok()?),
        })
    }
}

/// The whole GPU's SMs from the count a client sees and its MPS share (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`).
fn gpu_sms(reported: u32, mps_percent: Option<&str>) -> u32 {
    match mps_percent.and_then(|p| p.trim().parse::<f64>().ok()) {
        Some(p) if p > 0.0 && p < 100.0 => (reported as f64 * 100.0 / p).round() as u32,
        _ => reported,
    }
}

/// The first GPU whose sharing ranks' grids do not fit: `(ranks, sum of grids, GPU SMs)`.
fn overfull(records: &[Record]) -> Option<(Vec<usize>, u32, u32)> {
    for (i, r) in records.iter().enumerate() {
        let sharing: Vec<usize> = (0..records.len()).filter(|&j| records[j].uuid == r.uuid).collect();
        if sharing.len() < 2 || sharing[0] != i {
            continue;
        }
        let sum: u32 = sharing.iter().map(|&j| records[j].grid).sum();
        let sms = sharing.iter().map(|&j| records[j].gpu_sms).max().unwrap_or(0);
        if sum as u64 * 100 > sms as u64 * SHARED_GRID_LIMIT_PERCENT as u64 {
            return Some((sharing, sum, sms));
        }
    }
    None
}

/// Collective over every rank of the job: fails when ranks sharing a GPU cannot hold their
/// persistent grids resident together.
pub(crate) fn check(device: &Device, boot: &Bootstrap, timeout: Duration) -> Result<()> {
    let uuid = device.context().uuid()?;
    let mine = Record {
        uuid: uuid.bytes.map(|b| b as u8),
        grid: device.sm_count(),
        gpu_sms: gpu_sms(
            device.reported_sm_count(),
            std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").ok().as_deref(),
        ),
    };
    let all = boot
        .store()
        .all_gather("mkernel/communicator/residency", &mine.to_bytes(), timeout)?;
    let records: Vec<Record> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            Record::from_bytes(b)
                .ok_or_else(|| Error::Unsupported(format!("rank {r} sent a residency record of {} bytes", b.len())))
        })
        .collect::<Result<_>>()?;
    match overfull(&records) {
        None => Ok(()),
        Some((ranks, sum, gpu_sms)) => Err(Error::NotCoResident {
            ranks,
            ctas: sum,
            gpu_sms,
            limit_percent: SHARED_GRID_LIMIT_PERCENT,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn rec(gpu: u8, grid: u32, gpu_sms: u32) -> Record {
        Record {
            uuid: [gpu; 16],
            grid,
            gpu_sms,
        }
    }
    #[test]
    fn mps_share_scales_back_to_the_whole_gpu() {
        assert_eq!(gpu_sms(33, Some("25")), 132);
        assert_eq!(gpu_sms(66, Some("50")), 132);
        assert_eq!(gpu_sms(132, None), 132);
        assert_eq!(gpu_sms(132, Some("100")), 132);
        assert_eq!(gpu_sms(132, Some("junk")), 132);
    }
    #[test]
    fn sharing_ranks_must_leave_room() {
        // One GPU per rank: never overfull.
        assert_eq!(overfull(&[rec(0, 132, 132), rec(1, 132, 132)]), None);
        // The launcher's default for 4 ranks: 80% of a 25% share each.
        assert_eq!(
            overfull(&[rec(0, 26, 132), rec(0, 26, 132), rec(0, 26, 132), rec(0, 26, 132)]),
            None
        );
        // 4 grids filling their 25% shares: measured not to fit.
        let four_full = [rec(0, 33, 132), rec(0, 33, 132), rec(0, 33, 132), rec(0, 33, 132)];
        assert_eq!(overfull(&four_full), Some((vec![0, 1, 2, 3], 132, 132)));
        // Two ranks on one GPU without MPS shares see the whole GPU each.
        assert_eq!(
            overfull(&[rec(7, 132, 132), rec(7, 132, 132)]),
            Some((vec![0, 1], 264, 132))
        );
        // Round-robin over two GPUs: each pair is checked on its own.
        assert_eq!(
            overfull(&[rec(0, 52, 132), rec(1, 52, 132), rec(0, 52, 132), rec(1, 52, 132)]),
            None
        );
        assert!(Record::from_bytes(&rec(3, 26, 132).to_bytes()) == Some(rec(3, 26, 132)));
        assert!(Record::from_bytes(&[0u8; 5]).is_none());
    }
}
