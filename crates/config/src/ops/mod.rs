//! One module per operation: its argument blocks, kernel specs, shared-memory layouts and
//! warp-role tables.

pub mod attention;
pub mod moe;
