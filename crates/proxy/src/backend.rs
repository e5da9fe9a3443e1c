//! Which backend carries this rank's inter-node traffic.
//!
//! 1. `MKERNEL_TRANSPORT=tcp|ibverbs|efa|emulated` (`MKERNEL_NET_BACKEND` is read when it is
//!    unset): that one, or an error naming what this host lacks for it. The environment
//!    overrides the program's own choice, so a launcher can change it without a rebuild.
//! 2. The program's choice (`configured`: mkernel's `CommConfig::transport`), checked the same way.
//! 3. `MKERNEL_EMULATED_NODES` set (by `cargo xtask launch --nodes N`): the emulated wire.
//! 4. Otherwise TCP.
//!
//! ibverbs RC and EFA SRD are used only when asked for (1 or 2): neither has run on a NIC yet
//! (the GPU hosts used so far have none), so an RDMA device is never picked by itself. When
//! asked for, they need an RDMA device nearest the GPU (`/sys/class/infiniband`) of the right
//! kind (EFA for SRD, InfiniBand/RoCE for RC), this build's `rdma` cargo feature, a loadable
//! libibverbs and, for RC, a way to register GPU memory (nvidia-peermem loaded, or dma-buf:
//! the GPU exports dma-bufs and libibverbs has `ibv_reg_dmabuf_mr`).
use crate::error::TransportError;
use crate::ibverbs::sysfs::{choose_nic, gpu_location, list_nics, NicChoice, NicKind};
use crate::topology::Topology;
use std::path::Path;

/// A transport backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// [`crate::emulated`].
    Emulated,
    /// [`crate::tcp`].
    Tcp,
    /// [`crate::ibverbs`] (InfiniBand / RoCE RC).
    IbverbsRc,
    /// [`crate::efa`] (EFA SRD).
    EfaSrd,
}

impl BackendKind {
    /// The name `MKERNEL_TRANSPORT` uses.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Emulated => "emulated",
            BackendKind::Tcp => "tcp",
            BackendKind::IbverbsRc => "ibverbs",
            BackendKind::EfaSrd => "efa",
        }
    }

    /// Parses a `MKERNEL_TRANSPORT` value.
    pub fn parse(s: &str) -> Option<BackendKind> {
        Some(match s.trim() {
            "emulated" => BackendKind::Emulated,
            "tcp" => BackendKind::Tcp,
            "ibverbs" | "rc" => BackendKind::IbverbsRc,
            "efa" | "srd" => BackendKind::EfaSrd,
            _ => return None,
        })
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The choice and why (log it: users should see what was picked).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    /// The backend.
    pub kind: BackendKind,
    /// The NIC, for RDMA backends.
    pub nic: Option<NicChoice>,
    /// Why.
    pub reason: String,
}

/// What this host and build can do beyond sysfs (detected by [`HostCaps::detect`]; tests
/// build it by hand).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostCaps {
    /// Built with the `rdma` cargo feature.
    pub rdma_built: bool,
    /// libibverbs loaded: `Ok(has ibv_reg_dmabuf_mr)`, or why not.
    pub libibverbs: Result<bool, String>,
    /// The GPU can export its memory as dma-buf (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub gpu_dmabuf: bool,
}

impl HostCaps {
    /// This build and host; `gpu_dmabuf` comes from the CUDA driver.
    pub fn detect(gpu_dmabuf: bool) -> HostCaps {
        #[cfg(feature = "rdma")]
        let libibverbs = crate::ibverbs::dl::verbs()
            .map(|v| v.ibv_reg_dmabuf_mr.is_some())
            .map_err(|e| e.to_string());
        #[cfg(not(feature = "rdma"))]
        let libibverbs = Err("not loaded (built without the `rdma` feature)".to_string());
        HostCaps {
            rdma_built: cfg!(feature = "rdma"),
            libibverbs,
            gpu_dmabuf,
        }
    }

    /// How GPU memory can be registered with an InfiniBand/RoCE NIC, or why it cannot.
    pub fn gpu_registration(&self, sysfs_root: &Path) -> Result<String, String> {
        for m in ["nvidia_peermem", "nv_peer_mem"] {
            if sysfs_root.join("module").join(m).exists() {
                return Ok(format!("{m} loaded"));
            }
        }
        match (&self.libibverbs, self.gpu_dmabuf) {
            (Ok(true), true) => Ok("dma-buf (GPU export + ibv_reg_dmabuf_mr)".into()),
            (Ok(false), true) => Err("libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34) and nvidia-peermem is not loaded".into()),
            (_, false) => Err("the GPU cannot export dma-bufs (open kernel modules and Linux 5.12+ needed) and nvidia-peermem is not loaded".into()),
            (Err(e), true) => Err(format!("libibverbs: {e}")),
        }
    }
}

/// Chooses with the real `/sys` and environment; `configured` is the program's own choice
/// (the environment overrides it).
pub fn choose_from_env(
    topology: &Topology,
    gpu_bus_id: Option<&str>,
    caps: &HostCaps,
    configured: Option<BackendKind>,
) -> Result<BackendChoice, TransportError> {
    choose_with(topology, Path::new("/sys"), gpu_bus_id, caps, configured, |k| {
        std::env::var(k).ok()
    })
}

/// [`choose_with`] without a choice of the program's.
pub fn choose(
    topology: &Topology,
    sysfs_root: &Path,
    gpu_bus_id: Option<&str>,
    caps: &HostCaps,
    get: impl Fn(&str) -> Option<String>,
) -> Result<BackendChoice, TransportError> {
    choose_with(topology, sysfs_root, gpu_bus_id, caps, None, get)
}

/// Chooses from `sysfs_root`, `caps`, the program's choice `configured` and the variables
/// given by `get` (the module docs give the order).
pub fn choose_with(
    topology: &Topology,
    sysfs_root: &Path,
    gpu_bus_id: Option<&str>,
    caps: &HostCaps,
    configured: Option<BackendKind>,
    get: impl Fn(&str) -> Option<String>,
) -> Result<BackendChoice, TransportError> {
    let nonempty = |k: &str| get(k).filter(|v| !v.trim().is_empty()).map(|v| (k.to_string(), v));
    let forced = nonempty("MKERNEL_TRANSPORT").or_else(|| nonempty("MKERNEL_NET_BACKEND"));
    let emulated = nonempty("MKERNEL_EMULATED_NODES");
    let forced = match forced {
        None => configured.map(|k| (format!("CommConfig::transport = {k}"), k)),
        Some((var, v)) => Some((
            format!("{var}={}", v.trim()),
            BackendKind::parse(&v).ok_or_else(|| {
                TransportError::Config(format!("{var}={v:?}: expected tcp, ibverbs, efa or emulated"))
            })?,
        )),
    };
    let looked = format!("{}/class/infiniband", sysfs_root.display());
    match forced {
        Some((why, BackendKind::Emulated)) => {
            if emulated.is_none() && topology.nnodes() > 1 {
                return Err(TransportError::Config(format!(
                    "{why}, but the job spans {} real nodes and the emulated wire only connects ranks of one host (launch with --nodes for emulated nodes)",
                    topology.nnodes()
                )));
            }
            return Ok(BackendChoice {
                kind: BackendKind::Emulated,
                nic: None,
                reason: why,
            });
        }
        Some((why, BackendKind::Tcp)) => {
            return Ok(BackendChoice {
                kind: BackendKind::Tcp,
                nic: None,
                reason: why,
            })
        }
        Some((why, kind)) => {
            if !caps.rdma_built {
                return Err(TransportError::Config(format!(
                    "{why}, but this build has no RDMA backends (cargo feature `rdma` of mkernel / mkernel-proxy)"
                )));
            }
            if let Err(e) = &caps.libibverbs {
                return Err(TransportError::NoDevice(format!("{why}, but {e}")));
            }
            let nic = pick_nic(topology, sysfs_root, gpu_bus_id, &get)?
                .ok_or_else(|| TransportError::NoDevice(format!("{why}, but there is nothing under {looked}")))?;
            let want = if kind == BackendKind::EfaSrd {
                NicKind::Efa
            } else {
                NicKind::Rc
            };
            if nic.nic.kind != want {
                return Err(TransportError::Config(format!(
                    "{why}, but the NIC for this GPU, {}, is {:?}",
                    nic.nic.name, nic.nic.kind
                )));
            }
            if kind == BackendKind::IbverbsRc {
                caps.gpu_registration(sysfs_root).map_err(|e| {
                    TransportError::NoDevice(format!("{why}: {} cannot reach GPU memory: {e}", nic.nic.name))
                })?;
            }
            let reason = format!("{why}: {} port {} ({})", nic.nic.name, nic.port, nic.reason);
            return Ok(BackendChoice {
                kind,
                nic: Some(nic),
                reason,
            });
        }
        None => {}
    }
    if let Some((_, n)) = emulated {
        return Ok(BackendChoice {
            kind: BackendKind::Emulated,
            nic: None,
            reason: format!("emulated nodes requested (MKERNEL_EMULATED_NODES={n})"),
        });
    }
    Ok(BackendChoice {
        kind: BackendKind::Tcp,
        nic: None,
        reason: "the default (ibverbs RC and EFA SRD have not run on a NIC yet: MKERNEL_TRANSPORT=ibverbs or efa \
                 asks for them)"
            .into(),
    })
}

/// The NIC for this GPU, `None` when sysfs lists none.
fn pick_nic(
    topology: &Topology,
    sysfs_root: &Path,
    gpu_bus_id: Option<&str>,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<Option<NicChoice>, TransportError> {
    let nics = list_nics(sysfs_root)?;
    if nics.is_empty() {
        return Ok(None);
    }
    let gpu = gpu_bus_id.and_then(|b| gpu_location(sysfs_root, b).ok());
    choose_nic(
        &nics,
        gpu.as_ref(),
        topology.local_rank(),
        get("MKERNEL_NET_DEVICE").as_deref(),
    )
    .map(Some)
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

    fn caps(dmabuf: bool) -> HostCaps {
        HostCaps {
            rdma_built: true,
            libibverbs: Ok(true),
            gpu_dmabuf: dmabuf,
        }
    }

    #[test]
    fn no_device_means_tcp_and_forcing_rdma_names_what_is_missing() {
        let t = TempDir::new("backend-none");
        let two = Topology::new(2, 4, 0).unwrap();
        let c = choose(&two, &t.0, None, &caps(true), vars(&[])).unwrap();
        assert_eq!(c.kind, BackendKind::Tcp);
        assert!(c.reason.contains("the default"), "{}", c.reason);
        assert_eq!(
            choose(&two, &t.0, None, &caps(true), vars(&[("MKERNEL_EMULATED_NODES", "2")]))
                .unwrap()
                .kind,
            BackendKind::Emulated
        );
        // An explicit choice beats emulated nodes: TCP between emulated nodes of one host.
        let both = vars(&[("MKERNEL_EMULATED_NODES", "2"), ("MKERNEL_TRANSPORT", "tcp")]);
        assert_eq!(
            choose(&two, &t.0, None, &caps(true), both).unwrap().kind,
            BackendKind::Tcp
        );
        let e = choose(&two, &t.0, None, &caps(true), vars(&[("MKERNEL_TRANSPORT", "ibverbs")])).unwrap_err();
        assert!(e.to_string().contains("nothing under"), "{e}");
        let e = choose(
            &two,
            &t.0,
            None,
            &caps(true),
            vars(&[("MKERNEL_TRANSPORT", "emulated")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("2 real nodes"), "{e}");
        let e = choose(&two, &t.0, None, &caps(true), vars(&[("MKERNEL_TRANSPORT", "udp")])).unwrap_err();
        assert!(e.to_string().contains("MKERNEL_TRANSPORT=\"udp\""), "{e}");
        let unbuilt = HostCaps {
            rdma_built: false,
            ..caps(true)
        };
        let e = choose(&two, &t.0, None, &unbuilt, vars(&[("MKERNEL_TRANSPORT", "efa")])).unwrap_err();
        assert!(e.to_string().contains("feature `rdma`"), "{e}");
        let nolib = HostCaps {
            libibverbs: Err("libibverbs is not usable (libibverbs.so.1: not found)".into()),
            ..caps(true)
        };
        let e = choose(&two, &t.0, None, &nolib, vars(&[("MKERNEL_NET_BACKEND", "ibverbs")])).unwrap_err();
        assert!(e.to_string().contains("libibverbs.so.1"), "{e}");
    }

    /// With an RC and an EFA NIC present, nothing picks RDMA by itself (neither has run on a
    /// NIC); asked for by the environment or the program, the NIC and GPU registration decide;
    /// the environment overrides the program.
    #[test]
    fn rdma_only_when_asked_for_and_then_the_nic_decides() {
        let t = TempDir::new("backend-nics");
        fake_tree(&t.0);
        let two = Topology::new(2, 4, 1).unwrap();
        let c = choose(&two, &t.0, Some("0000:23:00.0"), &caps(true), vars(&[])).unwrap();
        assert_eq!((c.kind, c.nic.is_none()), (BackendKind::Tcp, true), "{}", c.reason);
        // mlx5 present, dma-buf works, RC asked for: RC on the GPU's nearest NIC.
        let rc = vars(&[("MKERNEL_TRANSPORT", "ibverbs")]);
        let c = choose(&two, &t.0, Some("0000:23:00.0"), &caps(true), rc).unwrap();
        assert_eq!(
            (c.kind, c.nic.as_ref().map(|n| n.nic.name.as_str())),
            (BackendKind::IbverbsRc, Some("mlx5_1"))
        );
        println!("{}", c.reason);
        let configured = Some(BackendKind::IbverbsRc);
        let c = choose_with(&two, &t.0, Some("0000:23:00.0"), &caps(true), configured, vars(&[])).unwrap();
        assert_eq!(c.kind, BackendKind::IbverbsRc);
        assert!(c.reason.contains("CommConfig::transport = ibverbs"), "{}", c.reason);
        let env_tcp = vars(&[("MKERNEL_TRANSPORT", "tcp")]);
        let c = choose_with(&two, &t.0, None, &caps(true), configured, env_tcp).unwrap();
        assert_eq!(c.kind, BackendKind::Tcp);
        // No way to register GPU memory: asking for RC says why.
        let e = choose(
            &two,
            &t.0,
            None,
            &caps(false),
            vars(&[("MKERNEL_TRANSPORT", "ibverbs")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("nvidia-peermem"), "{e}");
        let e = choose_with(&two, &t.0, None, &caps(false), configured, vars(&[])).unwrap_err();
        assert!(e.to_string().contains("CommConfig::transport"), "{e}");
        // nvidia-peermem loaded is enough.
        std::fs::create_dir_all(t.0.join("module/nvidia_peermem")).unwrap();
        assert_eq!(
            choose(&two, &t.0, None, &caps(false), vars(&[("MKERNEL_TRANSPORT", "rc")]))
                .unwrap()
                .kind,
            BackendKind::IbverbsRc
        );
        assert_eq!(
            choose(&two, &t.0, None, &caps(false), vars(&[])).unwrap().kind,
            BackendKind::Tcp
        );
        assert!(choose(&two, &t.0, None, &caps(true), vars(&[("MKERNEL_TRANSPORT", "efa")])).is_err());
        let e = TempDir::new("backend-efa");
        nic(
            &e.0,
            "rdmap16s27",
            &["pci0000:10", "0000:10:1b.0"],
            0,
            "efa",
            "4: ACTIVE\n",
        );
        assert_eq!(
            choose(&two, &e.0, None, &caps(false), vars(&[])).unwrap().kind,
            BackendKind::Tcp
        );
        let c = choose(&two, &e.0, None, &caps(false), vars(&[("MKERNEL_TRANSPORT", "efa")])).unwrap();
        assert_eq!(c.kind, BackendKind::EfaSrd);
        assert_eq!(
            BackendKind::parse(BackendKind::EfaSrd.name()),
            Some(BackendKind::EfaSrd)
        );
    }
}
