//! [`Bootstrap`]: everything a rank of the runtime sets up before touching peers' memory.
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use crate::env::RankInfo;
use crate::error::Result;
use crate::local::LocalPeers;
use crate::store::Store;

/// Name of the barrier that ends [`Bootstrap::new`].
pub const INIT_BARRIER: &str = "mkernel-bootstrap/init";

/// One rank's bootstrap: who it is, the store, and its local peers.
pub struct Bootstrap {
    info: RankInfo,
    store: Store,
    local: LocalPeers,
}

impl Bootstrap {
    /// [`Bootstrap::new`] with [`RankInfo::from_env`].
    pub fn from_env(timeout: Duration) -> Result<Self> {
        Self::new(RankInfo::from_env()?, timeout)
    }

    /// Listens for local peers (so that they can send as soon as they are up), joins the
    /// store (rank 0 hosts it), then waits at a barrier until every rank has done the same;
    /// each step waits at most `timeout`. The barrier's error names the ranks that never came.
    /// A timeout whose deadline overflows the clock (`Duration::MAX`) is
    /// [`Error::TimeoutTooLong`](crate::Error::TimeoutTooLong), before anything is bound.
    pub fn new(info: RankInfo, timeout: Duration) -> Result<Self> {
        crate::sys::deadline("bootstrap", timeout)?;
        let local = LocalPeers::bind(&info)?;
        let store = Store::for_rank(&info, timeout)?;
        store.barrier(INIT_BARRIER, timeout)?;
        Ok(Bootstrap { info, store, local })
    }

    /// Who this rank is.
    pub fn info(&self) -> &RankInfo {
        &self.info
    }

    /// The job's store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// This rank's endpoint among the local ranks.
    pub fn local(&mut self) -> &mut LocalPeers {
        &mut self.local
    }

    /// [`LocalPeers::exchange_fds`]: every local rank's descriptors, indexed by local rank.
    pub fn exchange_fds(&mut self, my_fds: &[BorrowedFd<'_>], timeout: Duration) -> Result<Vec<Vec<OwnedFd>>> {
        self.local.exchange_fds(my_fds, timeout)
    }
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("info", &self.info)
            .field("store", &self.store)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Error, JobKey};

    #[test]
    fn an_endless_timeout_is_an_error() {
        let key = JobKey::new("a key of 16+ bytes for this test").unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let info = RankInfo::new(0, 1, 1, "127.0.0.1", port, key).unwrap();
        let e = Bootstrap::new(info, Duration::MAX).unwrap_err();
        assert!(matches!(e, Error::TimeoutTooLong { .. }), "{e}");
    }
}
