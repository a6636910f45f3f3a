//! Generates the Rust types and service stubs for `ditstream/v1/*.proto`. The .proto files are
//! parsed by `protox` (pure Rust), so building needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=ditstream/v1/video.proto");
    let descriptors = protox::compile(["ditstream/v1/video.proto"], ["."])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
