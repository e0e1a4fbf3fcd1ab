//! The Tidemark coordinator: plans shards, leases them to workers through etcd, and keeps
//! fenced checkpoints in the control database.

pub mod admin_cli;
pub mod checkpoints;
pub mod dead_letters_mysql;
pub mod dead_letters_pg;
pub mod error;
pub mod janitor;
pub mod leader;
pub mod leases;
pub mod metrics;
pub mod operations;
pub mod planner;
pub mod reconcile_runs;
pub mod service;
pub mod source_install;
pub mod source_mysql;
pub mod source_pg;
pub mod status;
pub mod target_mysql;
pub mod target_pg;
pub mod watcher;
