//! Every protobuf field number the mesh reads or writes by hand, declared
//! once, grouped by message as `proto/guardmesh/v1/guardmesh.proto`
//! declares them. The tests below check each one against the types prost
//! generates from that file, so a field renumbered there fails them rather
//! than the wire.

/// `EvaluateRequest`: what the inbound scan reads (R20, R25).
pub(crate) mod evaluate_request {
    pub(crate) const BATCH_ID: u32 = 1;
    pub(crate) const CONTEXT: u32 = 2;
    pub(crate) const CALLS: u32 = 3;
    /// R33: counted as calls.
    pub(crate) const RESULTS: u32 = 7;
}

/// `BatchContext`.
pub(crate) mod batch_context {
    pub(crate) const METADATA: u32 = 4;
}

/// `JudgeRequest`.
pub(crate) mod judge_request {
    /// The `batch` of the `kind` oneof.
    pub(crate) const BATCH: u32 = 1;
}

/// `GuardBatch`: the parts of a batch encoded once and shared by guards.
pub(crate) mod guard_batch {
    pub(crate) const REQUEST_ID: u32 = 1;
    pub(crate) const BATCH_ID: u32 = 2;
    pub(crate) const GUARD: u32 = 3;
    pub(crate) const CONTEXT: u32 = 4;
    pub(crate) const CALLS: u32 = 5;
    pub(crate) const DEADLINE_MS: u32 = 6;
    pub(crate) const TRACEPARENT: u32 = 7;
    pub(crate) const TRACESTATE: u32 = 8;
    /// R33.
    pub(crate) const RESULTS: u32 = 9;
    /// R34.
    pub(crate) const SESSION: u32 = 11;
}

/// `JudgeResponse`: what the answer scan reads (R23).
pub(crate) mod judge_response {
    pub(crate) const VERDICTS: u32 = 2;
}

/// `Verdict`.
pub(crate) mod verdict {
    pub(crate) const CALL_ID: u32 = 1;
    /// The `skip` of the `outcome` oneof.
    pub(crate) const SKIP: u32 = 2;
    /// The `rewrite` of the `outcome` oneof.
    pub(crate) const REWRITE: u32 = 3;
    pub(crate) const LABELS: u32 = 4;
    /// The `ask` of the `outcome` oneof (R35).
    pub(crate) const ASK: u32 = 5;
}

/// `Rewrite`.
pub(crate) mod rewrite {
    pub(crate) const TOOL: u32 = 1;
    pub(crate) const ARGUMENTS: u32 = 2;
}

/// `SessionMemory`: what a guard is sent of a session (R34).
pub(crate) mod session_memory {
    pub(crate) const LABELS: u32 = 1;
    /// A `map<string, uint32>`: entries of [`super::map_entry`] fields.
    pub(crate) const COUNTS: u32 = 2;
    pub(crate) const RECENT: u32 = 3;
    pub(crate) const CALLS_TOTAL: u32 = 4;
    pub(crate) const RESULTS_TOTAL: u32 = 5;
    pub(crate) const EVICTED: u32 = 6;
    pub(crate) const TRUNCATED: u32 = 7;
    pub(crate) const DROPPED: u32 = 9;
}

/// `SessionCall`.
pub(crate) mod session_call {
    pub(crate) const TOOL: u32 = 1;
    pub(crate) const SERVER: u32 = 2;
    pub(crate) const ARGS_DIGEST: u32 = 3;
    pub(crate) const AT_MS: u32 = 4;
}

/// An entry of a `map<K, V>` field: a message of its key and its value.
pub(crate) mod map_entry {
    pub(crate) const KEY: u32 = 1;
    pub(crate) const VALUE: u32 = 2;
}

#[cfg(test)]
mod tests {
    use super::super::read::{self, LEN, VARINT};
    use super::super::write;
    use super::*;
    use guardmesh_proto::v1::judge_request::Kind;
    use guardmesh_proto::v1::verdict::Outcome;
    use guardmesh_proto::v1::{
        BatchContext, EvaluateRequest, GuardBatch, JudgeRequest, JudgeResponse, Rewrite,
        SessionCall, SessionMemory, Skip, ToolCall, ToolResult, Verdict,
    };
    use prost::Message;

    /// The number and wire type of the one field `message` encodes to.
    fn only_field(message: &impl Message) -> (u32, u8) {
        let bytes = message.encode_to_vec();
        let mut rest = bytes.as_slice();
        let (number, wire_type) = read::key(&mut rest).unwrap();
        read::skip(&mut rest, number, wire_type, 0).unwrap();
        assert!(rest.is_empty(), "one field, not {bytes:?}");
        (number, wire_type)
    }

    /// The number and wire type of the one field a default `M` that
    /// `change` sets encodes to.
    fn changed<M: Message + Default>(change: fn(&mut M)) -> (u32, u8) {
        let mut message = M::default();
        change(&mut message);
        only_field(&message)
    }

    #[test]
    fn evaluate_request_fields_are_the_generated_ones() {
        let only = changed::<EvaluateRequest>;
        assert_eq!(
            only(|m| m.batch_id = "b".into()),
            (evaluate_request::BATCH_ID, LEN)
        );
        assert_eq!(
            only(|m| m.context = Some(BatchContext::default())),
            (evaluate_request::CONTEXT, LEN)
        );
        assert_eq!(
            only(|m| m.calls = vec![ToolCall::default()]),
            (evaluate_request::CALLS, LEN)
        );
        assert_eq!(
            only(|m| m.results = vec![ToolResult::default()]),
            (evaluate_request::RESULTS, LEN)
        );
        let context = BatchContext {
            metadata: [("k".to_owned(), "v".to_owned())].into(),
            ..BatchContext::default()
        };
        assert_eq!(only_field(&context), (batch_context::METADATA, LEN));
    }

    #[test]
    fn judge_request_and_guard_batch_fields_are_the_generated_ones() {
        let request = JudgeRequest {
            kind: Some(Kind::Batch(GuardBatch::default())),
        };
        assert_eq!(only_field(&request), (judge_request::BATCH, LEN));
        let only = changed::<GuardBatch>;
        assert_eq!(
            only(|m| m.request_id = 1),
            (guard_batch::REQUEST_ID, VARINT)
        );
        assert_eq!(
            only(|m| m.batch_id = "b".into()),
            (guard_batch::BATCH_ID, LEN)
        );
        assert_eq!(only(|m| m.guard = "g".into()), (guard_batch::GUARD, LEN));
        assert_eq!(
            only(|m| m.context = Some(BatchContext::default())),
            (guard_batch::CONTEXT, LEN)
        );
        assert_eq!(
            only(|m| m.deadline_ms = 1),
            (guard_batch::DEADLINE_MS, VARINT)
        );
        assert_eq!(
            only(|m| m.traceparent = "t".into()),
            (guard_batch::TRACEPARENT, LEN)
        );
        assert_eq!(
            only(|m| m.tracestate = "s".into()),
            (guard_batch::TRACESTATE, LEN)
        );
        assert_eq!(
            only(|m| m.calls = vec![ToolCall::default()]),
            (guard_batch::CALLS, LEN)
        );
        assert_eq!(
            only(|m| m.results = vec![ToolResult::default()]),
            (guard_batch::RESULTS, LEN)
        );
        assert_eq!(
            only(|m| m.session = Some(SessionMemory::default())),
            (guard_batch::SESSION, LEN)
        );
    }

    #[test]
    fn judge_response_verdict_and_rewrite_fields_are_the_generated_ones() {
        let response = JudgeResponse {
            verdicts: vec![Verdict::default()],
            ..JudgeResponse::default()
        };
        assert_eq!(only_field(&response), (judge_response::VERDICTS, LEN));
        let only = changed::<Verdict>;
        assert_eq!(only(|m| m.call_id = "c".into()), (verdict::CALL_ID, LEN));
        assert_eq!(
            only(|m| m.outcome = Some(Outcome::Skip(Skip::default()))),
            (verdict::SKIP, LEN)
        );
        assert_eq!(
            only(|m| m.outcome = Some(Outcome::Rewrite(Rewrite::default()))),
            (verdict::REWRITE, LEN)
        );
        assert_eq!(
            only(|m| m.labels = vec!["l".into()]),
            (verdict::LABELS, LEN)
        );
        assert_eq!(
            only(|m| m.outcome = Some(Outcome::Ask(Default::default()))),
            (verdict::ASK, LEN)
        );
        let tool = Rewrite {
            tool: Some(String::new()),
            arguments: None,
        };
        assert_eq!(only_field(&tool), (rewrite::TOOL, LEN));
        let arguments = Rewrite {
            tool: None,
            arguments: Some(String::new()),
        };
        assert_eq!(only_field(&arguments), (rewrite::ARGUMENTS, LEN));
    }

    #[test]
    fn session_memory_and_call_fields_are_the_generated_ones() {
        let only = changed::<SessionMemory>;
        assert_eq!(
            only(|m| m.labels = vec!["l".into()]),
            (session_memory::LABELS, LEN)
        );
        assert_eq!(
            only(|m| m.counts = [("t".to_owned(), 1)].into()),
            (session_memory::COUNTS, LEN)
        );
        assert_eq!(
            only(|m| m.recent = vec![SessionCall::default()]),
            (session_memory::RECENT, LEN)
        );
        assert_eq!(
            only(|m| m.calls_total = 1),
            (session_memory::CALLS_TOTAL, VARINT)
        );
        assert_eq!(
            only(|m| m.results_total = 1),
            (session_memory::RESULTS_TOTAL, VARINT)
        );
        assert_eq!(
            only(|m| m.dropped = true),
            (session_memory::DROPPED, VARINT)
        );
        assert_eq!(
            only(|m| m.evicted = true),
            (session_memory::EVICTED, VARINT)
        );
        assert_eq!(
            only(|m| m.truncated = true),
            (session_memory::TRUNCATED, VARINT)
        );
        let only = changed::<SessionCall>;
        assert_eq!(only(|m| m.tool = "t".into()), (session_call::TOOL, LEN));
        assert_eq!(only(|m| m.server = "s".into()), (session_call::SERVER, LEN));
        assert_eq!(
            only(|m| m.args_digest = "d".into()),
            (session_call::ARGS_DIGEST, LEN)
        );
        assert_eq!(only(|m| m.at_ms = 1), (session_call::AT_MS, VARINT));
    }

    #[test]
    fn map_entry_fields_are_the_generated_ones() {
        let memory = SessionMemory {
            counts: [("t".to_owned(), 3)].into(),
            ..SessionMemory::default()
        };
        let bytes = memory.encode_to_vec();
        let mut rest = bytes.as_slice();
        assert_eq!(read::key(&mut rest), Ok((session_memory::COUNTS, LEN)));
        let mut entry = read::length_delimited(&mut rest).unwrap();
        assert!(rest.is_empty());
        assert_eq!(read::key(&mut entry), Ok((map_entry::KEY, LEN)));
        assert_eq!(read::length_delimited(&mut entry), Ok(&b"t"[..]));
        assert_eq!(read::key(&mut entry), Ok((map_entry::VALUE, VARINT)));
        assert_eq!(read::varint(&mut entry), Ok(3));
        assert!(entry.is_empty());
    }

    /// The other way round: fields written by hand with these numbers read
    /// back, with prost, as the fields they are meant to be.
    #[test]
    fn fields_written_by_hand_decode_as_the_generated_types() {
        let call = SessionCall {
            tool: "fs.read".into(),
            server: "fs".into(),
            args_digest: "ab12".into(),
            at_ms: 1_700_000_000_000,
        };
        let mut body = Vec::new();
        write::string(session_call::TOOL, &call.tool, true, &mut body);
        write::string(session_call::SERVER, &call.server, true, &mut body);
        write::string(
            session_call::ARGS_DIGEST,
            &call.args_digest,
            true,
            &mut body,
        );
        write::varint(session_call::AT_MS, call.at_ms, &mut body);
        let mut entry = Vec::new();
        write::string(map_entry::KEY, "fs.read", true, &mut entry);
        write::varint(map_entry::VALUE, 2, &mut entry);
        let mut memory = Vec::new();
        write::string(session_memory::LABELS, "secret", false, &mut memory);
        write::header(session_memory::COUNTS, entry.len(), &mut memory);
        memory.extend_from_slice(&entry);
        write::header(session_memory::RECENT, body.len(), &mut memory);
        memory.extend_from_slice(&body);
        write::varint(session_memory::CALLS_TOTAL, 4, &mut memory);
        write::varint(session_memory::RESULTS_TOTAL, 5, &mut memory);
        write::varint(session_memory::EVICTED, 1, &mut memory);
        write::varint(session_memory::TRUNCATED, 1, &mut memory);
        write::varint(session_memory::DROPPED, 1, &mut memory);
        let expected = SessionMemory {
            labels: vec!["secret".into()],
            counts: [("fs.read".to_owned(), 2)].into(),
            recent: vec![call],
            calls_total: 4,
            results_total: 5,
            evicted: true,
            truncated: true,
            unavailable: String::new(),
            dropped: true,
        };
        assert_eq!(
            SessionMemory::decode(memory.as_slice()),
            Ok(expected.clone())
        );

        let context = BatchContext {
            session_id: "s".into(),
            ..BatchContext::default()
        };
        let mut batch = Vec::new();
        write::message(guard_batch::CONTEXT, &context, &mut batch);
        write::message(guard_batch::CALLS, &ToolCall::default(), &mut batch);
        write::message(guard_batch::RESULTS, &ToolResult::default(), &mut batch);
        write::message(guard_batch::SESSION, &expected, &mut batch);
        let decoded = GuardBatch::decode(batch.as_slice()).unwrap();
        assert_eq!(decoded.context, Some(context));
        assert_eq!(decoded.calls, vec![ToolCall::default()]);
        assert_eq!(decoded.results, vec![ToolResult::default()]);
        assert_eq!(decoded.session, Some(expected));
        let mut request = Vec::new();
        write::header(judge_request::BATCH, batch.len(), &mut request);
        request.extend_from_slice(&batch);
        assert_eq!(
            JudgeRequest::decode(request.as_slice()).unwrap().kind,
            Some(Kind::Batch(decoded))
        );
    }
}
