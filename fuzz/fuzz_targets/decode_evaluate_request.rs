//! Decodes arbitrary bytes as every request the mesh receives (a
//! coordinator's `EvaluateRequest`, a registrar's requests, a guard's
//! `JudgeResponse`) and runs the mesh's own checks on what decodes:
//! `validate::check` (R20) on batches, `Guard::from_spec` (R16) on
//! registrations. Nothing may panic.
#![no_main]

use guardmesh_proto::v1::{
    DeregisterRequest, EvaluateRequest, JudgeResponse, ListRequest, RegisterRequest,
};
use guardmesh_server::fuzzing::Guard;
use guardmesh_server::fuzzing::{Limits, check};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::time::Duration;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = EvaluateRequest::decode(data) {
        let small = Limits {
            max_calls_per_batch: 3,
            max_batch_bytes: 256,
            max_argument_bytes: 48,
            ..Limits::default()
        };
        for limits in [Limits::default(), small] {
            if check(&request, &limits).is_ok() {
                // What passes is well formed (R20).
                assert!(request.calls.len() <= limits.max_calls_per_batch);
                let mut ids = std::collections::HashSet::new();
                for call in &request.calls {
                    assert!(!call.call_id.is_empty() && ids.insert(call.call_id.as_str()));
                    assert!(!call.tool.trim().is_empty());
                }
            }
        }
        let again = EvaluateRequest::decode(request.encode_to_vec().as_slice()).unwrap();
        assert_eq!(again, request);
    }
    if let Ok(RegisterRequest { guard: Some(spec) }) = RegisterRequest::decode(data)
        && let Ok(guard) = Guard::from_spec(&spec, Duration::from_secs(1))
    {
        let again = Guard::from_spec(&guard.to_spec(), Duration::from_secs(1)).unwrap();
        assert_eq!(again.to_spec(), guard.to_spec());
    }
    let _ = DeregisterRequest::decode(data);
    let _ = ListRequest::decode(data);
    let _ = JudgeResponse::decode(data);
});
