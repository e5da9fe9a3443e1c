//! Timing model of one NIC's egress link: serialization at a bandwidth cap, then a latency.
use crate::error::TransportError;
use std::time::{Duration, Instant};

/// Bandwidth and latency of the emulated wire.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WireModel {
    /// Egress bandwidth in bytes per second; 0 means unlimited.
    pub bytes_per_sec: f64,
    /// One-way latency added after serialization.
    pub latency: Duration,
}

impl WireModel {
    /// A 400 Gb/s NIC (ConnectX-7): 50 GB/s, 2 us one-way.
    pub const fn nic_400g() -> WireModel {
        WireModel {
            bytes_per_sec: 50e9,
            latency: Duration::from_micros(2),
        }
    }

    /// No cap and no latency (the copy engine's own speed).
    pub const fn unlimited() -> WireModel {
        WireModel {
            bytes_per_sec: 0.0,
            latency: Duration::ZERO,
        }
    }

    /// `nic_400g` changed by `MKERNEL_EMU_GBPS` (gigabits per second, 0 = unlimited) and
    /// `MKERNEL_EMU_LATENCY_US` (microseconds, fractional allowed).
    pub fn from_env() -> Result<WireModel, TransportError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`from_env`](Self::from_env) with the variables given by `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<WireModel, TransportError> {
        let mut m = WireModel::nic_400g();
        let num = |k: &str, v: String| -> Result<f64, TransportError> {
            match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
                _ => Err(TransportError::Config(format!(
                    "{k}={v:?} is not a non-negative number"
                ))),
            }
        };
        if let Some(v) = get("MKERNEL_EMU_GBPS") {
            m.bytes_per_sec = num("MKERNEL_EMU_GBPS", v)? * 1e9 / 8.0;
        }
        if let Some(v) = get("MKERNEL_EMU_LATENCY_US") {
            let us = num("MKERNEL_EMU_LATENCY_US", v.clone())?;
            m.latency = Duration::try_from_secs_f64(us * 1e-6)
                .map_err(|_| TransportError::Config(format!("MKERNEL_EMU_LATENCY_US={v:?} is out of range")))?;
        }
        Ok(m)
    }

    /// Time to serialize `bytes` onto the link (at most a day, for absurdly small caps).
    pub fn serialization(&self, bytes: u64) -> Duration {
        const DAY: Duration = Duration::from_secs(86_400);
        if self.bytes_per_sec <= 0.0 || !self.bytes_per_sec.is_finite() {
            Duration::ZERO
        } else {
            Duration::try_from_secs_f64(bytes as f64 / self.bytes_per_sec).map_or(DAY, |d| d.min(DAY))
        }
    }
}

/// One egress link: messages leave one after another.
#[derive(Clone, Debug)]
pub struct Link {
    model: WireModel,
    free_at: Option<Instant>,
}

impl Link {
    /// An idle link.
    pub fn new(model: WireModel) -> Link {
        Link { model, free_at: None }
    }

    /// The model.
    pub fn model(&self) -> WireModel {
        self.model
    }

    /// Schedules a message of `bytes` sent at `now`; returns when it has fully arrived.
    /// Arrival times are nondecreasing in the order of calls.
    pub fn schedule(&mut self, now: Instant, bytes: u64) -> Instant {
        let start = match self.free_at {
            Some(f) if f > now => f,
            _ => now,
        };
        let end = start.checked_add(self.model.serialization(bytes)).unwrap_or(start);
        self.free_at = Some(end);
        end.checked_add(self.model.latency).unwrap_or(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn serialization_queues_behind_earlier_messages() {
        let mut l = Link::new(WireModel {
            bytes_per_sec: 1e6,
            latency: Duration::from_micros(10),
        });
        let t0 = Instant::now();
        let a = l.schedule(t0, 1000); // 1 ms on the wire
        let b = l.schedule(t0, 500); // waits for a
        assert_eq!(a - t0, Duration::from_micros(1010));
        assert_eq!(b - t0, Duration::from_micros(1510));
        let later = t0 + Duration::from_millis(5);
        assert_eq!(l.schedule(later, 0) - later, Duration::from_micros(10));
    }

    #[test]
    fn environment_overrides() {
        let m: HashMap<&str, &str> = [("MKERNEL_EMU_GBPS", "8"), ("MKERNEL_EMU_LATENCY_US", "1.5")].into();
        let w = WireModel::from_vars(|k| m.get(k).map(|s| s.to_string())).unwrap();
        assert_eq!(w.bytes_per_sec, 1e9);
        assert_eq!(w.latency, Duration::from_nanos(1500));
        assert!(WireModel::from_vars(|_| Some("-1".into())).is_err());
        assert_eq!(WireModel::from_vars(|_| None).unwrap(), WireModel::nic_400g());
        assert_eq!(WireModel::unlimited().serialization(1 << 30), Duration::ZERO);
    }
}
