//! Generated gRPC types and services of the `tidemark.v1` package.
#![allow(clippy::all, clippy::pedantic)]

pub mod v1 {
    tonic::include_proto!("tidemark.v1");
}
