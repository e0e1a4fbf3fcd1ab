//! Generated gRPC types and services of the `tidemark.v1` package.
#![allow(clippy::all, clippy::pedantic)]

pub mod v1 {
    tonic::include_proto!("tidemark.v1");
}

/// The largest answer an admin client accepts. `status` lists every shard (about 250 bytes
/// each): tonic's default of 4 MiB failed it past about 16,000 shards, and the CLI said only
/// that the coordinator did not answer (issue 20). 256 MiB holds a million shards.
pub const ADMIN_MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// An admin client on `channel` that accepts answers up to [`ADMIN_MAX_MESSAGE_BYTES`].
pub fn admin_client(
    channel: tonic::transport::Channel,
) -> v1::admin_service_client::AdminServiceClient<tonic::transport::Channel> {
    v1::admin_service_client::AdminServiceClient::new(channel).max_decoding_message_size(ADMIN_MAX_MESSAGE_BYTES)
}

impl v1::AcquireShardResponse {
    /// Every shard the acquire claimed: `assignment`, then `more`.
    pub fn assignments(self) -> Vec<v1::ShardAssignment> {
        self.assignment.into_iter().chain(self.more).collect()
    }
}
