//! Argument checks shared by the communicator and the operations: overflow-checked size
//! products, alignment, buffer lengths, and the CUDA context of streams and buffers.
use crate::error::{Error, Result};
use crate::runtime::Device;
use cudarc::driver::{CudaStream, DeviceSlice};
use std::time::Duration;

/// `factors` multiplied, or [`Error::Shape`] naming `what` when the product overflows `u64`.
pub(crate) fn product(op: &'static str, what: &str, factors: &[u64]) -> Result<u64> {
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| Error::Shape {
            op,
            reason: format!("{what} = {} overflows 64 bits", join(factors)),
        })
}

/// As [`product`], for element counts held in `usize`.
pub(crate) fn product_usize(op: &'static str, what: &str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| Error::Shape {
            op,
            reason: format!("{what} = {} overflows the address space", join(factors)),
        })
}

fn join<T: std::fmt::Display>(factors: &[T]) -> String {
    factors.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(" x ")
}

/// `d` in nanoseconds, saturating at `u64::MAX` (about 584 years).
pub(crate) fn saturating_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// 16-byte alignment of each named device address.
pub(crate) fn aligned16(op: &'static str, ptrs: &[(&'static str, u64)]) -> Result<()> {
    for &(what, ptr) in ptrs {
        if ptr % 16 != 0 {
            return Err(Error::Alignment {
                op,
                what,
                ptr,
                align: 16,
            });
        }
    }
    Ok(())
}

/// Every `(what, have, need)` buffer holds at least `need` elements.
pub(crate) fn lens(op: &'static str, buffers: &[(&'static str, usize, usize)]) -> Result<()> {
    buffers
        .iter()
        .try_for_each(|&(what, have, need)| len(op, what, have, need))
}

/// Every `(what, have, need)` buffer holds exactly `need` elements (a plan built for one shape).
pub(crate) fn exact_lens(op: &'static str, buffers: &[(&'static str, usize, usize)]) -> Result<()> {
    for &(what, have, need) in buffers {
        if have != need {
            return Err(Error::Shape {
                op,
                reason: format!("{what} holds {have} elements; the plan's shape needs exactly {need}"),
            });
        }
    }
    Ok(())
}

/// A buffer of `have` elements holds at least `need`.
pub(crate) fn len(op: &'static str, what: &'static str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(Error::BufferTooSmall { op, what, have, need });
    }
    Ok(())
}

/// A buffer of `have` elements holds at least the product of `dims` (named `dims_what` in the
/// overflow error).
pub(crate) fn len_of(op: &'static str, what: &'static str, have: usize, dims_what: &str, dims: &[usize]) -> Result<()> {
    len(op, what, have, product_usize(op, dims_what, dims)?)
}

/// `stream` belongs to `device`'s CUDA context.
pub(crate) fn stream_on(op: &'static str, device: &Device, stream: &CudaStream) -> Result<()> {
    if stream.context().cu_ctx() != device.context().cu_ctx() {
        return Err(Error::ForeignContext { op, what: "stream" });
    }
    Ok(())
}

/// `stream` is not capturing a CUDA graph (safe launches; `alternative` names the unsafe form).
pub(crate) fn not_capturing(op: &'static str, stream: &CudaStream, alternative: &'static str) -> Result<()> {
    use cudarc::driver::sys::CUstreamCaptureStatus;
    if stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(Error::Capturing { op, alternative });
    }
    Ok(())
}

/// `buf` (a cudarc slice or view) was allocated in `device`'s CUDA context.
pub(crate) fn buffer_on<T, S: DeviceSlice<T> + ?Sized>(
    op: &'static str,
    what: &'static str,
    device: &Device,
    buf: &S,
) -> Result<()> {
    if buf.stream().context().cu_ctx() != device.context().cu_ctx() {
        return Err(Error::ForeignContext { op, what });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_overflow_into_shape_errors() {
        assert_eq!(product("t", "x", &[3, 5, 7]).unwrap(), 105);
        assert_eq!(product("t", "x", &[]).unwrap(), 1);
        let e = product("t", "count x size x world", &[u64::MAX / 2, 2, 2]).unwrap_err();
        assert!(
            matches!(&e, Error::Shape { reason, .. } if reason.contains("count x size x world") && reason.contains("overflows")),
            "{e}"
        );
        assert!(product_usize("t", "m x k", &[usize::MAX, 2]).is_err());
    }

    #[test]
    fn durations_saturate() {
        assert_eq!(saturating_nanos(Duration::from_secs(2)), 2_000_000_000);
        assert_eq!(saturating_nanos(Duration::MAX), u64::MAX);
        assert_eq!(
            saturating_nanos(Duration::from_secs(u64::MAX / 1_000_000_000 + 1)),
            u64::MAX
        );
    }

    #[test]
    fn alignment_and_lengths() {
        assert!(aligned16("t", &[("A", 256), ("B", 0)]).is_ok());
        assert!(matches!(
            aligned16("t", &[("A", 256), ("B", 8)]),
            Err(Error::Alignment { what: "B", ptr: 8, .. })
        ));
        assert!(len("t", "A", 10, 10).is_ok());
        assert!(matches!(
            len("t", "A", 9, 10),
            Err(Error::BufferTooSmall { have: 9, need: 10, .. })
        ));
    }
}
