//! The upstream's HTTP answers relayed message by message (`mcp http`,
//! R31): a JSON body (one message or an array) is read whole, an SSE stream
//! event by event as it arrives, and each JSON-RPC message in them is read
//! once ([`crate::upstream::read`]) and written as the gateway writes it,
//! never as the upstream's bytes. A message no peer may read alike (a
//! member twice, an unknown envelope member) is dropped, and a response
//! whose id is not the request's (`"114"` answering `114`) is dropped: when
//! the dropped one was the answer the client waits for, it gets the error
//! [`crate::upstream::UPSTREAM_UNREADABLE`] instead. An SSE event's other
//! fields (`event:`, `id:`, `retry:`) are kept; comments are dropped.

use crate::json::Json;
use crate::upstream::{self, Message};
use bytes::{Bytes, BytesMut};
use http::{Response, header};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming as Body};

type Out = http_body_util::combinators::BoxBody<Bytes, hyper::Error>;

/// Longest SSE event (or JSON body) read, in bytes; past it the answer
/// ends there.
pub const MAX_EVENT_BYTES: usize = 32 << 20;

/// The session whose requests a relayed answer belongs to: the tool
/// results the upstream sends the client's model in it (sampling requests,
/// `input_required` results) are judged there (R33,
/// [`crate::sampling::judged_for_client`]).
#[derive(Clone)]
pub struct Judging {
    pub judge: std::sync::Arc<crate::judge::Judge>,
    pub session: String,
}

/// `message` as the client gets it: its tool results judged when
/// `judging` (in a task of its own: the relayed body is shared between
/// threads, the judging is not). `None`: not relayed.
async fn judged(judging: Option<&Judging>, message: Json) -> Option<String> {
    match judging {
        Some(j) if crate::sampling::carries_tool_results(&message) => {
            let Judging { judge, session } = j.clone();
            let judging = tokio::spawn(async move {
                crate::sampling::judged_for_client(&judge, &session, message).await
            });
            match judging.await {
                Ok(message) => Some(message.to_text()),
                Err(error) => {
                    tracing::warn!(%error, "a message holding tool results was not relayed");
                    None
                }
            }
        }
        _ => Some(message.to_text()),
    }
}

/// One message as the client gets it (see the module's documentation);
/// `expected`: the id of the request the answer is for, when one.
pub async fn message(
    text: &str,
    expected: Option<&Json>,
    judging: Option<&Judging>,
) -> Option<String> {
    match upstream::read(text) {
        Ok(Message::Other(message)) => judged(judging, message).await,
        Ok(Message::Response { id, message }) => match expected {
            Some(expected) if *expected != id => {
                tracing::warn!(id = %id.to_text(), "dropped an upstream response that answers another request");
                None
            }
            _ => judged(judging, message).await,
        },
        Err(unreadable) => {
            tracing::warn!(why = %unreadable.why, "refused an upstream message");
            match (expected, &unreadable.id) {
                (Some(expected), Some(id)) if id == expected => {
                    Some(upstream::unreadable_answer(expected, &unreadable.why))
                }
                _ => None,
            }
        }
    }
}

/// A JSON body: one message, or an array of them.
pub async fn json_body(text: &str, expected: Option<&Json>, judging: Option<&Judging>) -> String {
    match serde_json::from_str::<Vec<Box<serde_json::value::RawValue>>>(text) {
        Ok(many) => {
            let mut kept: Vec<String> = Vec::with_capacity(many.len());
            for m in &many {
                kept.extend(message(m.get(), expected, judging).await);
            }
            format!("[{}]", kept.join(","))
        }
        Err(_) => message(text, expected, judging).await.unwrap_or_default(),
    }
}

/// One SSE event (its lines, LF-ended, without the blank line ending it)
/// as the client gets it, with its blank line; `None` when nothing of it
/// is relayed.
pub async fn sse_event(
    event: &str,
    expected: Option<&Json>,
    judging: Option<&Judging>,
) -> Option<String> {
    let mut data: Vec<&str> = Vec::new();
    let mut fields = String::new();
    for line in event.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            data.push(d.strip_prefix(' ').unwrap_or(d));
        } else if !line.is_empty() && !line.starts_with(':') {
            fields.push_str(line);
            fields.push('\n');
        }
    }
    if data.is_empty() {
        // A retry or id alone: no message in it.
        return (!fields.is_empty()).then(|| fields + "\n");
    }
    let body = json_body(&data.join("\n"), expected, judging).await;
    if body.is_empty() || body == "[]" {
        return None;
    }
    Some(format!("{fields}data: {body}\n\n"))
}

/// A whole SSE body, event by event.
pub async fn sse_body(text: &str, expected: Option<&Json>, judging: Option<&Judging>) -> String {
    let text = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut out = String::new();
    for event in text.split("\n\n") {
        out.extend(sse_event(event, expected, judging).await);
    }
    out
}

/// What a response's body is, by its media type as the MCP SDKs read it:
/// the type before any parameter, white space trimmed, case ignored (the
/// Python SDK lower-cases it), so that no spelling of a type a client
/// parses reaches it unread.
#[derive(Debug, PartialEq, Eq)]
enum Media {
    Sse,
    Json,
    /// Any other type, or none: no MCP client reads its body as messages.
    Other,
}

fn media(headers: &http::HeaderMap) -> Media {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return Media::Other;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    if essence.eq_ignore_ascii_case("text/event-stream") {
        Media::Sse
    } else if essence.eq_ignore_ascii_case("application/json") {
        Media::Json
    } else {
        Media::Other
    }
}

/// Whether a response is an SSE stream.
pub fn is_sse(headers: &http::HeaderMap) -> bool {
    media(headers) == Media::Sse
}

fn is_json(headers: &http::HeaderMap) -> bool {
    media(headers) == Media::Json
}

/// The end of the first event in `buf` (LF, CR LF or CR line ends): where
/// its blank line starts and ends.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        let nl = |at: usize| -> Option<usize> {
            match buf.get(at) {
                Some(b'\n') => Some(at + 1),
                Some(b'\r') if buf.get(at + 1) == Some(&b'\n') => Some(at + 2),
                Some(b'\r') if at + 1 < buf.len() => Some(at + 1),
                _ => None,
            }
        };
        if let Some(after) = nl(i)
            && let Some(end) = nl(after)
        {
            return Some((i, end));
        }
        i += 1;
    }
    None
}

/// The upstream's answer relayed message by message as it streams (see
/// the module's documentation); a body of any other content type is not
/// relayed (its status and headers are): nothing the gateway did not read
/// reaches the client.
pub async fn relay(
    response: Response<Body>,
    expected: Option<Json>,
    judging: Option<Judging>,
) -> Response<Out> {
    let (mut parts, body) = response.into_parts();
    let media = media(&parts.headers);
    let out: Out = if media == Media::Sse {
        parts.headers.remove(header::CONTENT_LENGTH);
        sse_stream(body, expected, judging)
    } else if media == Media::Json {
        parts.headers.remove(header::CONTENT_LENGTH);
        let bytes = match http_body_util::Limited::new(body, MAX_EVENT_BYTES)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(why) => {
                tracing::warn!(%why, "the upstream's answer could not be read whole");
                Bytes::new()
            }
        };
        let text = json_body(
            &String::from_utf8_lossy(&bytes),
            expected.as_ref(),
            judging.as_ref(),
        )
        .await;
        http_body_util::Full::new(Bytes::from(text))
            .map_err(|never| match never {})
            .boxed()
    } else {
        parts.headers.remove(header::CONTENT_LENGTH);
        drop(body);
        http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed()
    };
    Response::from_parts(parts, out)
}

fn sse_stream(body: Body, expected: Option<Json>, judging: Option<Judging>) -> Out {
    struct State {
        body: Body,
        buf: BytesMut,
        done: bool,
        expected: Option<Json>,
        judging: Option<Judging>,
    }
    let state = State {
        body,
        buf: BytesMut::new(),
        done: false,
        expected,
        judging,
    };
    let stream = futures::stream::unfold(state, |mut state| async move {
        loop {
            if let Some((start, end)) = event_end(&state.buf) {
                let event = state.buf.split_to(end);
                let text = String::from_utf8_lossy(&event[..start])
                    .replace("\r\n", "\n")
                    .replace('\r', "\n");
                let out = sse_event(&text, state.expected.as_ref(), state.judging.as_ref()).await;
                if let Some(out) = out {
                    return Some((Ok(Frame::data(Bytes::from(out))), state));
                }
                continue;
            }
            if state.done {
                if state.buf.is_empty() {
                    return None;
                }
                let rest = std::mem::take(&mut state.buf);
                let text = String::from_utf8_lossy(&rest)
                    .replace("\r\n", "\n")
                    .replace('\r', "\n");
                return sse_event(&text, state.expected.as_ref(), state.judging.as_ref())
                    .await
                    .map(|out| (Ok(Frame::data(Bytes::from(out))), state));
            }
            if state.buf.len() > MAX_EVENT_BYTES {
                tracing::warn!(
                    "an SSE event from the upstream is longer than {MAX_EVENT_BYTES} bytes; the stream is ended"
                );
                return None;
            }
            match state.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        state.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(error)) => {
                    return Some((
                        Err(error),
                        State {
                            done: true,
                            ..state
                        },
                    ));
                }
                None => state.done = true,
            }
        }
    });
    http_body_util::StreamBody::new(stream).boxed()
}

/// The JSON-RPC messages of an upstream answer, each as its text, as they
/// arrive: a JSON body (one message or an array) read whole, an SSE
/// stream event by event (an event holding an array gives each of its
/// elements), so that a request the upstream sends mid-answer is seen
/// before the answer ends. Any other content type holds none.
pub struct Messages {
    body: Option<Body>,
    buf: BytesMut,
    json: bool,
    done: bool,
    queue: std::collections::VecDeque<String>,
}

impl Messages {
    pub fn new(response: Response<Body>) -> Self {
        let sse = is_sse(response.headers());
        let json = is_json(response.headers());
        Self {
            body: Some(response.into_body()),
            buf: BytesMut::new(),
            json,
            done: !(sse || json),
            queue: std::collections::VecDeque::new(),
        }
    }

    /// The data of one event (or a JSON body): its messages queued.
    fn push(&mut self, data: &str) {
        if data.trim().is_empty() {
            return;
        }
        match serde_json::from_str::<Vec<Box<serde_json::value::RawValue>>>(data) {
            Ok(many) => self
                .queue
                .extend(many.into_iter().map(|m| m.get().to_owned())),
            Err(_) => self.queue.push_back(data.to_owned()),
        }
    }

    /// An SSE event's lines: its `data:` lines joined, queued.
    fn push_event(&mut self, event: &[u8]) {
        let text = String::from_utf8_lossy(event)
            .replace("\r\n", "\n")
            .replace('\r', "\n");
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if !data.is_empty() {
            self.push(&data.join("\n"));
        }
    }

    /// The next message, `None` once the answer has ended.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(message) = self.queue.pop_front() {
                return Some(message);
            }
            if self.done {
                return None;
            }
            if self.json {
                self.done = true;
                let Some(body) = self.body.take() else {
                    continue;
                };
                match http_body_util::Limited::new(body, MAX_EVENT_BYTES)
                    .collect()
                    .await
                {
                    Ok(body) => self.push(&String::from_utf8_lossy(&body.to_bytes())),
                    Err(why) => {
                        tracing::warn!(%why, "the upstream's answer could not be read whole");
                    }
                }
                continue;
            }
            if let Some((start, end)) = event_end(&self.buf) {
                let event = self.buf.split_to(end);
                self.push_event(&event[..start]);
                continue;
            }
            if self.buf.len() > MAX_EVENT_BYTES {
                tracing::warn!(
                    "an SSE event from the upstream is longer than {MAX_EVENT_BYTES} bytes; the answer is ended"
                );
                self.done = true;
                continue;
            }
            let Some(body) = self.body.as_mut() else {
                self.done = true;
                continue;
            };
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(_)) | None => {
                    self.done = true;
                    let rest = std::mem::take(&mut self.buf);
                    self.push_event(&rest);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn r31_sse_events_are_rewritten_and_odd_ones_dropped() {
        let id = Json::Number("3".into());
        let body = "event: message\r\nid: e1\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",  \"params\":{}}\r\n\r\n\
                    : a comment\n\n\
                    data: {\"jsonrpc\":\"2.0\",\"id\":\"3\",\"result\":{\"leak\":1}}\n\n\
                    data: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{},\"result\":{\"leak\":1}}\n\n";
        let out = sse_body(body, Some(&id), None).await;
        let events: Vec<&str> = out.split_terminator("\n\n").collect();
        assert_eq!(events.len(), 2, "{out}");
        assert_eq!(
            events[0],
            "event: message\nid: e1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}"
        );
        assert!(
            events[1]
                .starts_with("data: {\"jsonrpc\":\"2.0\",\"id\":3,\"error\":{\"code\":-32075,"),
            "{out}"
        );
        assert!(events[1].contains("appears twice"), "{out}");
        assert!(!out.contains("leak"));
    }

    /// R31: a spelling of a media type a client reads as SSE or JSON is
    /// read (and judged) by the gateway too; anything else is not relayed.
    #[test]
    fn r31_media_types_are_read_as_the_sdks_read_them() {
        let of = |value: &str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, value.parse().unwrap());
            media(&headers)
        };
        for sse in [
            "text/event-stream",
            "Text/Event-Stream",
            "TEXT/EVENT-STREAM; charset=utf-8",
            " text/event-stream ;x=1",
        ] {
            assert_eq!(of(sse), Media::Sse, "{sse}");
        }
        for json in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
        ] {
            assert_eq!(of(json), Media::Json, "{json}");
        }
        for other in [
            "text/plain",
            "text/event-streamx",
            "application/json-seq",
            "application/jsonx",
            "text/html",
            "",
        ] {
            assert_eq!(of(other), Media::Other, "{other}");
        }
        assert_eq!(media(&http::HeaderMap::new()), Media::Other);
    }

    #[test]
    fn r31_event_ends_are_found_whatever_the_line_ends() {
        assert_eq!(event_end(b"data: 1\n\nrest"), Some((7, 9)));
        assert_eq!(event_end(b"data: 1\r\n\r\nrest"), Some((7, 11)));
        assert_eq!(event_end(b"data: 1\r\rrest"), Some((7, 9)));
        assert_eq!(event_end(b"data: 1\n"), None);
    }
}
