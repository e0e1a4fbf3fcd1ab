//! The Tidemark coordinator: plans shards, leases them to workers through etcd, and keeps
//! fenced checkpoints in the control database.

pub mod admin_cli;
pub mod batches;
pub mod capacity;
pub mod checkpoints;
mod claim_queue;
pub mod cli;
pub mod control_copy;
pub mod control_statistics;
pub mod discover;
pub(crate) mod engines;
pub mod epochs;
pub mod error;
mod groups;
pub mod history;
pub mod janitor;
pub mod leader;
pub mod leases;
pub mod metrics;
pub mod mysql;
mod off_runtime;
pub mod operations;
pub(crate) mod pacing;
pub mod planner;
pub mod postgres;
pub mod reconcile_runs;
pub mod serve;
pub mod service;
pub mod source_install;
pub mod sqlite_control;
pub mod status;
pub mod watcher;
mod workers_seen;
