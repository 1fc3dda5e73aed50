//! burnmix: a mixed-precision training engine built on Burn.
//!
//! This root crate re-exports the workspace's crates and holds the workspace-level integration tests
//! (`tests/`). See the README for the `train` binary.

pub use kernels;
pub use model;
pub use trainer;
