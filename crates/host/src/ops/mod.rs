//! Operations: a plan (buffers borrowed for its lifetime, descriptors encoded once) and a
//! one-shot function each.

pub mod attention;
