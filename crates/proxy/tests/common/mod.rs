//! An in-process job: every rank has a heap FIFO, a CPU producer playing its GPU, and a proxy
//! over the emulated wire; all ranks share one CpuFabric (their data regions and flag arrays).
#![allow(dead_code)]
use mkernel_proxy::emulated::{CpuCopyEngine, CpuFabric, EmulatedTransport, WireModel};
use mkernel_proxy::{
    Backoff, Fifo, FifoConsumer, FifoProducer, HeapFifo, Proxy, ProxyConfig, Regions, Topology, Validator,
};
use std::sync::Arc;
use std::time::Duration;

pub const WAIT: Duration = Duration::from_secs(20);

pub struct Rank {
    pub topo: Topology,
    pub fifo: Fifo<HeapFifo>,
    pub producer: FifoProducer<HeapFifo>,
    pub proxy: Option<Proxy>,
}

pub struct Job {
    pub fabric: Arc<CpuFabric>,
    pub ranks: Vec<Rank>,
    pub model: WireModel,
    pub backoff: Backoff,
}

impl Job {
    /// `nnodes` x `local` ranks with FIFOs of `capacity` slots; proxies not started.
    pub fn idle(
        nnodes: usize,
        local: usize,
        capacity: u32,
        data_bytes: usize,
        flag_words: usize,
        model: WireModel,
    ) -> Job {
        let world = nnodes * local;
        let fabric = CpuFabric::new(world, data_bytes, flag_words);
        let ranks = (0..world)
            .map(|r| {
                let fifo = Fifo::new(HeapFifo::new(capacity, r as u32).unwrap()).unwrap();
                Rank {
                    topo: Topology::new(nnodes, local, r).unwrap(),
                    producer: FifoProducer::new(fifo.clone()),
                    fifo,
                    proxy: None,
                }
            })
            .collect();
        Job {
            fabric,
            ranks,
            model,
            backoff: Backoff::gentle(),
        }
    }

    /// Like `idle`, with every proxy running.
    pub fn new(
        nnodes: usize,
        local: usize,
        capacity: u32,
        data_bytes: usize,
        flag_words: usize,
        model: WireModel,
    ) -> Job {
        let mut j = Job::idle(nnodes, local, capacity, data_bytes, flag_words, model);
        for r in 0..j.ranks.len() {
            j.start_proxy(r);
        }
        j
    }

    pub fn start_proxy(&mut self, r: usize) {
        let rank = &mut self.ranks[r];
        let regions = Regions::symmetric(&rank.topo, self.fabric.data_bytes(), self.fabric.flag_bytes());
        let consumer = FifoConsumer::new(rank.fifo.clone(), Validator::new(regions)).unwrap();
        let transport = EmulatedTransport::new(r, CpuCopyEngine::new(self.fabric.clone()), self.model);
        let cfg = ProxyConfig {
            backoff: self.backoff,
            ..ProxyConfig::default()
        };
        rank.proxy = Some(Proxy::spawn(consumer, transport, cfg).unwrap());
    }

    pub fn producer(&self, r: usize) -> FifoProducer<HeapFifo> {
        self.ranks[r].producer.clone()
    }

    pub fn take_proxy(&mut self, r: usize) -> Proxy {
        self.ranks[r].proxy.take().unwrap()
    }
}

pub fn u64_at(fabric: &CpuFabric, rank: usize, off: u64) -> u64 {
    let b = fabric.read(rank, off, 8).unwrap();
    u64::from_le_bytes(b.try_into().unwrap())
}
