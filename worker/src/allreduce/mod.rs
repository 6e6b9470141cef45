//! Ring all-reduce between workers over gRPC (to be written).
pub mod bench;
