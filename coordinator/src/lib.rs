//! The Tidemark coordinator: plans shards, leases them to workers through etcd, and keeps
//! fenced checkpoints in the control database.

pub mod checkpoints;
pub mod error;
pub mod janitor;
pub mod leases;
pub mod planner;
pub mod service;
pub mod status;
pub mod watcher;
