//! Who is where: nodes x local GPUs, and which peers a rank reaches through its proxy.
use crate::error::ProxyError;

/// How a rank reaches another rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The rank itself.
    Local,
    /// Same node: peer-mapped memory over NVLink (no proxy).
    NvLink,
    /// Another node: commands through the FIFO and this rank's proxy.
    Proxy,
    /// Another node, but not reachable under the peer policy (see [`PeerPolicy::RailOnly`]).
    Unreachable,
}

/// Which remote ranks a proxy connects to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PeerPolicy {
    /// Every rank on another node (one set of queue pairs per remote rank).
    #[default]
    AllRemote,
    /// Only rail peers: the same local rank on other nodes (rail-optimized fabrics; traffic to
    /// other GPUs of a remote node is first moved over NVLink on one side).
    RailOnly,
}

/// The job's shape: `nnodes` nodes of `local_world` GPUs each, rank = node * local_world + local.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    nnodes: usize,
    local_world: usize,
    rank: usize,
    policy: PeerPolicy,
}

impl Topology {
    /// A topology of `nnodes` x `local_world` ranks seen from `rank`.
    pub fn new(nnodes: usize, local_world: usize, rank: usize) -> Result<Topology, ProxyError> {
        if nnodes == 0 || local_world == 0 {
            return Err(ProxyError::Config(format!(
                "topology {nnodes} nodes x {local_world} GPUs is empty"
            )));
        }
        let world = nnodes
            .checked_mul(local_world)
            .ok_or_else(|| ProxyError::Config("world size overflows".into()))?;
        if world > u32::MAX as usize {
            return Err(ProxyError::Config(format!(
                "world size {world} does not fit the u32 dst_rank field"
            )));
        }
        if rank >= world {
            return Err(ProxyError::Config(format!(
                "rank {rank} is not below the world size {world}"
            )));
        }
        Ok(Topology {
            nnodes,
            local_world,
            rank,
            policy: PeerPolicy::AllRemote,
        })
    }

    /// The same topology with another peer policy.
    pub fn with_policy(mut self, policy: PeerPolicy) -> Topology {
        self.policy = policy;
        self
    }

    /// From the launcher's variables (`cargo xtask launch`): `RANK`, `WORLD_SIZE`,
    /// `LOCAL_WORLD_SIZE`, `NNODES` (or `MKERNEL_EMULATED_NODES` when nodes are emulated on
    /// one host), and `MKERNEL_RAIL_ONLY=1` for [`PeerPolicy::RailOnly`].
    pub fn from_env() -> Result<Topology, ProxyError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`Topology::from_env`] with the variables given by `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Topology, ProxyError> {
        let num = |k: &str| -> Result<Option<usize>, ProxyError> {
            match get(k) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| ProxyError::Config(format!("{k}={v:?} is not a number"))),
            }
        };
        let rank = num("RANK")?.unwrap_or(0);
        let world = num("WORLD_SIZE")?.unwrap_or(1);
        let nnodes = match num("MKERNEL_EMULATED_NODES")? {
            Some(n) => n,
            None => num("NNODES")?.unwrap_or(1),
        };
        let local = match num("LOCAL_WORLD_SIZE")? {
            Some(l) => l,
            None if nnodes > 0 && world % nnodes == 0 => world / nnodes,
            None => {
                return Err(ProxyError::Config(format!(
                    "WORLD_SIZE {world} does not split into {nnodes} nodes"
                )))
            }
        };
        if nnodes.checked_mul(local) != Some(world) {
            return Err(ProxyError::Config(format!(
                "WORLD_SIZE {world} != nodes {nnodes} x LOCAL_WORLD_SIZE {local}"
            )));
        }
        let t = Topology::new(nnodes, local, rank)?;
        if let Some(lr) = num("LOCAL_RANK")? {
            if lr != t.local_rank() {
                return Err(ProxyError::Config(format!(
                    "LOCAL_RANK {lr} disagrees with RANK {rank} on nodes of {local} GPUs"
                )));
            }
        }
        let rail = get("MKERNEL_RAIL_ONLY").map(|v| v == "1").unwrap_or(false);
        Ok(t.with_policy(if rail {
            PeerPolicy::RailOnly
        } else {
            PeerPolicy::AllRemote
        }))
    }

    /// Total ranks.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.local_world
    }
    /// Nodes.
    pub fn nnodes(&self) -> usize {
        self.nnodes
    }
    /// GPUs per node.
    pub fn local_world(&self) -> usize {
        self.local_world
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// This rank's node.
    pub fn node(&self) -> usize {
        self.rank / self.local_world
    }
    /// This rank's index on its node.
    pub fn local_rank(&self) -> usize {
        self.rank % self.local_world
    }
    /// The peer policy.
    pub fn policy(&self) -> PeerPolicy {
        self.policy
    }
    /// Node of `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.local_world
    }
    /// Local index of `rank` on its node.
    pub fn local_rank_of(&self, rank: usize) -> usize {
        rank % self.local_world
    }
    /// Whether `rank` exists and lives on another node.
    pub fn is_remote(&self, rank: usize) -> bool {
        rank < self.world_size() && self.node_of(rank) != self.node()
    }
    /// How this rank reaches `rank` (`None` if out of range).
    pub fn route(&self, rank: usize) -> Option<Route> {
        if rank >= self.world_size() {
            return None;
        }
        Some(if rank == self.rank {
            Route::Local
        } else if !self.is_remote(rank) {
            Route::NvLink
        } else if self.policy == PeerPolicy::RailOnly && self.local_rank_of(rank) != self.local_rank() {
            Route::Unreachable
        } else {
            Route::Proxy
        })
    }
    /// Whether commands to `rank` may go through this rank's proxy.
    pub fn is_proxy_peer(&self, rank: usize) -> bool {
        self.route(rank) == Some(Route::Proxy)
    }
    /// Same local rank on every other node, by node.
    pub fn rail_peers(&self) -> Vec<usize> {
        (0..self.nnodes)
            .filter(|&n| n != self.node())
            .map(|n| n * self.local_world + self.local_rank())
            .collect()
    }
    /// Other ranks of this node (reached over NVLink).
    pub fn nvlink_peers(&self) -> Vec<usize> {
        let base = self.node() * self.local_world;
        (base..base + self.local_world).filter(|&r| r != self.rank).collect()
    }
    /// Ranks this proxy connects to, ascending.
    pub fn proxy_peers(&self) -> Vec<usize> {
        (0..self.world_size()).filter(|&r| self.is_proxy_peer(r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn two_nodes_of_four() {
        let t = Topology::new(2, 4, 5).unwrap();
        assert_eq!((t.world_size(), t.node(), t.local_rank()), (8, 1, 1));
        assert_eq!(t.rail_peers(), vec![1]);
        assert_eq!(t.nvlink_peers(), vec![4, 6, 7]);
        assert_eq!(t.proxy_peers(), vec![0, 1, 2, 3]);
        assert_eq!(t.route(5), Some(Route::Local));
        assert_eq!(t.route(6), Some(Route::NvLink));
        assert_eq!(t.route(0), Some(Route::Proxy));
        assert_eq!(t.route(8), None);
        assert!(t.is_remote(3) && !t.is_remote(7) && !t.is_remote(99));
        let rail = t.clone().with_policy(PeerPolicy::RailOnly);
        assert_eq!(rail.proxy_peers(), vec![1]);
        assert_eq!(rail.route(0), Some(Route::Unreachable));
    }

    #[test]
    fn three_nodes_rails() {
        let t = Topology::new(3, 2, 2).unwrap();
        assert_eq!(t.rail_peers(), vec![0, 4]);
        assert!(Topology::new(0, 2, 0).is_err());
        assert!(Topology::new(2, 2, 4).is_err());
    }

    #[test]
    fn from_launcher_variables() {
        let vars = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            move |k: &str| m.get(k).cloned()
        };
        let t = Topology::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NNODES", "2"),
            ("LOCAL_RANK", "1"),
        ]))
        .unwrap();
        assert_eq!((t.node(), t.local_rank(), t.proxy_peers()), (1, 1, vec![0, 1]));
        let e = Topology::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("MKERNEL_EMULATED_NODES", "2"),
        ]))
        .unwrap();
        assert_eq!((e.nnodes(), e.local_world()), (2, 2));
        assert!(Topology::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "3")])).is_err());
        assert!(Topology::from_vars(vars(&[("RANK", "x")])).is_err());
        assert!(Topology::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("NNODES", "2"),
            ("LOCAL_RANK", "0")
        ]))
        .is_err());
        let single = Topology::from_vars(vars(&[])).unwrap();
        assert_eq!((single.world_size(), single.proxy_peers().len()), (1, 0));
    }
}
