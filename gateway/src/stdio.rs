//! `guardmesh mcp stdio`: the MCP client starts the gateway as its server
//! over stdio; the gateway starts the upstream MCP server and relays every
//! message both ways, judging each `tools/call` through the mesh first (R31).
//!
//! * Client to upstream: each line (split at LF, bounded by
//!   `--max-message-bytes`) is read once and classified
//!   ([`crate::jsonrpc::classify_line`]): a line with a bare CR, member
//!   names that collide under case folding, or unknown envelope members is
//!   answered with a JSON-RPC error and nothing of it is forwarded. What is
//!   forwarded is the gateway's own serialization of what it read
//!   ([`crate::json`]), never the client's bytes. Tool calls are judged concurrently, each
//!   message (or JSON-RPC batch) in its own task, so a slow guard does not
//!   hold up `tools/list` or pings. Single calls read together (sent
//!   together by the client) are judged as one guard batch as soon as all
//!   that was sent is read, or, with `--batch-window-ms`, those arriving
//!   within that window ([`crate::group`]).
//!   Everything else is forwarded as the gateway writes it, in order: a
//!   message that waits for the mesh other than a `tools/call` (a sampling
//!   answer's `tool_use` blocks, a request's `inputResponses`) is judged
//!   in the direction's ordered lane (`lane.rs`), within the same
//!   bound as tool calls (`MAX_IN_FLIGHT`), and what is read after it goes
//!   upstream after it.
//! * A JSON-RPC batch: its `tools/call`s are one guard batch; a batch with an
//!   element the gateway cannot judge is refused whole. Its elements are
//!   forwarded one by one (servers of the current MCP revision do not accept
//!   batches), and the answer to the client is one array: the gateway's own
//!   answers followed by the upstream's responses to the forwarded requests.
//! * Upstream to client: each line is read once as I-JSON and matched to
//!   its request by the gateway's own ids ([`crate::upstream`]); what the
//!   client gets is the gateway's serialization of it, or of what the mesh
//!   judged of a result (R31, R33). A request reusing an id in flight is
//!   refused. Tool results it sends the client's model (sampling) are
//!   judged in this direction's ordered lane, at most `MAX_IN_FLIGHT` at
//!   once; past it the gateway stops reading the upstream. A line longer
//!   than `--max-upstream-message-bytes` (default 32 MiB) ends the session:
//!   the gateway holds no more than that of it, stops the upstream, and
//!   exits with an error naming the limit (the client sees the server
//!   close, as when it crashes; no request is left waiting for an answer
//!   that will never come).
//! * The upstream's stderr is read by the gateway and written to the
//!   gateway's stderr line by line ([`relay_stderr`]), never to stdout
//!   (the MCP stream), and drained continuously, so a chatty upstream never
//!   blocks on a full pipe. The lines go through a bounded queue with the
//!   gateway's own log lines ([`crate::pipes::Stderr`]): when nobody reads
//!   the gateway's stderr, lines are dropped and counted (the count is
//!   written once stderr is read again, and at exit), and neither the relay
//!   nor the upstream ever waits for it.
//! * The upstream exiting ends the session: the gateway exits with the
//!   upstream's status. The client closing stdin closes the upstream's stdin
//!   and waits (bounded) for it to exit.

use crate::group::Grouper;
use crate::jsonrpc::{self, Incoming, Item, codes};
use crate::judge::{Disposition, Judge, JudgeArgs};
use crate::lane::Lane;
use bytes::BytesMut;
use rmcp::model::ErrorData;
use rmcp::transport::async_rw::{JsonRpcMessageCodec, JsonRpcMessageCodecError};
use serde_json::value::RawValue;
use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::{AnyDelimiterCodec, AnyDelimiterCodecError, Decoder};

/// `guardmesh mcp stdio`.
#[derive(clap::Args, Debug, Clone)]
pub struct StdioArgs {
    #[command(flatten)]
    pub mesh: JudgeArgs,
    #[command(flatten)]
    pub approval: crate::approval::ApprovalArgs,
    #[command(flatten)]
    pub visibility: crate::visibility::VisibilityArgs,
    /// The session id of every batch (R31); default: one made for this run.
    #[arg(long)]
    pub session: Option<String>,
    /// Largest message accepted from the client, in bytes; a longer one is
    /// discarded and answered with an error.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_message_bytes: usize,
    /// Largest message (line) accepted from the upstream, in bytes; a longer
    /// one ends the session with an error.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_upstream_message_bytes: usize,
    /// Single tools/call requests arriving within this many milliseconds of
    /// each other are judged as one guard batch (each still answered under
    /// its own id); 0 judges each on its own. Default: the requests read
    /// together (sent together by the client) are one batch, judged as soon
    /// as the gateway has read all the client sent, with no waiting.
    #[arg(long)]
    pub batch_window_ms: Option<u64>,
    /// The upstream's server name, sent with each tool result judged by
    /// the mesh (R33); default: the command's file name.
    #[arg(long)]
    pub server_name: Option<String>,
    /// The upstream MCP server: a command and its arguments, after `--`.
    #[arg(required = true, last = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// Why the relay could not run.
#[derive(Debug, thiserror::Error)]
pub enum StdioError {
    #[error("cannot start the upstream MCP server {command:?}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("stdio: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "the upstream MCP server sent a message longer than {0} bytes \
         (--max-upstream-message-bytes); the session is ended"
    )]
    UpstreamTooLong(usize),
    #[error("{0}")]
    Approver(String),
}

/// How the upstream's stdout ended.
enum UpstreamEnd {
    /// Closed (or failed to read): the upstream is done.
    Closed,
    /// A line longer than the limit.
    TooLong,
}

/// Messages (or batches) with tool calls judged at once, per session; and
/// messages holding tool results judged at once in the other direction.
const MAX_IN_FLIGHT: usize = 64;

/// Bytes read from a stdio peer at once, at most.
const READ_CHUNK: usize = 16 * 1024;

/// A session id made for one run.
pub fn fresh_session_id(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}

/// Runs the relay on the process's stdin and stdout; returns the exit code.
pub async fn run(args: StdioArgs) -> Result<i32, StdioError> {
    run_with(args, crate::pipes::stdin(), crate::pipes::stdout()).await
}

type Frame = Result<Box<RawValue>, JsonRpcMessageCodecError>;

/// Reads the next line-delimited JSON message; `None` at end of input.
async fn next_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    codec: &mut JsonRpcMessageCodec<Box<RawValue>>,
    eof: &mut bool,
) -> Option<Frame> {
    next_decoded(reader, buf, codec, eof, || {}).await
}

/// The next item `codec` decodes from `reader`; `None` at end of input.
/// Calls `idle` each time everything read so far has been decoded, before
/// waiting for more.
async fn next_decoded<R, D>(
    reader: &mut R,
    buf: &mut BytesMut,
    codec: &mut D,
    eof: &mut bool,
    mut idle: impl FnMut(),
) -> Option<Result<D::Item, D::Error>>
where
    R: AsyncRead + Unpin,
    D: Decoder,
{
    loop {
        if *eof {
            idle();
            return codec.decode_eof(buf).transpose();
        }
        match codec.decode(buf) {
            Ok(Some(item)) => return Some(Ok(item)),
            Err(e) => return Some(Err(e)),
            Ok(None) => {}
        }
        idle();
        // Room for what the peer sent at once (`read_buf` alone would read
        // 64 bytes at a time into an empty buffer).
        if buf.capacity() - buf.len() < READ_CHUNK / 2 {
            buf.reserve(READ_CHUNK);
        }
        match reader.read_buf(buf).await {
            Ok(0) => *eof = true,
            Ok(_) => {}
            Err(e) => return Some(Err(e.into())),
        }
    }
}

/// A line from the client: its bytes without the LF; or a line longer than
/// the limit, discarded.
type ClientLine = Result<bytes::Bytes, AnyDelimiterCodecError>;

/// Reads the client's next line (split at LF only, as the gateway's own
/// framing; a CR in it is judged by [`jsonrpc::classify_line`]); `None` at
/// end of input. Calls `idle` each time everything read so far has been
/// decoded, before waiting for more.
async fn next_client_line<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    codec: &mut AnyDelimiterCodec,
    eof: &mut bool,
    idle: impl FnMut(),
) -> Option<ClientLine> {
    next_decoded(reader, buf, codec, eof, idle).await
}

/// One direction's output: each message written whole, with its newline,
/// and flushed, by the task that has it (no writer task in between: a hop
/// per message), one message at a time. A write that fails closes it: the
/// messages after it are not sent.
pub(crate) struct Lines {
    writer: tokio::sync::Mutex<Option<Box<dyn AsyncWrite + Unpin + Send>>>,
}

/// The peer a [`Lines`] writes to is gone.
#[derive(Debug)]
pub(crate) struct Closed;

impl Lines {
    fn new(writer: impl AsyncWrite + Unpin + Send + 'static) -> Arc<Self> {
        Arc::new(Self {
            writer: tokio::sync::Mutex::new(Some(Box::new(writer))),
        })
    }

    /// Writes `message` and a newline.
    pub(crate) async fn send(&self, message: String) -> Result<(), Closed> {
        let mut line = message.into_bytes();
        line.push(b'\n');
        let mut slot = self.writer.lock().await;
        let writer = slot.as_mut().ok_or(Closed)?;
        if writer.write_all(&line).await.is_err() || writer.flush().await.is_err() {
            *slot = None;
            return Err(Closed);
        }
        Ok(())
    }

    /// Closes the output, once the message being written (if any) is out.
    async fn close(&self) {
        let writer = self.writer.lock().await.take();
        drop(writer);
    }

    /// Closes the output now, unless a message is being written (its task
    /// is stopped; the output closes when the last holder lets it go).
    fn close_now(&self) {
        if let Ok(mut slot) = self.writer.try_lock() {
            slot.take();
        }
    }
}

/// Responses to forwarded requests of JSON-RPC batches, collected until each
/// batch's array is complete.
#[derive(Default)]
struct Collector {
    next: usize,
    waiting: HashMap<String, usize>,
    slots: HashMap<usize, (usize, Vec<String>)>,
    /// The ids of `tools/list` requests whose responses are yet to come:
    /// relayed without output schemas ([`crate::schemas`]).
    listing: std::collections::HashSet<String>,
}

/// `tools/list` requests awaited at once, at most; beyond it a response is
/// relayed as it came (a client this far ahead is not waiting for it).
const MAX_LISTING: usize = 1024;

impl Collector {
    /// Notes that the response to request `key` lists tools.
    fn lists_tools(&mut self, key: Option<&String>) {
        if let Some(key) = key
            && self.listing.len() < MAX_LISTING
        {
            self.listing.insert(key.clone());
        }
    }
}

type Shared = Arc<Mutex<Collector>>;

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Collector> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

fn array(items: &[String]) -> String {
    format!("[{}]", items.join(","))
}

/// Whether `text` (a response, under the client's id) answers one of the
/// client's `tools/list` requests.
fn lists_tools(collector: &Shared, text: &str) -> bool {
    let c = lock(collector);
    !c.listing.is_empty()
        && jsonrpc::response_key(text.as_bytes()).is_some_and(|key| c.listing.contains(&key))
}

/// Passes one upstream message on to the client: a `tools/list` answer
/// without output schemas, a response a JSON-RPC batch waits for into its
/// array (sent once complete), anything else as it is. False when the
/// client is gone.
async fn deliver(collector: &Shared, to_client: &Lines, text: &str) -> bool {
    let mut text = text;
    let stripped;
    let complete = {
        let mut c = lock(collector);
        if !c.listing.is_empty()
            && let Some(key) = jsonrpc::response_key(text.as_bytes())
            && c.listing.remove(&key)
            && let Some(without) = crate::schemas::without_output_schemas(text)
        {
            stripped = without;
            text = &stripped;
        }
        match (!c.waiting.is_empty())
            .then(|| jsonrpc::response_key(text.as_bytes()))
            .flatten()
            .and_then(|key| c.waiting.remove(&key))
        {
            Some(slot) => {
                let done = c.slots.get_mut(&slot).is_some_and(|(left, answers)| {
                    answers.push(text.to_owned());
                    *left -= 1;
                    *left == 0
                });
                if done {
                    c.slots.remove(&slot).map(|(_, answers)| array(&answers))
                } else {
                    Some(String::new())
                }
            }
            None => None,
        }
    };
    let out = match complete {
        Some(batch) if batch.is_empty() => return true,
        Some(batch) => batch,
        None => text.to_owned(),
    };
    to_client.send(out).await.is_ok()
}

/// Writes `message` to the client; false when it is gone.
async fn client_send(to_client: &Lines, message: String) -> bool {
    to_client.send(message).await.is_ok()
}

/// Runs the relay on the given client streams.
pub async fn run_with<R, W>(args: StdioArgs, input: R, output: W) -> Result<i32, StdioError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (program, rest) = match args.command.split_first() {
        Some(split) => split,
        None => {
            return Err(StdioError::Spawn {
                command: String::new(),
                source: std::io::Error::other("no command given"),
            });
        }
    };
    let approver =
        crate::approval::link(&args.mesh, &args.approval).map_err(StdioError::Approver)?;
    let mut child = tokio::process::Command::new(program)
        .args(rest)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| StdioError::Spawn {
            command: args.command.join(" "),
            source,
        })?;
    let (Some(upstream_in), Some(mut upstream_out), Some(upstream_err)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(StdioError::Io(std::io::Error::other(
            "the upstream's stdio is not piped",
        )));
    };
    let stderr_relay = tokio::spawn(relay_stderr(upstream_err, crate::pipes::stderr()));
    let session = args
        .session
        .clone()
        .unwrap_or_else(|| fresh_session_id("mcp-stdio"));
    let server = args.server_name.clone().unwrap_or_else(|| {
        std::path::Path::new(program)
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    });
    let judge = Arc::new(
        Judge::new(args.mesh.clone(), "mcp-stdio")
            .with_server(server)
            .with_visibility(args.visibility.hide_skipped_tools),
    );
    let interceptors = crate::interceptors::Interceptors::from_judge_args(&args.mesh);
    let grouper = match args.batch_window_ms {
        Some(ms) => Grouper::new(judge.clone(), Duration::from_millis(ms)),
        None => Grouper::until_idle(judge.clone()),
    };
    let collector: Shared = Arc::default();
    let flight = Arc::new(crate::upstream::InFlight::default());
    // R35: asks put to the client's user through elicitation.
    let approvals = Arc::new(crate::approval::Approvals::new(
        approver,
        Duration::from_millis(args.approval.elicitation_timeout_ms),
    ));

    // One writer per direction, written by whoever has a message, one
    // message at a time, so that messages are never interleaved.
    let to_client = Lines::new(output);
    let to_upstream = Lines::new(upstream_in);

    // Upstream to client: unchanged, except responses a batch waits for.
    let mut upstream_reader = tokio::spawn({
        let to_client = to_client.clone();
        let collector = collector.clone();
        let (judge, flight) = (judge.clone(), flight.clone());
        let to_upstream = to_upstream.clone();
        let session = session.clone();
        let mut results = tokio::task::JoinSet::new();
        let max = args.max_upstream_message_bytes;
        // The messages the upstream sends that wait for the mesh (tool
        // results sent to the client's model) are judged in order, within
        // the bound, and nothing read after them overtakes them.
        let lane = Lane::new(
            Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
            MAX_IN_FLIGHT,
            {
                let (collector, to_client) = (collector.clone(), to_client.clone());
                Arc::new(move |message: String| {
                    let (collector, to_client) = (collector.clone(), to_client.clone());
                    Box::pin(async move { deliver(&collector, &to_client, &message).await })
                })
            },
        );
        async move {
            let mut buf = BytesMut::new();
            let mut codec = JsonRpcMessageCodec::<Box<RawValue>>::new_with_max_length(max);
            let mut eof = false;
            while let Some(frame) =
                next_frame(&mut upstream_out, &mut buf, &mut codec, &mut eof).await
            {
                let message = match frame {
                    Ok(message) => message,
                    Err(JsonRpcMessageCodecError::Io(_)) => break,
                    Err(JsonRpcMessageCodecError::MaxLineLengthExceeded) => {
                        lane.abort();
                        return UpstreamEnd::TooLong;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "dropped a line from the upstream that is not JSON");
                        continue;
                    }
                };
                // R31: read once, as I-JSON; matched by the gateway's own
                // ids; what the client gets is the gateway's serialization.
                let (sent, message) = match crate::upstream::read(message.get()) {
                    Ok(crate::upstream::Message::Other(message)) => {
                        // While a judged call runs, nothing of the
                        // upstream's own text reaches the client unjudged.
                        let message = if flight.judging() {
                            match crate::upstream::while_judging(message) {
                                Ok(message) => message,
                                Err(answer) => {
                                    if !answer.is_empty() {
                                        let _ = to_upstream.send(answer).await;
                                    }
                                    continue;
                                }
                            }
                        } else {
                            message
                        };
                        // R33: tool results it sends the client's model,
                        // judged in the lane.
                        if crate::sampling::carries_tool_results(&message) {
                            let (judge, session) = (judge.clone(), session.clone());
                            let judging = async move {
                                let message =
                                    crate::sampling::judged_for_client(&judge, &session, message)
                                        .await;
                                Some(message.to_text())
                            };
                            if !lane.judge(judging).await {
                                break;
                            }
                            continue;
                        }
                        if !lane.send(message.to_text()).await {
                            break;
                        }
                        continue;
                    }
                    Ok(crate::upstream::Message::Response { id, message }) => {
                        match flight.answered(&id) {
                            Some(sent) => (sent, message),
                            None => {
                                tracing::warn!(
                                    id = %id.to_text(),
                                    "dropped an upstream response that answers no request in flight"
                                );
                                continue;
                            }
                        }
                    }
                    Err(unreadable) => {
                        match unreadable.id.as_ref().and_then(|id| flight.answered(id)) {
                            Some(sent) => {
                                tracing::warn!(why = %unreadable.why, "refused an upstream response");
                                let answer = crate::upstream::unreadable_answer(
                                    &sent.client_id,
                                    &unreadable.why,
                                );
                                if !lane.send(answer).await {
                                    break;
                                }
                            }
                            None => tracing::warn!(
                                why = %unreadable.why,
                                "dropped an upstream message the gateway cannot read alike to every peer"
                            ),
                        }
                        continue;
                    }
                };
                if sent.purpose.judged().is_none()
                    && crate::sampling::carries_tool_results(&message)
                {
                    // R33: an answer holding tool results sent to the
                    // client's model (`input_required`), judged in the lane.
                    let (judge, flight) = (judge.clone(), flight.clone());
                    let judging = async move {
                        Some(crate::upstream::answer(&judge, &flight, sent, message).await)
                    };
                    if !lane.judge(judging).await {
                        break;
                    }
                    continue;
                }
                if sent.purpose.judged().is_none() {
                    let answer = crate::upstream::answer(&judge, &flight, sent, message).await;
                    if judge.hides_skipped_tools() && lists_tools(&collector, &answer) {
                        // Tool visibility: the mesh is asked in a task of
                        // its own (a slow or unreachable mesh holds up no
                        // other message).
                        let judge = judge.clone();
                        let (to_client, collector) = (to_client.clone(), collector.clone());
                        results.spawn(async move {
                            let answer = judge.visible_tools(answer).await;
                            deliver(&collector, &to_client, &answer).await
                        });
                        while results.try_join_next().is_some() {}
                        continue;
                    }
                    if !lane.send(answer).await {
                        break;
                    }
                    continue;
                }
                // R33: a result the chain judges goes through the mesh
                // first, in a task of its own (a slow guard holds up no
                // other response).
                let (judge, flight) = (judge.clone(), flight.clone());
                let (to_client, collector) = (to_client.clone(), collector.clone());
                results.spawn(async move {
                    let answer = crate::upstream::answer(&judge, &flight, sent, message).await;
                    deliver(&collector, &to_client, &answer).await
                });
                while results.try_join_next().is_some() {}
            }
            // Results being judged are answered before the session ends.
            lane.finish().await;
            while results.join_next().await.is_some() {}
            UpstreamEnd::Closed
        }
    });

    // Client to upstream.
    let mut input = input;
    let mut buf = BytesMut::new();
    let mut codec =
        AnyDelimiterCodec::new_with_max_length(b"\n".to_vec(), Vec::new(), args.max_message_bytes);
    let mut eof = false;
    let mut tasks = tokio::task::JoinSet::new();
    // Bounds the messages being judged at once: past it, the gateway stops
    // reading the client until one is answered.
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    // What goes upstream after a message that waits for the mesh (a
    // sampling answer's tool calls, a request's `inputResponses`) goes in
    // order, within the same bound as tool calls.
    let lane = Lane::new(in_flight.clone(), MAX_IN_FLIGHT, {
        let to_upstream = to_upstream.clone();
        Arc::new(move |message: String| {
            let to_upstream = to_upstream.clone();
            Box::pin(async move { to_upstream.send(message).await.is_ok() })
        })
    });
    let mut upstream_done = false;
    let mut too_long = false;
    loop {
        let frame = tokio::select! {
            biased;
            end = &mut upstream_reader, if !upstream_done => {
                upstream_done = true;
                too_long = matches!(end, Ok(UpstreamEnd::TooLong));
                break;
            }
            frame = next_client_line(&mut input, &mut buf, &mut codec, &mut eof, || grouper.flush()) => frame,
        };
        let Some(frame) = frame else { break };
        let line = match frame {
            Ok(line) => line,
            Err(AnyDelimiterCodecError::MaxChunkLengthExceeded) => {
                let data = ErrorData::new(
                    codes::TOO_LARGE,
                    format!(
                        "guardmesh: message longer than {} bytes, discarded",
                        args.max_message_bytes
                    ),
                    None,
                );
                let _ = to_client.send(jsonrpc::error(None, &data)).await;
                continue;
            }
            Err(_) => break,
        };
        // Blank lines (a client's keep-alive, a CR LF ending alone) carry
        // nothing.
        if line.iter().all(|b| matches!(b, b' ' | b'\t' | b'\r')) {
            continue;
        }
        let incoming = match jsonrpc::classify_line(&line) {
            Ok(incoming) => incoming,
            Err(error) => {
                let _ = to_client.send(jsonrpc::error(None, &error)).await;
                continue;
            }
        };
        match incoming {
            Incoming::Single(Item::Forward {
                text,
                request,
                lists_tools,
            }) => {
                // SEP-2624: answered by the gateway, never forwarded.
                if request.is_some()
                    && let Some(answer) = interceptors.take(&text, &session)
                {
                    let to_client = to_client.clone();
                    tasks.spawn(async move { drop(to_client.send(answer.await).await) });
                    continue;
                }
                // R35: the client's answer to an elicitation of the
                // gateway's is the gateway's, never forwarded.
                if request.is_none() && approvals.take_answer(&text) {
                    continue;
                }
                // A call cancelled while its user is asked: the ask ends.
                if request.is_none() {
                    approvals.cancel_call(&text);
                }
                // R31: the tool calls a model asks for through sampling are
                // judged before the upstream receives the answer, in the
                // lane.
                if request.is_none() && crate::sampling::may_use_tools(&text) {
                    let (judge, session) = (judge.clone(), session.clone());
                    if !lane.has_permit() {
                        grouper.flush();
                    }
                    lane.judge(async move {
                        crate::sampling::judged_answer(&judge, &session, text).await
                    })
                    .await;
                    continue;
                }
                let text = match &request {
                    Some(key) => {
                        if let Err(error) = flight.reserve(&session, key) {
                            let _ = to_client.send(crate::upstream::refuse(&text, &error)).await;
                            continue;
                        }
                        approvals.learn(&text);
                        if lists_tools {
                            lock(&collector).lists_tools(request.as_ref());
                        }
                        // R31: the tool calls of sampling answers in
                        // `inputResponses` (2026-07-28), judged first, in
                        // the lane.
                        if crate::sampling::may_use_tools(&text) {
                            let (judge, flight) = (judge.clone(), flight.clone());
                            let (session, key) = (session.clone(), key.clone());
                            let to_client = to_client.clone();
                            if !lane.has_permit() {
                                grouper.flush();
                            }
                            lane.judge(async move {
                                let judged =
                                    crate::sampling::judged_request(&judge, &session, text).await;
                                if judged.is_err() {
                                    flight.release(&session, &key);
                                }
                                let sent = judged.and_then(|text| {
                                    request_upstream(&flight, &session, &key, &text)
                                });
                                match sent {
                                    Ok(text) => text,
                                    Err(answer) => {
                                        drop(to_client.send(answer).await);
                                        None
                                    }
                                }
                            })
                            .await;
                            continue;
                        }
                        match request_upstream(&flight, &session, key, &text) {
                            Ok(Some(text)) => text,
                            Ok(None) => continue,
                            Err(answer) => {
                                let _ = to_client.send(answer).await;
                                continue;
                            }
                        }
                    }
                    None => {
                        // A `notifications/cancelled` is mapped when its
                        // turn comes: the request it names may be one
                        // still waiting in the lane.
                        let (flight, session) = (flight.clone(), session.clone());
                        lane.send_made(Box::new(move || {
                            flight.outgoing_notification(&session, text)
                        }))
                        .await;
                        continue;
                    }
                };
                lane.send(text).await;
            }
            Incoming::Single(Item::Reject { id, error }) => {
                let _ = to_client.send(jsonrpc::error(id.as_deref(), &error)).await;
            }
            Incoming::Single(Item::Drop(why)) => tracing::warn!("{why}"),
            Incoming::Single(Item::ToolCall(call)) => {
                // Calls waiting in a group hold permits: judge them before
                // waiting for one.
                if in_flight.available_permits() == 0 {
                    grouper.flush();
                }
                let key = jsonrpc::id_key(&call.id);
                if let Err(error) = flight.reserve(&session, &key) {
                    let _ = to_client.send(jsonrpc::error(Some(&call.id), &error)).await;
                    continue;
                }
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                // In its group now, before the reader flushes the groups.
                let disposition = grouper.enqueue(&session, *call);
                let (to_client, to_upstream) = (to_client.clone(), to_upstream.clone());
                let (judge, flight, session) = (judge.clone(), flight.clone(), session.clone());
                let approvals = approvals.clone();
                tasks.spawn(async move {
                    let disposition = disposition.await;
                    // Judged: an ask waiting for the user holds no permit
                    // (the client's answer must be read).
                    drop(permit);
                    let disposition = match disposition {
                        Disposition::Ask(asked) => {
                            approvals
                                .settle(&judge, &session, *asked, |m| client_send(&to_client, m))
                                .await
                        }
                        decided => decided,
                    };
                    match disposition {
                        Disposition::Forward(text) => {
                            // R31: tool calls in its `inputResponses`.
                            let text = match crate::sampling::judged_request(&judge, &session, text)
                                .await
                            {
                                Ok(text) => text,
                                Err(answer) => {
                                    judge.take_pending(&session, &key);
                                    flight.release(&session, &key);
                                    let _ = to_client.send(answer).await;
                                    return;
                                }
                            };
                            let text = crate::upstream::forward_call(
                                &judge, &flight, &session, &key, &text,
                            );
                            if let Some(text) = text {
                                let _ = to_upstream.send(text).await;
                            }
                        }
                        Disposition::Answer(text) => {
                            flight.release(&session, &key);
                            let _ = to_client.send(text).await;
                        }
                        // Settled above.
                        Disposition::Ask(asked) => {
                            flight.release(&session, &key);
                            let _ = to_client.send(asked.answer).await;
                        }
                    }
                });
            }
            Incoming::Batch(items) => {
                if in_flight.available_permits() == 0 {
                    grouper.flush();
                }
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                let (judge, session) = (judge.clone(), session.clone());
                let (to_client, to_upstream) = (to_client.clone(), to_upstream.clone());
                let (collector, flight) = (collector.clone(), flight.clone());
                let (interceptors, approvals) = (interceptors.clone(), approvals.clone());
                tasks.spawn(async move {
                    relay_batch(
                        items,
                        &judge,
                        &flight,
                        (&interceptors, &approvals),
                        &session,
                        &collector,
                        (&to_client, &to_upstream),
                        permit,
                    )
                    .await;
                });
            }
        }
        // Reap finished tasks as we go.
        while tasks.try_join_next().is_some() {}
    }

    if !upstream_done {
        // The client is done: let the calls in flight finish, then close the
        // upstream's stdin and give it a moment to exit. Asks waiting for
        // the client's user can no longer be answered.
        approvals.close();
        while tasks.join_next().await.is_some() {}
        lane.finish().await;
        // Closing its stdin tells the upstream the session is over.
        to_upstream.close().await;
        if tokio::time::timeout(Duration::from_secs(5), &mut upstream_reader)
            .await
            .is_err()
        {
            upstream_reader.abort();
        }
    } else {
        approvals.close();
        tasks.abort_all();
        lane.abort();
        to_upstream.close_now();
    }
    to_client.close().await;
    if too_long {
        let _ = child.kill().await;
        return Err(StdioError::UpstreamTooLong(args.max_upstream_message_bytes));
    }
    let status = match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
        Ok(Ok(status)) => status.code().unwrap_or(1),
        _ => {
            let _ = child.kill().await;
            1
        }
    };
    // The upstream's last stderr lines (bounded: a process it left behind
    // may hold the pipe open).
    if tokio::time::timeout(Duration::from_secs(1), stderr_relay)
        .await
        .is_err()
    {
        tracing::debug!("the upstream's stderr is still open; not waiting for it");
    }
    Ok(status)
}

/// Longest piece of an upstream stderr line written at once; a longer line
/// is passed on in pieces of this size.
const STDERR_LINE_BYTES: u64 = 64 << 10;

/// Copies the upstream's stderr to `out` line by line, as bytes (not
/// necessarily UTF-8), until it closes. Each line is queued whole, so it is
/// never interleaved with the gateway's own log lines; the queue never
/// blocks (a line it has no room for is dropped and counted), so the
/// upstream's stderr is drained however slowly the gateway's is read.
pub(crate) async fn relay_stderr<R>(from: R, out: &crate::pipes::Stderr)
where
    R: AsyncRead + Unpin,
{
    use tokio::io::AsyncBufReadExt;
    let mut reader = tokio::io::BufReader::new(from);
    loop {
        let mut line = Vec::new();
        match (&mut reader)
            .take(STDERR_LINE_BYTES)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        out.offer(line);
    }
}

/// A reserved client request `text` (not a `tools/call`) of `session`
/// with id key `key` as it goes upstream (`None`: not a request), or the
/// answer refusing it, its id released (R33: a task's result is fetched
/// only when it can be judged).
fn request_upstream(
    flight: &crate::upstream::InFlight,
    session: &str,
    key: &str,
    text: &str,
) -> Result<Option<String>, String> {
    match flight.purpose_of(text) {
        Ok(purpose) => Ok(flight.send(session, key, purpose, text)),
        Err(error) => {
            flight.release(session, key);
            Err(crate::upstream::refuse(text, &error))
        }
    }
}

/// Relays one JSON-RPC batch: its tool calls judged as one guard batch.
/// Each request goes upstream under the gateway's own id; one reusing an
/// id in flight (of the session, or earlier in the batch) is refused.
#[allow(clippy::too_many_arguments)]
async fn relay_batch(
    items: Vec<Item>,
    judge: &Judge,
    flight: &crate::upstream::InFlight,
    (interceptors, approvals): (
        &Arc<crate::interceptors::Interceptors>,
        &crate::approval::Approvals,
    ),
    session: &str,
    collector: &Shared,
    (to_client, to_upstream): (&Lines, &Lines),
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let mut calls = Vec::new();
    let mut answers = Vec::new();
    // (message, its id's key when it is a request that expects a response)
    let mut forwards: Vec<(String, Option<String>)> = Vec::new();
    let items = crate::upstream::without_repeated_ids(items, &mut answers);
    for item in items {
        match item {
            Item::ToolCall(call) => match flight.reserve(session, &jsonrpc::id_key(&call.id)) {
                Ok(()) => calls.push(*call),
                Err(error) => answers.push(jsonrpc::error(Some(&call.id), &error)),
            },
            Item::Forward {
                text,
                request: Some(key),
                lists_tools,
            } => {
                // SEP-2624: answered by the gateway, never forwarded.
                if let Some(answer) = interceptors.take(&text, session) {
                    answers.push(answer.await);
                    continue;
                }
                if let Err(error) = flight.reserve(session, &key) {
                    answers.push(crate::upstream::refuse(&text, &error));
                    continue;
                }
                if lists_tools {
                    lock(collector).lists_tools(Some(&key));
                }
                // R31: tool calls in its `inputResponses`.
                let text = match crate::sampling::judged_request(judge, session, text).await {
                    Ok(text) => text,
                    Err(answer) => {
                        flight.release(session, &key);
                        answers.push(answer);
                        continue;
                    }
                };
                let purpose = match flight.purpose_of(&text) {
                    Ok(purpose) => purpose,
                    Err(error) => {
                        flight.release(session, &key);
                        answers.push(crate::upstream::refuse(&text, &error));
                        continue;
                    }
                };
                if let Some(text) = flight.send(session, &key, purpose, &text) {
                    forwards.push((text, Some(key)));
                }
            }
            Item::Forward {
                text,
                request: None,
                ..
            } => {
                // R35: an answer to an elicitation of the gateway's.
                if approvals.take_answer(&text) {
                    continue;
                }
                approvals.cancel_call(&text);
                // R31: tool calls asked for through sampling, judged.
                let Some(text) = crate::sampling::judged_answer(judge, session, text).await else {
                    continue;
                };
                if let Some(text) = flight.outgoing_notification(session, text) {
                    forwards.push((text, None));
                }
            }
            Item::Reject { id, error } => answers.push(jsonrpc::error(id.as_deref(), &error)),
            Item::Drop(why) => tracing::warn!("{why}"),
        }
    }
    let judged = judge.judge(session, &calls).await;
    // Judged: asks waiting for the user hold no permit.
    drop(permit);
    for (call, disposition) in calls.iter().zip(judged) {
        let key = jsonrpc::id_key(&call.id);
        let disposition = match disposition {
            Disposition::Ask(asked) => {
                approvals
                    .settle(judge, session, *asked, |m| client_send(to_client, m))
                    .await
            }
            decided => decided,
        };
        match disposition {
            Disposition::Forward(text) => {
                // R31: tool calls in its `inputResponses`.
                let text = match crate::sampling::judged_request(judge, session, text).await {
                    Ok(text) => text,
                    Err(answer) => {
                        judge.take_pending(session, &key);
                        flight.release(session, &key);
                        answers.push(answer);
                        continue;
                    }
                };
                if let Some(text) =
                    crate::upstream::forward_call(judge, flight, session, &key, &text)
                {
                    forwards.push((text, Some(key)));
                }
            }
            Disposition::Answer(text) => {
                flight.release(session, &key);
                answers.push(text);
            }
            Disposition::Ask(asked) => {
                flight.release(session, &key);
                answers.push(asked.answer);
            }
        }
    }
    let expected: Vec<String> = forwards.iter().filter_map(|(_, k)| k.clone()).collect();
    if expected.is_empty() {
        if !answers.is_empty() {
            let _ = to_client.send(array(&answers)).await;
        }
    } else {
        let mut c = lock(collector);
        let slot = c.next;
        c.next += 1;
        for key in &expected {
            c.waiting.insert(key.clone(), slot);
        }
        c.slots.insert(slot, (expected.len(), answers));
    }
    for (text, _) in forwards {
        let _ = to_upstream.send(text).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipes::Stderr;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            lock_vec(&self.0).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn lock_vec(v: &Mutex<Vec<u8>>) -> std::sync::MutexGuard<'_, Vec<u8>> {
        v.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[tokio::test]
    async fn stderr_is_relayed_line_by_line_and_bytes_unchanged() {
        let long = vec![b'x'; (STDERR_LINE_BYTES as usize) + 10];
        let mut input = b"first line\n\xff not utf-8\n".to_vec();
        input.extend_from_slice(&long);
        input.extend_from_slice(b"\nno newline at the end");
        let out = Shared::default();
        let queue = Stderr::new(out.clone(), 1 << 20);
        relay_stderr(&input[..], &queue).await;
        assert!(queue.flush(Duration::from_secs(5)));
        assert_eq!(*lock_vec(&out.0), input);
        assert_eq!(queue.dropped(), 0);
    }

    #[tokio::test]
    async fn stderr_keeps_draining_after_its_output_fails() {
        struct Broken;
        impl std::io::Write for Broken {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("closed"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let queue = Stderr::new(Broken, 1 << 10);
        let (mut writer, reader) = tokio::io::duplex(64);
        let relay = tokio::spawn(async move { relay_stderr(reader, &queue).await });
        // Far more than the pipe holds: the writer finishes only if the
        // relay keeps reading.
        for _ in 0..1000 {
            writer
                .write_all(b"a line of upstream logging\n")
                .await
                .unwrap();
        }
        drop(writer);
        relay.await.unwrap();
    }

    /// Nobody reads the output (the writer blocks for good): the relay
    /// still drains the upstream, drops what does not fit and counts it;
    /// when the output takes lines again, the count is written.
    #[tokio::test]
    async fn stderr_not_read_drops_and_counts_and_never_blocks() {
        let gate = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
        struct Gated(Arc<(Mutex<bool>, std::sync::Condvar)>, Shared);
        impl std::io::Write for Gated {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                let (open, changed) = &*self.0;
                let mut open = open.lock().unwrap_or_else(PoisonError::into_inner);
                while !*open {
                    open = changed.wait(open).unwrap_or_else(PoisonError::into_inner);
                }
                self.1.write(buf)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let out = Shared::default();
        let queue = Arc::new(Stderr::new(Gated(gate.clone(), out.clone()), 4 << 10));
        let (mut writer, reader) = tokio::io::duplex(64);
        let relay = tokio::spawn({
            let queue = queue.clone();
            async move { relay_stderr(reader, &queue).await }
        });
        for i in 0..1000 {
            writer
                .write_all(format!("line {i:04} of upstream logging\n").as_bytes())
                .await
                .unwrap();
        }
        drop(writer);
        tokio::time::timeout(Duration::from_secs(5), relay)
            .await
            .expect("the relay never waits for the output")
            .unwrap();
        let dropped = queue.dropped();
        assert!(dropped > 800, "{dropped}");
        // The output is read again.
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        assert!(queue.flush(Duration::from_secs(5)));
        let text = String::from_utf8(lock_vec(&out.0).clone()).unwrap();
        assert!(
            text.starts_with("line 0000 of upstream logging\n"),
            "{text}"
        );
        assert!(
            text.contains(&format!("guardmesh: {dropped} stderr lines dropped")),
            "{text}"
        );
        assert_eq!(text.lines().count() as u64, 1000 - dropped + 1, "{text}");
    }
}
