//! Keel coordinator library: jobs, corpus preparation, membership, step orchestration, checkpoints.

pub mod data;
