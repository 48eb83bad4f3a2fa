//! `guardmesh`: the mesh server and its command-line tools (see `app.rs`).

use std::process::ExitCode;

/// The allocator measured best for the batch path in `guardmesh bench`
/// (small buffers per guard and per call; glibc malloc took ~30% of the
/// mesh's CPU). Build with `--features system-allocator` to compare.
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    guardmesh_cli::main()
}
