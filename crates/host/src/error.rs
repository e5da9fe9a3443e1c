//! Errors of the mkernel runtime.
use cudarc::driver::DriverError;

/// Everything that can go wrong in mkernel's host code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver found (libcuda.so could not be loaded); mkernel needs an NVIDIA GPU with its driver")]
    NoDriver,
    /// The driver loaded but the requested device does not exist.
    #[error("CUDA device {ordinal} not found ({count} device(s) present)")]
    NoDevice { ordinal: usize, count: usize },
    /// The GPU cannot run the kernels (they need sm_90a: H100/H200).
    #[error("device {ordinal} is sm_{major}{minor}; mkernel's kernels need a Hopper GPU (sm_90)")]
    UnsupportedDevice { ordinal: usize, major: i32, minor: i32 },
    /// A shape argument is invalid for the operation.
    #[error("invalid shape for {op}: {reason}")]
    Shape { op: &'static str, reason: String },
    /// A pointer is not aligned as the operation requires.
    #[error("{op}: {what} pointer {ptr:#x} is not {align}-byte aligned")]
    Alignment {
        op: &'static str,
        what: &'static str,
        ptr: u64,
        align: u64,
    },
    /// A buffer is smaller than the shape needs.
    #[error("{op}: {what} holds {have} elements but the shape needs {need}")]
    BufferTooSmall {
        op: &'static str,
        what: &'static str,
        have: usize,
        need: usize,
    },
    /// A stream or buffer belongs to another CUDA context (another GPU, or a context other than
    /// the [`crate::Device`]'s primary one) than the operation's device.
    #[error("{op}: the {what} belongs to another CUDA context than the operation's device")]
    ForeignContext { op: &'static str, what: &'static str },
    /// A safe launch on a stream that is capturing a CUDA graph: the graph would keep the
    /// buffers' addresses past their borrows. Capture through the `unsafe` form the message
    /// names, whose contract covers the graph's lifetime.
    #[error("{op}: the stream is capturing a CUDA graph; a safe launch cannot keep its buffers alive for the graph's replays (use the unsafe `{alternative}`)")]
    Capturing {
        op: &'static str,
        alternative: &'static str,
    },
    /// A symmetric-heap buffer lies outside the heap's data region, or a rank is out of range.
    #[error("{op}: {reason}")]
    OutOfRange { op: &'static str, reason: String },
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// A device-side wait of a communication kernel gave up.
    #[error("rank {rank} ({role} CTA {cta}) timed out after {waited_ms} ms waiting for rank {peer}'s {flag}: expected {expected}, saw {seen}")]
    CommTimeout {
        rank: u32,
        role: &'static str,
        flag: String,
        peer: u32,
        cta: u32,
        expected: u64,
        seen: u64,
        waited_ms: u64,
    },
    /// The communicator was aborted (`Communicator::abort` of rank `by_rank`); `rank` (global)
    /// is the rank whose record says so, `during` the wait that saw it, if one did. The results
    /// of the launches since the abort are not to be trusted; `Communicator::reset` makes the
    /// communicator usable again.
    #[error("rank {rank}: aborted by rank {by_rank}{}", during.as_ref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Aborted {
        rank: u32,
        by_rank: u32,
        during: Option<String>,
    },
    /// `Communicator::abort` raised this node's abort words, but the other nodes' were not
    /// confirmed in time (writes into their heaps on emulated nodes, their proxies'
    /// acknowledgements over TCP).
    #[error("abort: the other nodes' abort words were not confirmed within {waited_ms} ms")]
    AbortUndelivered { waited_ms: u64 },
    /// The routing gave a pair an expert id outside `0..experts` (the first one seen; the
    /// pair was not routed).
    #[error("moe: token {token}'s expert {k} has id {id}, outside 0..{experts} ({bad} pair(s) with a bad id)")]
    MoeExpertId {
        token: usize,
        k: usize,
        id: i32,
        experts: usize,
        bad: usize,
    },
    /// A collective plan's own checks failed on some ranks (`ranks`, global): every rank of
    /// the communicator returns this error, `reason` giving each failed rank's error
    /// (`comm::agree`).
    #[error("{op}: the plan failed on {}: {reason}", ranks_list(ranks))]
    PlanFailed {
        op: &'static str,
        ranks: Vec<usize>,
        reason: String,
    },
    /// The ranks described different plans: `field` differs, `values` says which ranks hold
    /// which value (`comm::agree`). Every rank of the communicator returns this error.
    #[error("{op}: ranks disagree on {field}: {values}")]
    PlanMismatch {
        op: &'static str,
        field: String,
        values: String,
    },
    /// An operating-system call failed (e.g. the shared page of the host abort words).
    #[error("{what}: {source}")]
    Os {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The request is valid but not implemented (yet); the message says what is missing.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The inter-node proxy failed; its error record.
    #[error("proxy: {0}")]
    Proxy(String),
    /// Bootstrap (store, fd passing, environment) failed.
    #[error("bootstrap: {0}")]
    Bootstrap(#[from] mkernel_bootstrap::Error),
    /// Ranks that share a GPU ask for more SMs for their persistent grids than it can hold at once.
    #[error(
        "ranks {ranks:?} share one GPU and their persistent grids need {ctas} SMs together, more than \
         {limit_percent}% of its {gpu_sms}: their kernels could not run at the same time. Launch them with \
         `xtask launch --share-gpu` (MPS shares and grid sizes that fit), or lower MKERNEL_PERSISTENT_SM_PERCENT \
         or CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (docs/testing.md, \"Co-residency\")"
    )]
    NotCoResident {
        ranks: Vec<usize>,
        ctas: u32,
        gpu_sms: u32,
        limit_percent: u32,
    },
    /// An environment variable that mkernel reads has a value it cannot use.
    #[error("environment variable {var}: {reason}")]
    Environment { var: &'static str, reason: String },
    /// The embedded PTX lacks a kernel the runtime expected (a build mismatch).
    #[error("kernel `{0}` is missing from the embedded PTX")]
    MissingKernel(&'static str),
}

fn ranks_list(ranks: &[usize]) -> String {
    let list = ranks.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
    if ranks.len() == 1 {
        format!("rank {list}")
    } else {
        format!("ranks {list}")
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
