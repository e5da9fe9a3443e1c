//! Per-operation configuration: argument blocks, kernel specs, shared-memory layouts, warp roles.

pub mod attention;
