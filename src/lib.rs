//! Wire types of guardmesh, generated from `proto/guardmesh/v1/guardmesh.proto`.
//!
//! Both the mesh (`guardmesh-server`) and the SDK (`guardmesh-client`) speak
//! through these types; the proto file is the contract for every language.

/// `guardmesh.v1`: messages and the stubs of `PreToolService`,
/// `GuardService` and `GuardRegistry`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("guardmesh.v1");
}

mod names;
pub use names::UnknownName;

/// Most tool names one `AlwaysSkippedRequest` may name (tool visibility);
/// more are refused with INVALID_ARGUMENT.
pub const ALWAYS_SKIPPED_MAX_TOOLS: usize = 4096;

/// Longest tool name an `AlwaysSkippedRequest` may name, in bytes; a
/// longer one is refused with INVALID_ARGUMENT.
pub const ALWAYS_SKIPPED_MAX_NAME_BYTES: usize = 256;

/// The encoded `FileDescriptorSet` of the guardmesh protos, for gRPC server
/// reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("guardmesh_descriptor");
