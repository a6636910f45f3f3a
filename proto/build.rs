//! Generates the Rust types and service stubs for `ditstream/v1/*.proto`. The .proto files are
//! parsed by `protox` (pure Rust), so building needs no `protoc` on the machine.

/// The public API and the internal one between the gateway and the pools.
const PROTOS: [&str; 2] = ["ditstream/v1/video.proto", "ditstream/v1/pools.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["."])?;
    // For gRPC reflection (`ditstream_proto::FILE_DESCRIPTOR_SET`).
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("ditstream_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
