//! The Tidemark worker: a stateless loop that acquires shards from the coordinator and moves
//! their rows from source to target through immutable staged batches.

pub mod apply;
pub mod cli;
pub mod client;
pub mod error;
pub mod metrics;
pub mod page_format;
pub mod pipeline;
pub mod recent_rows;
pub mod reconcile;
pub mod resources;
pub mod runner;
pub mod source;
