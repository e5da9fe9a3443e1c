//! Which backend carries this rank's inter-node traffic.
//!
//! 1. `MKERNEL_EMULATED_NODES` set (by `cargo xtask launch --nodes N`): the emulated wire.
//! 2. `MKERNEL_NET_BACKEND=emulated|ibverbs|efa`: that one.
//! 3. No RDMA device in sysfs: the emulated wire if the job is on one host; an error if it
//!    spans real nodes (the emulated wire cannot leave the host).
//! 4. Otherwise the NIC nearest the GPU decides: EFA -> SRD, anything else -> RC.
use crate::error::TransportError;
use crate::ibverbs::sysfs::{choose_nic, gpu_location, list_nics, NicChoice, NicKind};
use crate::topology::Topology;
use std::path::Path;

/// A transport backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// [`crate::emulated`].
    Emulated,
    /// [`crate::ibverbs`] (InfiniBand / RoCE RC).
    IbverbsRc,
    /// [`crate::efa`] (EFA SRD).
    EfaSrd,
}

/// The choice and why (print it: users should see what was picked).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    /// The backend.
    pub kind: BackendKind,
    /// The NIC, for RDMA backends.
    pub nic: Option<NicChoice>,
    /// Why.
    pub reason: String,
}

/// Chooses with the real `/sys` and environment.
pub fn choose_from_env(topology: &Topology, gpu_bus_id: Option<&str>) -> Result<BackendChoice, TransportError> {
    choose(topology, Path::new("/sys"), gpu_bus_id, |k| std::env::var(k).ok())
}

/// Chooses from `sysfs_root` and the variables given by `get`.
pub fn choose(
    topology: &Topology,
    sysfs_root: &Path,
    gpu_bus_id: Option<&str>,
    get: impl Fn(&str) -> Option<String>,
) -> Result<BackendChoice, TransportError> {
    if let Some(n) = get("MKERNEL_EMULATED_NODES").filter(|v| !v.trim().is_empty()) {
        return Ok(BackendChoice {
            kind: BackendKind::Emulated,
            nic: None,
            reason: format!("emulated nodes requested (MKERNEL_EMULATED_NODES={n})"),
        });
    }
    let forced = get("MKERNEL_NET_BACKEND").filter(|v| !v.trim().is_empty());
    match forced.as_deref().map(str::trim) {
        None | Some("ibverbs") | Some("efa") => {}
        Some("emulated") => {
            return Ok(BackendChoice {
                kind: BackendKind::Emulated,
                nic: None,
                reason: "MKERNEL_NET_BACKEND=emulated".into(),
            })
        }
        Some(other) => {
            return Err(TransportError::Config(format!(
                "MKERNEL_NET_BACKEND={other:?}: expected emulated, ibverbs or efa"
            )))
        }
    }
    let nics = list_nics(sysfs_root)?;
    if nics.is_empty() {
        let looked = format!("nothing under {}/class/infiniband", sysfs_root.display());
        if forced.is_some() || topology.nnodes() > 1 {
            let why = if forced.is_some() {
                "MKERNEL_NET_BACKEND asks for RDMA".to_string()
            } else {
                format!(
                    "the job spans {} real nodes and the emulated wire only connects ranks of one host",
                    topology.nnodes()
                )
            };
            return Err(TransportError::NoDevice(format!("{looked}; {why}")));
        }
        return Ok(BackendChoice {
            kind: BackendKind::Emulated,
            nic: None,
            reason: format!("no RDMA device found ({looked}); one node"),
        });
    }
    let gpu = gpu_bus_id.and_then(|b| gpu_location(sysfs_root, b).ok());
    let nic = choose_nic(
        &nics,
        gpu.as_ref(),
        topology.local_rank(),
        get("MKERNEL_NET_DEVICE").as_deref(),
    )?;
    let kind = match (forced.as_deref().map(str::trim), nic.nic.kind) {
        (Some("ibverbs"), NicKind::Efa) | (Some("efa"), NicKind::Rc) => {
            return Err(TransportError::Config(format!(
                "MKERNEL_NET_BACKEND={} but {} is {:?}",
                forced.unwrap_or_default(),
                nic.nic.name,
                nic.nic.kind
            )));
        }
        (_, NicKind::Efa) => BackendKind::EfaSrd,
        (_, NicKind::Rc) => BackendKind::IbverbsRc,
    };
    let reason = format!("{} port {}: {}", nic.nic.name, nic.port, nic.reason);
    Ok(BackendChoice {
        kind,
        nic: Some(nic),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ibverbs::sysfs::tests::{fake_tree, nic, TempDir};
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn no_device_means_emulated_on_one_host_and_an_error_across_hosts() {
        let t = TempDir::new("backend-none");
        let one = Topology::new(1, 4, 0).unwrap();
        let two = Topology::new(2, 4, 0).unwrap();
        let c = choose(&one, &t.0, None, vars(&[])).unwrap();
        assert_eq!(c.kind, BackendKind::Emulated);
        assert!(c.reason.contains("no RDMA device found"), "{}", c.reason);
        let e = choose(&two, &t.0, None, vars(&[])).unwrap_err();
        assert!(
            e.to_string().starts_with("no RDMA device found") && e.to_string().contains("2 real nodes"),
            "{e}"
        );
        // Emulated nodes on one host (the launcher sets MKERNEL_EMULATED_NODES).
        assert_eq!(
            choose(&two, &t.0, None, vars(&[("MKERNEL_EMULATED_NODES", "2")]))
                .unwrap()
                .kind,
            BackendKind::Emulated
        );
        assert!(choose(&one, &t.0, None, vars(&[("MKERNEL_NET_BACKEND", "ibverbs")])).is_err());
        assert!(choose(&one, &t.0, None, vars(&[("MKERNEL_NET_BACKEND", "tcp")])).is_err());
    }

    #[test]
    fn the_nic_decides_between_rc_and_srd() {
        let t = TempDir::new("backend-nics");
        fake_tree(&t.0);
        let two = Topology::new(2, 4, 1).unwrap();
        let c = choose(&two, &t.0, Some("0000:23:00.0"), vars(&[])).unwrap();
        assert_eq!(
            (c.kind, c.nic.as_ref().map(|n| n.nic.name.as_str())),
            (BackendKind::IbverbsRc, Some("mlx5_1"))
        );
        println!("{}", c.reason);
        assert_eq!(
            choose(&two, &t.0, None, vars(&[("MKERNEL_EMULATED_NODES", "2")]))
                .unwrap()
                .kind,
            BackendKind::Emulated
        );
        assert_eq!(
            choose(&two, &t.0, None, vars(&[("MKERNEL_NET_BACKEND", "emulated")]))
                .unwrap()
                .kind,
            BackendKind::Emulated
        );
        assert!(choose(&two, &t.0, None, vars(&[("MKERNEL_NET_BACKEND", "efa")])).is_err());
        let e = TempDir::new("backend-efa");
        nic(
            &e.0,
            "rdmap16s27",
            &["pci0000:10", "0000:10:1b.0"],
            0,
            "efa",
            "4: ACTIVE\n",
        );
        let c = choose(&two, &e.0, None, vars(&[])).unwrap();
        assert_eq!(c.kind, BackendKind::EfaSrd);
    }
}
