//! Who this process is in the job: torchrun-style variables, as `cargo xtask launch` sets them.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `RANK` | global rank, `0..WORLD_SIZE` | required |
//! | `WORLD_SIZE` | number of processes (GPUs) in the job | required |
//! | `LOCAL_RANK` | rank on this node, `0..LOCAL_WORLD_SIZE` | required |
//! | `LOCAL_WORLD_SIZE` | processes per node (the same on every node) | required |
//! | `NODE_RANK` | this node's index | `RANK / LOCAL_WORLD_SIZE` |
//! | `NNODES` | number of nodes | `WORLD_SIZE / LOCAL_WORLD_SIZE` |
//! | `MASTER_ADDR`, `MASTER_PORT` | where rank 0 hosts the store | required |
//! | `MKERNEL_JOB_KEY` | the job's shared secret | this or `MKERNEL_JOB_KEY_FILE` |
//! | `MKERNEL_JOB_KEY_FILE` | a file holding the secret (one line; read when `MKERNEL_JOB_KEY` is unset) | unset |
//! | `MKERNEL_STORE_BIND_ALL` | `1`: rank 0's store may listen on every interface when `MASTER_ADDR` is not an address of its host (behind NAT) | `0`: that is an error |
//! | `MKERNEL_DEVICE` | GPU ordinal to open | `LOCAL_RANK` |
//! | `MKERNEL_EMULATED_NODES` | nodes emulated on one host (equals `NNODES`) | unset |
//!
//! Ranks of one node are contiguous: `RANK == NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK`, so any
//! rank's node and local rank follow from the rank alone ([`RankInfo::node_of`]).
use std::ops::Range;

use crate::auth::JobKey;

/// Environment variable names, as constants so that errors and callers spell them the same.
pub mod vars {
    /// Global rank.
    pub const RANK: &str = "RANK";
    /// Rank on this node.
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Number of processes in the job.
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// Processes per node.
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    /// This node's index.
    pub const NODE_RANK: &str = "NODE_RANK";
    /// Number of nodes.
    pub const NNODES: &str = "NNODES";
    /// Host of rank 0's store.
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    /// Port of rank 0's store.
    pub const MASTER_PORT: &str = "MASTER_PORT";
    /// The job's shared secret.
    pub const MKERNEL_JOB_KEY: &str = "MKERNEL_JOB_KEY";
    /// A file holding the job's shared secret (read when `MKERNEL_JOB_KEY` is unset).
    pub const MKERNEL_JOB_KEY_FILE: &str = "MKERNEL_JOB_KEY_FILE";
    /// `1`: the store may listen on every interface when `MASTER_ADDR` is not local.
    pub const MKERNEL_STORE_BIND_ALL: &str = "MKERNEL_STORE_BIND_ALL";
    /// GPU ordinal to open.
    pub const MKERNEL_DEVICE: &str = "MKERNEL_DEVICE";
    /// Number of nodes emulated on this host.
    pub const MKERNEL_EMULATED_NODES: &str = "MKERNEL_EMULATED_NODES";
}
use vars::*;

/// A rank variable that is missing, unparsable or inconsistent with the others. Each variant
/// names the variable ([`EnvError::var`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// The variable is not set.
    #[error("environment variable {var} is not set ({hint})")]
    Missing {
        /// The variable.
        var: &'static str,
        /// What sets it.
        hint: &'static str,
    },
    /// The variable's value does not parse or is out of its range.
    #[error("environment variable {var}={value:?} is not valid: {reason}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value (redacted for the job key).
        value: String,
        /// Why.
        reason: String,
    },
    /// The variable parses but contradicts the others.
    #[error("environment variable {var} is inconsistent: {reason}")]
    Inconsistent {
        /// The variable.
        var: &'static str,
        /// The contradiction, with the values involved.
        reason: String,
    },
}

impl EnvError {
    /// The variable this error is about.
    pub fn var(&self) -> &'static str {
        match self {
            EnvError::Missing { var, .. } | EnvError::Invalid { var, .. } | EnvError::Inconsistent { var, .. } => var,
        }
    }

    fn inconsistent(var: &'static str, reason: impl Into<String>) -> Self {
        EnvError::Inconsistent {
            var,
            reason: reason.into(),
        }
    }
}

/// This process's place in the job: ranks, node, GPU, and where the store is.
///
/// Built from the environment ([`RankInfo::from_env`]) or from explicit values
/// ([`RankInfo::new`]); either way it has been validated, so the getters need no checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    rank: usize,
    local_rank: usize,
    world_size: usize,
    local_world_size: usize,
    node_rank: usize,
    nnodes: usize,
    device: usize,
    emulated_nodes: Option<usize>,
    master_addr: String,
    master_port: u16,
    job_key: JobKey,
    store_bind_all: bool,
}

impl RankInfo {
    /// Reads and validates the variables of the process environment (see the module docs).
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Like [`RankInfo::from_env`], with `lookup(name)` standing in for the environment.
    pub fn from_lookup(mut lookup: impl FnMut(&str) -> Option<String>) -> Result<Self, EnvError> {
        let mut get = |var: &'static str| lookup(var).map(|v| (var, v));
        let launcher = "start the processes with `cargo xtask launch` or torchrun";

        let rank = parse_usize(get(RANK).ok_or(EnvError::Missing {
            var: RANK,
            hint: launcher,
        })?)?;
        let world_size = parse_usize(get(WORLD_SIZE).ok_or(EnvError::Missing {
            var: WORLD_SIZE,
            hint: launcher,
        })?)?;
        let local_rank = parse_usize(get(LOCAL_RANK).ok_or(EnvError::Missing {
            var: LOCAL_RANK,
            hint: launcher,
        })?)?;
        let local_world_size = parse_usize(get(LOCAL_WORLD_SIZE).ok_or(EnvError::Missing {
            var: LOCAL_WORLD_SIZE,
            hint: launcher,
        })?)?;
        let node_rank = get(NODE_RANK).map(parse_usize).transpose()?;
        let nnodes = get(NNODES).map(parse_usize).transpose()?;
        let (_, master_addr) = get(MASTER_ADDR).ok_or(EnvError::Missing {
            var: MASTER_ADDR,
            hint: launcher,
        })?;
        let master_port = parse_port(get(MASTER_PORT).ok_or(EnvError::Missing {
            var: MASTER_PORT,
            hint: launcher,
        })?)?;
        let key = match (get(MKERNEL_JOB_KEY), get(MKERNEL_JOB_KEY_FILE)) {
            (Some((_, key)), _) => key,
            (None, Some((var, path))) => read_key_file(var, &path)?,
            (None, None) => {
                return Err(EnvError::Missing {
                    var: MKERNEL_JOB_KEY,
                    hint: "every rank needs the same secret, in MKERNEL_JOB_KEY or a file named by \
                           MKERNEL_JOB_KEY_FILE; `cargo xtask launch` sets it, with torchrun export it yourself",
                })
            }
        };
        let store_bind_all = match get(MKERNEL_STORE_BIND_ALL) {
            None => false,
            Some((_, v)) if v.trim() == "1" => true,
            Some((_, v)) if v.trim() == "0" || v.trim().is_empty() => false,
            Some((var, v)) => {
                return Err(EnvError::Invalid {
                    var,
                    value: v,
                    reason: "expected 1 or 0".into(),
                })
            }
        };
        let device = get(MKERNEL_DEVICE).map(parse_usize).transpose()?;
        let emulated_nodes = get(MKERNEL_EMULATED_NODES).map(parse_usize).transpose()?;

        // Check the layout before deriving defaults from it (a division by zero otherwise).
        check_sizes(rank, world_size, local_rank, local_world_size)?;
        let info = RankInfo {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank: node_rank.unwrap_or(rank / local_world_size),
            nnodes: nnodes.unwrap_or(world_size / local_world_size),
            device: device.unwrap_or(local_rank),
            emulated_nodes,
            master_addr,
            master_port,
            job_key: JobKey::new(key.into_bytes())?,
            store_bind_all,
        };
        info.validate()?;
        Ok(info)
    }

    /// A rank of `world_size` processes, `local_world_size` per node, with the store at
    /// `master_addr:master_port`. Local rank, node and node count follow from the rank; the
    /// device is the local rank (see [`RankInfo::with_device`]).
    pub fn new(
        rank: usize,
        world_size: usize,
        local_world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
        job_key: JobKey,
    ) -> Result<Self, EnvError> {
        check_sizes(rank, world_size, rank % local_world_size.max(1), local_world_size)?;
        let info = RankInfo {
            rank,
            local_rank: rank % local_world_size,
            world_size,
            local_world_size,
            node_rank: rank / local_world_size,
            nnodes: world_size / local_world_size,
            device: rank % local_world_size,
            emulated_nodes: None,
            master_addr: master_addr.into(),
            master_port,
            job_key,
            store_bind_all: false,
        };
        info.validate()?;
        Ok(info)
    }

    /// The same rank whose store (rank 0) may listen on every interface when `MASTER_ADDR`
    /// is not an address of this host (`MKERNEL_STORE_BIND_ALL=1`).
    pub fn with_store_bind_all(mut self, yes: bool) -> Self {
        self.store_bind_all = yes;
        self
    }

    /// The same rank with GPU ordinal `device`.
    pub fn with_device(mut self, device: usize) -> Self {
        self.device = device;
        self
    }

    /// The same rank with its nodes emulated on one host; `nodes` must equal [`RankInfo::nnodes`].
    pub fn with_emulated_nodes(mut self, nodes: usize) -> Result<Self, EnvError> {
        self.emulated_nodes = Some(nodes);
        self.validate()?;
        Ok(self)
    }

    fn validate(&self) -> Result<(), EnvError> {
        check_sizes(self.rank, self.world_size, self.local_rank, self.local_world_size)?;
        let expected_nodes = self.world_size / self.local_world_size;
        if self.nnodes != expected_nodes {
            return Err(EnvError::inconsistent(
                NNODES,
                format!(
                    "NNODES {} but WORLD_SIZE {} / LOCAL_WORLD_SIZE {} = {expected_nodes}",
                    self.nnodes, self.world_size, self.local_world_size
                ),
            ));
        }
        if self.node_rank >= self.nnodes {
            return Err(EnvError::inconsistent(
                NODE_RANK,
                format!("NODE_RANK {} is not below NNODES {}", self.node_rank, self.nnodes),
            ));
        }
        let expected_rank = self.node_rank * self.local_world_size + self.local_rank;
        if self.rank != expected_rank {
            return Err(EnvError::inconsistent(
                RANK,
                format!(
                    "RANK {} but NODE_RANK {} * LOCAL_WORLD_SIZE {} + LOCAL_RANK {} = {expected_rank} \
                     (the ranks of a node must be contiguous)",
                    self.rank, self.node_rank, self.local_world_size, self.local_rank
                ),
            ));
        }
        if self.master_addr.trim().is_empty() {
            return Err(EnvError::Invalid {
                var: MASTER_ADDR,
                value: self.master_addr.clone(),
                reason: "empty host name".into(),
            });
        }
        if self.master_port == 0 {
            return Err(EnvError::Invalid {
                var: MASTER_PORT,
                value: "0".into(),
                reason: "port 0".into(),
            });
        }
        if let Some(n) = self.emulated_nodes {
            if n != self.nnodes {
                return Err(EnvError::inconsistent(
                    MKERNEL_EMULATED_NODES,
                    format!("MKERNEL_EMULATED_NODES {n} but NNODES {}", self.nnodes),
                ));
            }
        }
        Ok(())
    }

    /// Global rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Rank on this node, `0..local_world_size()`.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of processes in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Processes per node.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// This node's index, `0..nnodes()`.
    pub fn node_rank(&self) -> usize {
        self.node_rank
    }

    /// Number of nodes (real or emulated).
    pub fn nnodes(&self) -> usize {
        self.nnodes
    }

    /// GPU ordinal this process opens.
    pub fn device(&self) -> usize {
        self.device
    }

    /// `Some(nodes)` when the job's nodes are emulated on one host.
    pub fn emulated_nodes(&self) -> Option<usize> {
        self.emulated_nodes
    }

    /// Host of rank 0's store.
    pub fn master_addr(&self) -> &str {
        &self.master_addr
    }

    /// Port of rank 0's store.
    pub fn master_port(&self) -> u16 {
        self.master_port
    }

    /// `MASTER_ADDR:MASTER_PORT`, with brackets around an IPv6 address.
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    /// The job's shared secret.
    pub fn job_key(&self) -> &JobKey {
        &self.job_key
    }

    /// Whether the store may listen on every interface when `MASTER_ADDR` is not local.
    pub fn store_bind_all(&self) -> bool {
        self.store_bind_all
    }

    /// Whether this rank hosts the store (rank 0).
    pub fn hosts_store(&self) -> bool {
        self.rank == 0
    }

    /// The node of global rank `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.local_world_size
    }

    /// The local rank of global rank `rank` on its node.
    pub fn local_rank_of(&self, rank: usize) -> usize {
        rank % self.local_world_size
    }

    /// The global ranks on this node.
    pub fn node_ranks(&self) -> Range<usize> {
        let first = self.node_rank * self.local_world_size;
        first..first + self.local_world_size
    }
}

fn check_sizes(rank: usize, world_size: usize, local_rank: usize, local_world_size: usize) -> Result<(), EnvError> {
    if world_size == 0 {
        return Err(EnvError::Invalid {
            var: WORLD_SIZE,
            value: "0".into(),
            reason: "must be at least 1".into(),
        });
    }
    if rank >= world_size {
        return Err(EnvError::inconsistent(
            RANK,
            format!("RANK {rank} is not below WORLD_SIZE {world_size}"),
        ));
    }
    if local_world_size == 0 {
        return Err(EnvError::Invalid {
            var: LOCAL_WORLD_SIZE,
            value: "0".into(),
            reason: "must be at least 1".into(),
        });
    }
    if world_size % local_world_size != 0 {
        return Err(EnvError::inconsistent(
            LOCAL_WORLD_SIZE,
            format!("WORLD_SIZE {world_size} is not a multiple of LOCAL_WORLD_SIZE {local_world_size}"),
        ));
    }
    if local_rank >= local_world_size {
        return Err(EnvError::inconsistent(
            LOCAL_RANK,
            format!("LOCAL_RANK {local_rank} is not below LOCAL_WORLD_SIZE {local_world_size}"),
        ));
    }
    Ok(())
}

/// The key in the file `path`: its first line, without the line end. Never echoes the
/// content; a missing or unreadable file names the variable and the path.
fn read_key_file(var: &'static str, path: &str) -> Result<String, EnvError> {
    let text = std::fs::read_to_string(path).map_err(|e| EnvError::Invalid {
        var,
        value: path.to_string(),
        reason: format!("cannot read the key file: {e}"),
    })?;
    Ok(text.lines().next().unwrap_or("").to_string())
}

fn parse_usize((var, value): (&'static str, String)) -> Result<usize, EnvError> {
    value.trim().parse().map_err(|_| EnvError::Invalid {
        var,
        value,
        reason: "not a non-negative integer".into(),
    })
}

fn parse_port((var, value): (&'static str, String)) -> Result<u16, EnvError> {
    match value.trim().parse::<u16>() {
        Ok(0) | Err(_) => Err(EnvError::Invalid {
            var,
            value,
            reason: "not a TCP port (1..=65535)".into(),
        }),
        Ok(port) => Ok(port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        let mut m: HashMap<String, String> = [
            (RANK, "5"),
            (LOCAL_RANK, "1"),
            (WORLD_SIZE, "8"),
            (LOCAL_WORLD_SIZE, "4"),
            (MASTER_ADDR, "node0"),
            (MASTER_PORT, "29500"),
            (MKERNEL_JOB_KEY, "s3cret-0123456789abcdef"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        for (k, v) in pairs {
            if *v == "<unset>" {
                m.remove(*k);
            } else {
                m.insert(k.to_string(), v.to_string());
            }
        }
        m
    }

    fn parse(pairs: &[(&str, &str)]) -> Result<RankInfo, EnvError> {
        let m = vars(pairs);
        RankInfo::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_follow_from_the_rank() {
        let info = parse(&[]).unwrap();
        assert_eq!(
            (info.rank(), info.local_rank(), info.node_rank(), info.nnodes()),
            (5, 1, 1, 2)
        );
        assert_eq!(info.device(), 1);
        assert_eq!(info.emulated_nodes(), None);
        assert_eq!(info.store_addr(), "node0:29500");
        assert_eq!(info.node_ranks(), 4..8);
        assert_eq!((info.node_of(2), info.local_rank_of(6)), (0, 2));
        assert!(!info.hosts_store());
    }

    #[test]
    fn launch_variables_are_read() {
        // What `cargo xtask launch -n 4 --nodes 2` gives rank 3.
        let info = parse(&[
            (RANK, "3"),
            (LOCAL_RANK, "1"),
            (WORLD_SIZE, "4"),
            (LOCAL_WORLD_SIZE, "2"),
            (NODE_RANK, "1"),
            (NNODES, "2"),
            (MKERNEL_DEVICE, "3"),
            (MKERNEL_EMULATED_NODES, "2"),
        ])
        .unwrap();
        assert_eq!(
            (info.node_rank(), info.nnodes(), info.device(), info.emulated_nodes()),
            (1, 2, 3, Some(2))
        );
    }

    #[test]
    fn errors_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[(RANK, "<unset>")], RANK),
            (&[(LOCAL_WORLD_SIZE, "<unset>")], LOCAL_WORLD_SIZE),
            (&[(MASTER_PORT, "<unset>")], MASTER_PORT),
            (&[(MKERNEL_JOB_KEY, "<unset>")], MKERNEL_JOB_KEY),
            (&[(MKERNEL_JOB_KEY, "")], MKERNEL_JOB_KEY),
            (&[(MKERNEL_JOB_KEY, "too short")], MKERNEL_JOB_KEY),
            (&[(WORLD_SIZE, "eight")], WORLD_SIZE),
            (&[(RANK, "8")], RANK),
            (&[(WORLD_SIZE, "6")], LOCAL_WORLD_SIZE),
            (&[(LOCAL_WORLD_SIZE, "0")], LOCAL_WORLD_SIZE),
            (&[(LOCAL_RANK, "4")], LOCAL_RANK),
            (&[(LOCAL_RANK, "2")], RANK),
            (&[(NNODES, "3")], NNODES),
            (&[(NODE_RANK, "0")], RANK),
            (&[(MASTER_PORT, "0")], MASTER_PORT),
            (&[(MASTER_PORT, "70000")], MASTER_PORT),
            (&[(MASTER_ADDR, "")], MASTER_ADDR),
            (&[(MASTER_ADDR, "<unset>")], MASTER_ADDR),
            (&[(MKERNEL_DEVICE, "-1")], MKERNEL_DEVICE),
            (&[(MKERNEL_EMULATED_NODES, "4")], MKERNEL_EMULATED_NODES),
        ];
        for (pairs, var) in cases {
            let e = parse(pairs).unwrap_err();
            assert_eq!(e.var(), *var, "{pairs:?}: {e}");
            assert!(e.to_string().contains(var), "{e}");
        }
    }

    #[test]
    fn the_key_never_appears_in_errors_or_debug() {
        let e = parse(&[(MKERNEL_JOB_KEY, "")]).unwrap_err();
        assert_eq!(e.var(), MKERNEL_JOB_KEY);
        let e = parse(&[(MKERNEL_JOB_KEY, "s3cret")]).unwrap_err();
        assert!(!e.to_string().contains("s3cret"), "{e}");
        let info = parse(&[]).unwrap();
        assert!(!format!("{info:?}").contains("s3cret"));
    }

    /// The key from a file (first line), the variable winning over the file; a missing file
    /// names the variable and the path, never the content.
    #[test]
    fn the_key_comes_from_a_file_when_the_variable_is_unset() {
        let tmp = crate::testutil::TempDir::new("keyfile");
        let path = tmp.path().join("key");
        std::fs::write(&path, "from-file-0123456789abcdef\n").unwrap();
        let p = path.to_str().unwrap();
        let info = parse(&[(MKERNEL_JOB_KEY, "<unset>"), (MKERNEL_JOB_KEY_FILE, p)]).unwrap();
        assert_eq!(info.job_key().as_bytes(), b"from-file-0123456789abcdef");
        let both = parse(&[(MKERNEL_JOB_KEY_FILE, p)]).unwrap();
        assert_eq!(both.job_key().as_bytes(), b"s3cret-0123456789abcdef");
        let missing = tmp.path().join("nope");
        let e = parse(&[
            (MKERNEL_JOB_KEY, "<unset>"),
            (MKERNEL_JOB_KEY_FILE, missing.to_str().unwrap()),
        ])
        .unwrap_err();
        assert_eq!(e.var(), MKERNEL_JOB_KEY_FILE);
        assert!(e.to_string().contains("nope"), "{e}");
        std::fs::write(&path, "short\n").unwrap();
        let e = parse(&[(MKERNEL_JOB_KEY, "<unset>"), (MKERNEL_JOB_KEY_FILE, p)]).unwrap_err();
        assert!(!e.to_string().contains("short"), "{e}");
    }

    #[test]
    fn binding_every_interface_is_asked_for() {
        assert!(!parse(&[]).unwrap().store_bind_all());
        assert!(parse(&[(MKERNEL_STORE_BIND_ALL, "1")]).unwrap().store_bind_all());
        assert!(!parse(&[(MKERNEL_STORE_BIND_ALL, "0")]).unwrap().store_bind_all());
        let e = parse(&[(MKERNEL_STORE_BIND_ALL, "yes")]).unwrap_err();
        assert_eq!(e.var(), MKERNEL_STORE_BIND_ALL);
    }

    #[test]
    fn explicit_constructor_validates() {
        let key = JobKey::new("k-0123456789abcdef").unwrap();
        let info = RankInfo::new(3, 4, 2, "127.0.0.1", 1234, key.clone()).unwrap();
        assert_eq!(
            (info.local_rank(), info.node_rank(), info.nnodes(), info.device()),
            (1, 1, 2, 1)
        );
        assert_eq!(info.clone().with_device(3).device(), 3);
        assert!(info.clone().with_emulated_nodes(2).is_ok());
        assert_eq!(info.with_emulated_nodes(3).unwrap_err().var(), MKERNEL_EMULATED_NODES);
        assert_eq!(RankInfo::new(4, 4, 2, "h", 1, key.clone()).unwrap_err().var(), RANK);
        assert_eq!(
            RankInfo::new(0, 4, 3, "h", 1, key.clone()).unwrap_err().var(),
            LOCAL_WORLD_SIZE
        );
        assert_eq!(RankInfo::new(0, 4, 0, "h", 1, key).unwrap_err().var(), LOCAL_WORLD_SIZE);
        let v6 = RankInfo::new(0, 1, 1, "::1", 9, JobKey::new("k-0123456789abcdef").unwrap()).unwrap();
        assert_eq!(v6.store_addr(), "[::1]:9");
    }
}
