//! Generates the wire types and gRPC stubs from `proto/guardmesh/v1`.
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
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("guardmesh_descriptor.bin"))
        .compile_protos(&[proto], &["proto"])?;
    Ok(())
}
