//! Compiles `tidemark/v1/*.proto` with protox (pure Rust), so no system `protoc` is needed
//! for our own contract.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["tidemark/v1/worker.proto", "tidemark/v1/admin.proto"];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let file_descriptors = protox::compile(protos, ["."])?;
    tonic_prost_build::configure().compile_fds(file_descriptors)?;
    Ok(())
}
