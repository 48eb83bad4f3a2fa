//! Parses arbitrary text as the mesh's TOML config file. Nothing may panic:
//! not the parse, not the mesh settings derived from a config that parses,
//! not checking the guards it declares.
#![no_main]

use guardmesh_server::config::Config;
use guardmesh_server::fuzzing::Guard;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::parse(text, "fuzz.toml") else {
        return;
    };
    let mesh = config.mesh_config();
    let _ = config.insecure_settings();
    for guard in &config.guards {
        let _ = Guard::from_spec(&guard.to_spec(), mesh.default_guard_timeout);
    }
});
