//! The shared vocabulary of Tidemark: what a task is, what a cursor and a shard range are and
//! how they are encoded, what a batch and its manifest are, how SQL for PostgreSQL is written
//! safely, where staged objects live, and how secrets are kept out of logs.

pub mod batch;
pub mod config;
pub mod contract;
pub mod copy_binary;
pub mod copy_format;
pub mod copy_text;
pub mod crash;
pub mod cursor;
pub mod dead_letters;
pub mod duration;
pub mod engines;
pub mod id_tail;
pub mod metrics;
pub mod mysql;
pub mod pg;
pub mod reconcile_reads;
pub mod redact;
pub mod source;
pub mod staging;
pub mod target;
pub mod telemetry;
pub mod text_to_binary;
pub mod tls;
pub mod transform;
pub mod write;
