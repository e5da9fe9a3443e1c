//! Settings of the RC backend (defaults, environment overrides, invariants).
use crate::error::TransportError;
use std::time::Duration;

/// RC queue-pair settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RcConfig {
    /// Queue pairs per peer; commands are striped over them (`MKERNEL_IB_QPS_PER_PEER`, 1).
    pub qps_per_peer: usize,
    /// Request a completion every this many work requests (`MKERNEL_IB_SIGNAL_EVERY`, 16).
    pub signal_every: u32,
    /// Send queue depth per queue pair (`MKERNEL_IB_SQ_DEPTH`, 512).
    pub sq_depth: u32,
    /// Largest RDMA write; bigger puts are split (1 GiB).
    pub max_msg: u64,
    /// GID index (`MKERNEL_IB_GID_INDEX`; default: 0 on InfiniBand, chosen from sysfs on RoCE).
    pub gid_index: Option<u32>,
    /// Local ACK timeout exponent, 4.096 us * 2^t (`MKERNEL_IB_TIMEOUT`, 18 ~ 1 s).
    pub ack_timeout: u8,
    /// Transport retries (7).
    pub retry_cnt: u8,
    /// Service level (`MKERNEL_IB_SL`, 0).
    pub service_level: u8,
    /// Traffic class (`MKERNEL_IB_TC`, 0).
    pub traffic_class: u8,
    /// Give up waiting for completions after this long (30 s).
    pub wait_timeout: Duration,
    /// When nothing was posted for this long and a queue pair's last request is unsignalled,
    /// post a signalled zero-byte probe so `done` catches up (100 us).
    pub idle_probe_after: Duration,
}

impl Default for RcConfig {
    fn default() -> Self {
        RcConfig {
            qps_per_peer: 1,
            signal_every: 16,
            sq_depth: 512,
            max_msg: 1 << 30,
            gid_index: None,
            ack_timeout: 18,
            retry_cnt: 7,
            service_level: 0,
            traffic_class: 0,
            wait_timeout: Duration::from_secs(30),
            idle_probe_after: Duration::from_micros(100),
        }
    }
}

fn parse<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, TransportError> {
    v.trim()
        .parse()
        .map_err(|_| TransportError::Config(format!("{k}={v:?} is not a valid number")))
}

impl RcConfig {
    /// Defaults changed by the `MKERNEL_IB_*` variables.
    pub fn from_env() -> Result<RcConfig, TransportError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`from_env`](Self::from_env) with the variables given by `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<RcConfig, TransportError> {
        let mut c = RcConfig::default();
        if let Some(v) = get("MKERNEL_IB_QPS_PER_PEER") {
            c.qps_per_peer = parse("MKERNEL_IB_QPS_PER_PEER", &v)?;
        }
        if let Some(v) = get("MKERNEL_IB_SIGNAL_EVERY") {
            c.signal_every = parse("MKERNEL_IB_SIGNAL_EVERY", &v)?;
        }
        if let Some(v) = get("MKERNEL_IB_SQ_DEPTH") {
            c.sq_depth = parse("MKERNEL_IB_SQ_DEPTH", &v)?;
        }
        if let Some(v) = get("MKERNEL_IB_GID_INDEX") {
            c.gid_index = Some(parse("MKERNEL_IB_GID_INDEX", &v)?);
        }
        if let Some(v) = get("MKERNEL_IB_TIMEOUT") {
            c.ack_timeout = parse("MKERNEL_IB_TIMEOUT", &v)?;
        }
        if let Some(v) = get("MKERNEL_IB_SL") {
            c.service_level = parse("MKERNEL_IB_SL", &v)?;
        }
        if let Some(v) = get("MKERNEL_IB_TC") {
            c.traffic_class = parse("MKERNEL_IB_TC", &v)?;
        }
        c.check()?;
        Ok(c)
    }

    /// Checks the invariants the backend relies on.
    pub fn check(&self) -> Result<(), TransportError> {
        let bad = |m: String| Err(TransportError::Config(m));
        if !(1..=crate::ibverbs::blob::MAX_QPS_PER_PEER).contains(&self.qps_per_peer) {
            return bad(format!(
                "qps_per_peer {} not in 1..={}",
                self.qps_per_peer,
                crate::ibverbs::blob::MAX_QPS_PER_PEER
            ));
        }
        if self.signal_every == 0 || self.sq_depth < 2 * self.signal_every || self.sq_depth < 16 {
            return bad(format!(
                "sq_depth {} must be >= 16 and >= 2 x signal_every {} (>= 1)",
                self.sq_depth, self.signal_every
            ));
        }
        if self.max_msg == 0 || self.max_msg > 1 << 31 {
            return bad(format!("max_msg {} not in 1..=2^31", self.max_msg));
        }
        if self.ack_timeout > 31 || self.retry_cnt > 7 || self.service_level > 15 {
            return bad(format!(
                "ack_timeout {} (<= 31), retry_cnt {} (<= 7), service_level {} (<= 15)",
                self.ack_timeout, self.retry_cnt, self.service_level
            ));
        }
        Ok(())
    }

    /// Most work requests posted as one chain (so a signalled request is always outstanding
    /// when the send queue is full).
    pub fn max_chain(&self) -> usize {
        (self.sq_depth - self.signal_every) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn environment_and_invariants() {
        let m: HashMap<&str, &str> = [
            ("MKERNEL_IB_QPS_PER_PEER", "4"),
            ("MKERNEL_IB_SIGNAL_EVERY", "8"),
            ("MKERNEL_IB_GID_INDEX", "3"),
        ]
        .into();
        let c = RcConfig::from_vars(|k| m.get(k).map(|s| s.to_string())).unwrap();
        assert_eq!(
            (c.qps_per_peer, c.signal_every, c.gid_index, c.max_chain()),
            (4, 8, Some(3), 504)
        );
        assert!(RcConfig::from_vars(|k| (k == "MKERNEL_IB_SQ_DEPTH").then(|| "20".into())).is_err());
        assert!(RcConfig::from_vars(|k| (k == "MKERNEL_IB_QPS_PER_PEER").then(|| "0".into())).is_err());
        assert!(RcConfig::from_vars(|k| (k == "MKERNEL_IB_SL").then(|| "x".into())).is_err());
        RcConfig::default().check().unwrap();
    }
}
