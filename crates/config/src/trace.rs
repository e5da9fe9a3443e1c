//! Per-tile timeline of a fused GEMM+ReduceScatter/AllReduce launch (a diagnostic, off unless
//! the launch is given a trace buffer): where a compute CTA's time goes, tile by tile.
//!
//! Layout of the buffer (u64 words, `%globaltimer` nanoseconds): CTA `c`'s record of its
//! `i`-th tile (`i < TILES_PER_CTA`) is the `WORDS_PER_TILE` words from
//! `(c x (TILES_PER_CTA + 1) + i) x WORDS_PER_TILE`, indexed by [`Mark`]; the record after a
//! CTA's tiles (index `TILES_PER_CTA`) holds its end of launch ([`End`]). Thread 0 of the first
//! consumer warpgroup writes them, except `End::Entry` and `End::Setup` (the CTA's thread 0).
//! `Mark::MainloopClock`/`MainloopDoneClock` are `%clock64` cycles, not nanoseconds. Tiles past
//! `TILES_PER_CTA` are not recorded.

/// Tiles recorded per CTA.
pub const TILES_PER_CTA: u32 = 64;
/// Words per tile record.
pub const WORDS_PER_TILE: u32 = 10;
/// Words of the whole buffer for `ctas` CTAs.
pub const fn words(ctas: u32) -> usize {
    (ctas * (TILES_PER_CTA + 1) * WORDS_PER_TILE) as usize
}

/// Word of a tile record.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// Before the tile's prologue (partial prefetch, staging check).
    Begin = 0,
    /// Before the mainloop.
    Mainloop = 1,
    /// The mainloop's last `wgmma` retired.
    MainloopDone = 2,
    /// The previous tile was announced (its bulk stores completed).
    Published = 3,
    /// The tile's flags were seen (peers' partials landed, destination free).
    Waited = 4,
    /// Partials added (own tiles).
    Added = 5,
    /// The tile's bulk stores were issued.
    Stored = 6,
    /// `row tile << 40 | col tile << 20 | kind`: what the tile was ([`tile_kind`]).
    Tile = 7,
    /// `%clock64` (SM cycles) where `Mainloop` was stamped.
    MainloopClock = 8,
    /// `%clock64` where `MainloopDone` was stamped: cycles / nanoseconds of the mainloop is the
    /// SM clock it ran at.
    MainloopDoneClock = 9,
}

/// Words of the end-of-launch record.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The tile loop ended.
    LoopDone = 0,
    /// The last tile was announced and its stores drained.
    Drained = 1,
    /// AllReduce: every peer's reduced rows arrived (else equal to `Drained`).
    Done = 2,
    /// The CTA entered the kernel (thread 0, first instruction after reading the arguments).
    Entry = 3,
    /// The CTA's role setup ended (descriptor and arguments copied, barriers initialized).
    Setup = 4,
    /// The stager of consumer warpgroup 0 finished its last tile's stores (with stagers).
    Stager0Done = 5,
    /// The stager of consumer warpgroup 1 finished its last tile's stores.
    Stager1Done = 6,
    /// The CTA's relay raised its last flag (where relays run).
    RelayDone = 7,
    /// The launch's last warp finished (its end-of-launch work done): in that warp's CTA only.
    Exit = 8,
}

/// What a timeline record was (`Mark::Tile`'s low bits).
pub mod tile_kind {
    /// A peer's partial tile (sent).
    pub const PEER: u32 = 0;
    /// An own tile (reduced here).
    pub const OWN: u32 = 1;
    /// A stream-K contributor piece (K blocks of a tile another CTA finishes; no epilogue:
    /// `Waited` = its partial written, `Stored` = its flag raised).
    pub const PIECE: u32 = 2;
}
