//! Generates the wire types and gRPC stubs from `proto/guardmesh/v1`, and
//! the benchmark's baseline services from `proto/guardmesh/bench/v1`.
//!
//! protoc comes from the `protoc-bin-vendored` build dependency unless the
//! `PROTOC` environment variable points at another one, so a fresh machine
//! needs nothing installed by hand.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single threaded; nothing else reads the
        // environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let proto = "proto/guardmesh/v1/guardmesh.proto";
    println!("cargo:rerun-if-changed={proto}");
    // No `connect` constructors on the clients: they need tonic's transport,
    // which this crate leaves to its users (the SDK's `coordinator` feature,
    // the mesh). Build a client from a channel with `new`.
    tonic_prost_build::configure()
        .build_transport(false)
        .file_descriptor_set_path(out_dir.join("guardmesh_descriptor.bin"))
        .compile_protos(&[proto], &["proto"])?;
    // The benchmark's baselines (`guardmesh bench`) are compiled apart, into
    // their own folder and outside the descriptor set above, so that the
    // reflection of meshes and SDK guards never advertises services they do
    // not serve. Their references to guardmesh.v1 use the types above.
    let bench = "proto/guardmesh/bench/v1/bench.proto";
    println!("cargo:rerun-if-changed={bench}");
    let bench_out = out_dir.join("bench");
    std::fs::create_dir_all(&bench_out)?;
    tonic_prost_build::configure()
        .build_transport(false)
        .out_dir(&bench_out)
        .extern_path(".guardmesh.v1", "crate::v1")
        .bytes(".guardmesh.bench.v1.EchoMessage.payload")
        .compile_protos(&[bench], &["proto"])?;
    Ok(())
}
