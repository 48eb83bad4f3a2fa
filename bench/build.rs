//! Generates the benchmark's baseline services (`DirectGuard`, `Echo`) from
//! `proto/guardmesh/bench/v1/bench.proto`. They are compiled here, not in
//! the wire-types crate, so that neither its generated code nor its
//! descriptor set (the reflection of meshes and SDK guards) carries
//! services only the benchmark serves. Their references to `guardmesh.v1`
//! use the wire types of `guardmesh-proto`.
//!
//! protoc comes from the `protoc-bin-vendored` build dependency unless the
//! `PROTOC` environment variable points at another one.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single threaded; nothing else reads the
        // environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    let bench = "proto/guardmesh/bench/v1/bench.proto";
    println!("cargo:rerun-if-changed={bench}");
    println!("cargo:rerun-if-changed=../proto/guardmesh/v1/guardmesh.proto");
    tonic_prost_build::configure()
        .build_transport(false)
        .extern_path(".guardmesh.v1", "::guardmesh_proto::v1")
        .bytes(".guardmesh.bench.v1.EchoMessage.payload")
        .compile_protos(&[bench], &["proto", "../proto"])?;
    Ok(())
}
