//! Finding RDMA NICs in sysfs and choosing the one closest to a GPU.
//!
//! Everything takes the sysfs root as a parameter (`/sys` in production), so tests build a fake
//! tree in a temporary directory:
//!
//! ```text
//! <root>/class/infiniband/<dev>/device  -> symlink to <root>/devices/pci0000:16/.../0000:17:00.0
//! <root>/class/infiniband/<dev>/ports/<n>/{state,link_layer,rate}
//! <root>/class/infiniband/<dev>/ports/<n>/gids/<i>, gid_attrs/types/<i>
//! <root>/bus/pci/devices/<bdf>          -> symlink to the GPU's directory under <root>/devices
//! <pci device dir>/numa_node, driver    (driver: symlink whose last component names the driver)
//! ```
use crate::error::TransportError;
use std::fs;
use std::path::{Path, PathBuf};

/// Transport family of a NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NicKind {
    /// InfiniBand or RoCE HCA: reliable connected queue pairs.
    Rc,
    /// AWS EFA: scalable reliable datagrams.
    Efa,
}

/// One port of a NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (1-based).
    pub num: u8,
    /// State is ACTIVE.
    pub active: bool,
    /// "InfiniBand", "Ethernet" (RoCE) or "Unknown".
    pub link_layer: String,
    /// Rate text, e.g. "400 Gb/sec (4X NDR)".
    pub rate: String,
}

/// A NIC as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicInfo {
    /// Device name (`mlx5_0`, `efa_0`, `rdmap16s27`).
    pub name: String,
    /// PCI path below `devices/`: root complex, bridges, the device (e.g.
    /// `["pci0000:16", "0000:16:02.0", "0000:17:00.0"]`).
    pub pci_path: Vec<String>,
    /// NUMA node, if known (sysfs says -1 when unknown).
    pub numa_node: Option<u32>,
    /// Family.
    pub kind: NicKind,
    /// Ports.
    pub ports: Vec<PortInfo>,
}

impl NicInfo {
    /// The first active port.
    pub fn active_port(&self) -> Option<&PortInfo> {
        self.ports.iter().find(|p| p.active)
    }
}

/// Where a GPU sits on the PCI tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciLocation {
    /// Canonical bus id (`0000:18:00.0`).
    pub bus_id: String,
    /// Path below `devices/`.
    pub pci_path: Vec<String>,
    /// NUMA node, if known.
    pub numa_node: Option<u32>,
}

/// The chosen NIC and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicChoice {
    /// The NIC.
    pub nic: NicInfo,
    /// The port to use.
    pub port: u8,
    /// Why it was chosen (for logs).
    pub reason: String,
}

/// `domain:bus:device.function` in lowercase with a 4-digit domain (CUDA and nvidia-smi print
/// 8-digit domains and uppercase hex). `None` if `s` is not a bus id.
pub fn normalize_bus_id(s: &str) -> Option<String> {
    let s = s.trim().to_ascii_lowercase();
    let (rest, func) = s.rsplit_once('.')?;
    let parts: Vec<&str> = rest.split(':').collect();
    let hex = |p: &str, max: usize| !p.is_empty() && p.len() <= max && p.chars().all(|c| c.is_ascii_hexdigit());
    let (domain, bus, dev) = match parts.as_slice() {
        [d, b, v] => (*d, *b, *v),
        [b, v] => ("0", *b, *v),
        _ => return None,
    };
    if !hex(domain, 8) || !hex(bus, 2) || !hex(dev, 2) || !hex(func, 1) {
        return None;
    }
    let domain = u32::from_str_radix(domain, 16).ok()?;
    Some(format!("{domain:04x}:{:0>2}:{:0>2}.{func}", bus, dev))
}

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

fn numa_of(dev_dir: &Path) -> Option<u32> {
    read_trim(&dev_dir.join("numa_node"))
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok())
}

/// The components of `link`'s target below `<root>/devices`.
fn pci_path(root: &Path, link: &Path) -> Result<(Vec<String>, PathBuf), TransportError> {
    let sys = |source| TransportError::Sysfs {
        path: link.display().to_string(),
        source,
    };
    let target = fs::canonicalize(link).map_err(sys)?;
    let devices = fs::canonicalize(root.join("devices")).map_err(|source| TransportError::Sysfs {
        path: root.join("devices").display().to_string(),
        source,
    })?;
    let rel = target.strip_prefix(&devices).map_err(|_| TransportError::Sysfs {
        path: link.display().to_string(),
        source: std::io::Error::other(format!("{} is not under {}", target.display(), devices.display())),
    })?;
    Ok((rel.iter().map(|c| c.to_string_lossy().into_owned()).collect(), target))
}

fn ports(dev: &Path) -> Vec<PortInfo> {
    let mut out = vec![];
    let Ok(entries) = fs::read_dir(dev.join("ports")) else {
        return out;
    };
    for e in entries.flatten() {
        let Some(num) = e.file_name().to_str().and_then(|s| s.parse::<u8>().ok()) else {
            continue;
        };
        let p = e.path();
        let state = read_trim(&p.join("state")).unwrap_or_default();
        out.push(PortInfo {
            num,
            active: state.ends_with("ACTIVE") && !state.contains("DEFER"),
            link_layer: read_trim(&p.join("link_layer")).unwrap_or_else(|| "Unknown".into()),
            rate: read_trim(&p.join("rate")).unwrap_or_default(),
        });
    }
    out.sort_by_key(|p| p.num);
    out
}

/// Every RDMA device under `<root>/class/infiniband`, sorted by name. An absent directory
/// means no devices (an empty list, not an error).
pub fn list_nics(root: &Path) -> Result<Vec<NicInfo>, TransportError> {
    let class = root.join("class/infiniband");
    let entries = match fs::read_dir(&class) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(source) => {
            return Err(TransportError::Sysfs {
                path: class.display().to_string(),
                source,
            })
        }
    };
    let mut nics = vec![];
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let dev = class.join(&name);
        let (path, target) = pci_path(root, &dev.join("device"))?;
        let driver = fs::read_link(target.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()));
        let kind = if driver.as_deref() == Some("efa") || name.starts_with("efa") || name.starts_with("rdmap") {
            NicKind::Efa
        } else {
            NicKind::Rc
        };
        nics.push(NicInfo {
            name,
            pci_path: path,
            numa_node: numa_of(&target),
            kind,
            ports: ports(&dev),
        });
    }
    nics.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(nics)
}

/// Where the GPU with PCI bus id `bus_id` sits (from `<root>/bus/pci/devices/<bdf>`).
pub fn gpu_location(root: &Path, bus_id: &str) -> Result<PciLocation, TransportError> {
    let bdf =
        normalize_bus_id(bus_id).ok_or_else(|| TransportError::Config(format!("{bus_id:?} is not a PCI bus id")))?;
    let (pci_path, target) = pci_path(root, &root.join("bus/pci/devices").join(&bdf))?;
    Ok(PciLocation {
        bus_id: bdf,
        pci_path,
        numa_node: numa_of(&target),
    })
}

fn common_prefix(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Chooses a NIC for a GPU.
///
/// `force`: a device name, optionally with `:port` (from `MKERNEL_NET_DEVICE`), wins if it exists.
/// Otherwise among NICs with an active port: the longest common PCI path prefix with the GPU
/// (same switch beats same root complex), then the same NUMA node; ties are spread over local
/// ranks (`local_rank % ties`). Without a GPU location, NICs are dealt round-robin by local rank.
pub fn choose_nic(
    nics: &[NicInfo],
    gpu: Option<&PciLocation>,
    local_rank: usize,
    force: Option<&str>,
) -> Result<NicChoice, TransportError> {
    if nics.is_empty() {
        return Err(TransportError::NoDevice(
            "no RDMA device under <sysfs>/class/infiniband".into(),
        ));
    }
    if let Some(f) = force.filter(|f| !f.is_empty()) {
        let (name, port) = match f.split_once(':') {
            Some((n, p)) => (
                n,
                Some(
                    p.parse::<u8>()
                        .map_err(|_| TransportError::Config(format!("MKERNEL_NET_DEVICE={f:?}: bad port")))?,
                ),
            ),
            None => (f, None),
        };
        let nic = nics.iter().find(|n| n.name == name).ok_or_else(|| {
            TransportError::NoDevice(format!(
                "MKERNEL_NET_DEVICE={f} is not among {:?}",
                nics.iter().map(|n| &n.name).collect::<Vec<_>>()
            ))
        })?;
        let port = port.or_else(|| nic.active_port().map(|p| p.num)).unwrap_or(1);
        return Ok(NicChoice {
            nic: nic.clone(),
            port,
            reason: format!("forced by MKERNEL_NET_DEVICE={f}"),
        });
    }
    let active: Vec<&NicInfo> = nics.iter().filter(|n| n.active_port().is_some()).collect();
    if active.is_empty() {
        return Err(TransportError::NoDevice(format!(
            "RDMA devices {:?} have no ACTIVE port",
            nics.iter().map(|n| &n.name).collect::<Vec<_>>()
        )));
    }
    let score = |n: &NicInfo| -> (usize, bool) {
        match gpu {
            Some(g) => (
                common_prefix(&n.pci_path, &g.pci_path),
                n.numa_node.is_some() && n.numa_node == g.numa_node,
            ),
            None => (0, false),
        }
    };
    let best = active.iter().map(|n| score(n)).max().unwrap_or((0, false));
    let ties: Vec<&&NicInfo> = active.iter().filter(|n| score(n) == best).collect();
    let pick = ties[local_rank % ties.len()];
    let port = pick.active_port().map_or(1, |p| p.num);
    let reason = match gpu {
        Some(g) => format!(
            "GPU {}: {} shared PCI levels, same NUMA node: {}, {} equally close NIC(s), local rank {local_rank}",
            g.bus_id,
            best.0,
            best.1,
            ties.len()
        ),
        None => format!(
            "GPU location unknown: round-robin over {} active NICs by local rank {local_rank}",
            active.len()
        ),
    };
    Ok(NicChoice {
        nic: (*pick).clone(),
        port,
        reason,
    })
}

/// The GID index to use on a RoCE port: the first RoCE v2 GID holding an IPv4-mapped address,
/// else the first RoCE v2 GID, else the first nonzero GID, else 0. (InfiniBand ports use 0.)
pub fn choose_gid_index(root: &Path, dev: &str, port: u8) -> u32 {
    let base = root
        .join("class/infiniband")
        .join(dev)
        .join("ports")
        .join(port.to_string());
    let mut v2 = None;
    let mut any = None;
    for i in 0..256u32 {
        let Some(gid) = read_trim(&base.join("gids").join(i.to_string())) else {
            break;
        };
        if gid.chars().all(|c| c == '0' || c == ':') {
            continue;
        }
        any.get_or_insert(i);
        let ty = read_trim(&base.join("gid_attrs/types").join(i.to_string())).unwrap_or_default();
        if ty.eq_ignore_ascii_case("RoCE v2") {
            if gid.starts_with("0000:0000:0000:0000:0000:ffff:") {
                return i;
            }
            v2.get_or_insert(i);
        }
    }
    v2.or(any).unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A temporary directory removed on drop.
    pub(crate) struct TempDir(pub PathBuf);
    impl TempDir {
        pub(crate) fn new(tag: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!(
                "mkernel-proxy-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn write(p: &Path, s: &str) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, s).unwrap();
    }

    /// Adds a PCI device at `path` (components below devices/) with a NUMA node and driver.
    fn pci(root: &Path, path: &[&str], numa: i32, driver: &str) -> PathBuf {
        let dir = path.iter().fold(root.join("devices"), |p, c| p.join(c));
        fs::create_dir_all(&dir).unwrap();
        write(&dir.join("numa_node"), &format!("{numa}\n"));
        let drv = root.join("bus/pci/drivers").join(driver);
        fs::create_dir_all(&drv).unwrap();
        symlink(&drv, dir.join("driver")).unwrap();
        let bdf = path.last().unwrap();
        fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        symlink(&dir, root.join("bus/pci/devices").join(bdf)).unwrap();
        dir
    }

    pub(crate) fn nic(root: &Path, name: &str, path: &[&str], numa: i32, driver: &str, state: &str) {
        let dir = pci(root, path, numa, driver);
        let ib = dir.join("infiniband").join(name);
        write(&ib.join("ports/1/state"), state);
        write(&ib.join("ports/1/link_layer"), "InfiniBand\n");
        write(&ib.join("ports/1/rate"), "400 Gb/sec (4X NDR)\n");
        symlink(&dir, ib.join("device")).unwrap();
        fs::create_dir_all(root.join("class/infiniband")).unwrap();
        symlink(&ib, root.join("class/infiniband").join(name)).unwrap();
    }

    /// Two sockets; each has two PCIe switches with one GPU and one NIC behind each.
    pub(crate) fn fake_tree(root: &Path) {
        nic(
            root,
            "mlx5_0",
            &["pci0000:10", "0000:10:01.0", "0000:11:00.0", "0000:12:00.0"],
            0,
            "mlx5_core",
            "4: ACTIVE\n",
        );
        nic(
            root,
            "mlx5_1",
            &["pci0000:10", "0000:10:02.0", "0000:21:00.0", "0000:22:00.0"],
            0,
            "mlx5_core",
            "4: ACTIVE\n",
        );
        nic(
            root,
            "mlx5_2",
            &["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.0"],
            1,
            "mlx5_core",
            "1: DOWN\n",
        );
        nic(
            root,
            "mlx5_3",
            &["pci0000:90", "0000:90:01.0", "0000:91:00.0", "0000:92:00.0"],
            1,
            "mlx5_core",
            "4: ACTIVE\n",
        );
        pci(
            root,
            &["pci0000:10", "0000:10:01.0", "0000:11:00.0", "0000:13:00.0"],
            0,
            "nvidia",
        );
        pci(
            root,
            &["pci0000:10", "0000:10:02.0", "0000:21:00.0", "0000:23:00.0"],
            0,
            "nvidia",
        );
        pci(
            root,
            &["pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:83:00.0"],
            1,
            "nvidia",
        );
    }

    #[test]
    fn bus_ids_normalize() {
        assert_eq!(normalize_bus_id("00000000:1B:00.0").as_deref(), Some("0000:1b:00.0"));
        assert_eq!(normalize_bus_id("0000:18:00.0").as_deref(), Some("0000:18:00.0"));
        assert_eq!(normalize_bus_id("18:00.0").as_deref(), Some("0000:18:00.0"));
        assert_eq!(normalize_bus_id("gpu0"), None);
        assert_eq!(normalize_bus_id("0000:18:00"), None);
    }

    #[test]
    fn nics_are_listed_with_their_pci_path_and_ports() {
        let t = TempDir::new("sysfs-list");
        fake_tree(&t.0);
        let nics = list_nics(&t.0).unwrap();
        assert_eq!(
            nics.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
            ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
        );
        assert_eq!(
            nics[0].pci_path,
            ["pci0000:10", "0000:10:01.0", "0000:11:00.0", "0000:12:00.0"]
        );
        assert_eq!((nics[0].numa_node, nics[0].kind), (Some(0), NicKind::Rc));
        assert!(nics[0].ports[0].active && !nics[2].ports[0].active);
        assert_eq!(nics[0].ports[0].rate, "400 Gb/sec (4X NDR)");
        assert!(list_nics(&t.0.join("nothing")).unwrap().is_empty());
    }

    #[test]
    fn the_closest_active_nic_wins() {
        let t = TempDir::new("sysfs-choose");
        fake_tree(&t.0);
        let nics = list_nics(&t.0).unwrap();
        let gpu = |b: &str| gpu_location(&t.0, b).unwrap();
        // Same PCIe switch.
        assert_eq!(
            choose_nic(&nics, Some(&gpu("0000:13:00.0")), 0, None).unwrap().nic.name,
            "mlx5_0"
        );
        assert_eq!(
            choose_nic(&nics, Some(&gpu("00000000:23:00.0")), 1, None)
                .unwrap()
                .nic
                .name,
            "mlx5_1"
        );
        // Its switch's NIC is down: the NIC of the same NUMA node (other root complex) wins.
        let c = choose_nic(&nics, Some(&gpu("0000:83:00.0")), 2, None).unwrap();
        assert_eq!(c.nic.name, "mlx5_3", "{}", c.reason);
        assert_eq!(c.port, 1);
        // Forced.
        assert_eq!(choose_nic(&nics, None, 0, Some("mlx5_2:1")).unwrap().nic.name, "mlx5_2");
        assert!(choose_nic(&nics, None, 0, Some("mlx5_9")).is_err());
        // Unknown GPU location: round-robin over active NICs.
        let rr: Vec<String> = (0..4)
            .map(|r| choose_nic(&nics, None, r, None).unwrap().nic.name)
            .collect();
        assert_eq!(rr, ["mlx5_0", "mlx5_1", "mlx5_3", "mlx5_0"]);
        assert!(matches!(
            choose_nic(&[], None, 0, None),
            Err(TransportError::NoDevice(_))
        ));
        assert!(gpu_location(&t.0, "0000:99:00.0").is_err());
    }

    #[test]
    fn roce_gid_index_prefers_v2_ipv4() {
        let t = TempDir::new("sysfs-gid");
        let p = t.0.join("class/infiniband/mlx5_0/ports/1");
        write(&p.join("gids/0"), "fe80:0000:0000:0000:0a00:27ff:fe00:0001\n");
        write(&p.join("gid_attrs/types/0"), "IB/RoCE v1\n");
        write(&p.join("gids/1"), "fe80:0000:0000:0000:0a00:27ff:fe00:0001\n");
        write(&p.join("gid_attrs/types/1"), "RoCE v2\n");
        write(&p.join("gids/2"), "0000:0000:0000:0000:0000:0000:0000:0000\n");
        write(&p.join("gids/3"), "0000:0000:0000:0000:0000:ffff:0a00:0001\n");
        write(&p.join("gid_attrs/types/3"), "RoCE v2\n");
        assert_eq!(choose_gid_index(&t.0, "mlx5_0", 1), 3);
        fs::remove_file(p.join("gids/3")).unwrap();
        assert_eq!(choose_gid_index(&t.0, "mlx5_0", 1), 1);
        assert_eq!(choose_gid_index(&t.0, "mlx5_9", 1), 0);
    }
}
