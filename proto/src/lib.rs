//! ditstream's gRPC API, versioned as `ditstream.v1`. Generated code only: conversions between
//! wire and domain types live in the service that owns them.

/// The public client API (`ditstream/v1/video.proto`) and the gateway ↔ pool API
/// (`ditstream/v1/pools.proto`).
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    tonic::include_proto!("ditstream.v1");
}

/// The encoded `FileDescriptorSet` of both files, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/ditstream_descriptor.bin"));
