"""A scripted MCP upstream for the gateway's tests of what comes back
(tests/mcp_returns.rs): it answers each tool the way a hostile or buggy
server might, written as raw JSON-RPC lines, so the tests can check that
only what the mesh judged reaches the client.

Usage: odd_upstream.py stdio
       odd_upstream.py http PORT   (a JSON-only Streamable HTTP endpoint on
                                    127.0.0.1:PORT/mcp)

Tools (every text holding SECRET is what a results guard must see first):
  clean        one answer holding SECRET, with `resultType: "complete"`
  dup_result   one answer with `result` twice: clean first, SECRET last
  dup_id       an answer with `id` twice holding SECRET, then a clean one
  retyped      an answer whose id is the request's as a string (or number)
               holding SECRET, then a clean one
  slow         waits, then answers holding SECRET
  error_secret a JSON-RPC error whose message holds SECRET
  chatty       a log message, a progress notification and a sampling
               request holding SECRET while the call runs, then a clean
               answer
  sampler      (http only) a sampling request on the answer's SSE stream,
               then waits (at most 5 s) for its answer before answering
               the call with what it got: "sampling answered with CODE",
               or "sampling unanswered"
  ask          `input_required` (2026-07-28) until the call carries
               `requestState`, then a clean answer
  any tool with `params.task`: a task is created; `tasks/result` answers
               the tool's result holding SECRET (for any task id, created
               or not), `tasks/get` the task (with a result holding SECRET
               too for a task id starting with `full-`)
"""

import json
import sys
import threading
import time

SECRET = "AKIA" + "IOSFODNN7EXAMPLE"
TOOLS = ["clean", "dup_result", "dup_id", "retyped", "slow", "ask", "error_secret", "chatty", "sampler"]
tasks = {}
# The answers the client side posted to the upstream's own requests, by id.
answers = {}
answered = threading.Condition()


def text(t, result_type=None):
    out = {"content": [{"type": "text", "text": t}]}
    if result_type:
        out["resultType"] = result_type
    return out


def answer(id_, result):
    return json.dumps({"jsonrpc": "2.0", "id": id_, "result": result})


def task(task_id, status):
    return {"taskId": task_id, "status": status, "createdAt": "2026-12-06T00:00:00Z",
            "lastUpdatedAt": "2026-12-06T00:00:00Z", "ttl": 60000}


def handle(msg):
    """The lines (raw JSON texts) answering one message."""
    if "id" not in msg or "method" not in msg:
        return []
    id_, method, params = msg["id"], msg["method"], msg.get("params") or {}
    if method == "initialize":
        return [answer(id_, {"protocolVersion": params.get("protocolVersion", "2025-11-25"),
                             "capabilities": {"tools": {}, "tasks": {"requests": {"tools": {"call": {}}}}},
                             "serverInfo": {"name": "odd", "version": "0"}})]
    if method == "tools/list":
        schema = {"type": "object", "properties": {}}
        return [answer(id_, {"tools": [{"name": n, "inputSchema": schema} for n in TOOLS]})]
    if method == "tools/call":
        name = params.get("name")
        if "task" in params:
            task_id = f"task-{len(tasks) + 1}"
            tasks[task_id] = name
            return [answer(id_, {"task": task(task_id, "working")})]
        if name == "clean":
            return [answer(id_, text("clean " + SECRET, "complete"))]
        if name == "dup_result":
            clean, leak = json.dumps(text("clean")), json.dumps(text("leaked " + SECRET))
            return ['{"jsonrpc":"2.0","id":%s,"result":%s,"result":%s}' % (json.dumps(id_), clean, leak)]
        if name == "dup_id":
            leak = json.dumps(text("leaked " + SECRET))
            return ['{"jsonrpc":"2.0","id":%s,"id":%s,"result":%s}' % (json.dumps(id_), json.dumps(id_), leak),
                    answer(id_, text("clean"))]
        if name == "retyped":
            other = str(id_) if isinstance(id_, int) else (int(id_) if id_.isdigit() else id_ + " ")
            return [answer(other, text("leaked " + SECRET)), answer(id_, text("clean"))]
        if name == "error_secret":
            return [json.dumps({"jsonrpc": "2.0", "id": id_, "error": {
                "code": -32603, "message": "failed reading " + SECRET}})]
        if name == "chatty":
            token = (params.get("_meta") or {}).get("progressToken", "t")
            note = lambda method, p: json.dumps({"jsonrpc": "2.0", "method": method, "params": p})
            return [note("notifications/message", {"level": "info", "data": "read " + SECRET}),
                    note("notifications/progress", {"progressToken": token, "progress": 1,
                                                    "message": "found " + SECRET}),
                    json.dumps({"jsonrpc": "2.0", "id": "s1", "method": "sampling/createMessage",
                                "params": {"maxTokens": 10, "messages": [{"role": "user", "content": {
                                    "type": "text", "text": "summarise " + SECRET}}]}}),
                    answer(id_, text("chatty done"))]
        if name == "slow":
            time.sleep(0.5)
            return [answer(id_, text("slow " + SECRET))]
        if name == "ask":
            if "requestState" in params:
                return [answer(id_, text("answered", "complete"))]
            return [answer(id_, {"resultType": "input_required", "requestState": "state-1",
                                 "inputRequests": {"q": {"method": "elicitation/create", "params": {
                                     "message": "which one?", "requestedSchema": {"type": "object", "properties": {}}}}}})]
        return [json.dumps({"jsonrpc": "2.0", "id": id_, "error": {"code": -32602, "message": "unknown tool"}})]
    if method == "tasks/result":
        return [answer(id_, text("task result " + SECRET))]
    if method == "tasks/get":
        task_id = params.get("taskId", "?")
        if task_id.startswith("full-"):
            # A status that carries a result too.
            return [answer(id_, {**task(task_id, "completed"), **text("task result " + SECRET)})]
        return [answer(id_, task(task_id, "completed"))]
    return [answer(id_, {})]


def stdio():
    lock = threading.Lock()

    def run(msg):
        for line in handle(msg):
            with lock:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        # Each request on its own thread: a slow one holds up no other.
        threading.Thread(target=run, args=(msg,), daemon=True).start()


def http(port):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, status, body=b"", headers=()):
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(405)

        def do_DELETE(self):
            self.reply(200)

        def sampler(self, msg):
            """The sampling request first, the call's answer once the
            request is answered (or 5 s have passed)."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Mcp-Session-Id", "odd-session")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(line):
                data = f"event: message\ndata: {line}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            event(json.dumps({"jsonrpc": "2.0", "id": "s-wait", "method": "sampling/createMessage",
                              "params": {"maxTokens": 10, "messages": [{"role": "user", "content": {
                                  "type": "text", "text": "summarise"}}]}}))
            with answered:
                answered.wait_for(lambda: "s-wait" in answers, timeout=5)
                got = answers.pop("s-wait", None)
            if got is None:
                text_ = "sampling unanswered"
            elif "error" in got:
                text_ = f"sampling answered with {got['error'].get('code')}"
            else:
                text_ = "sampling answered with a result"
            event(answer(msg["id"], text(text_)))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            msg = json.loads(body)
            if isinstance(msg, dict) and "method" not in msg and "id" in msg:
                with answered:
                    answers[msg["id"]] = msg
                    answered.notify_all()
                self.reply(202)
                return
            if isinstance(msg, dict) and msg.get("method") == "tools/call" and \
                    (msg.get("params") or {}).get("name") == "sampler":
                self.sampler(msg)
                return
            lines = handle(msg) if isinstance(msg, dict) else []
            if not lines:
                self.reply(202)
                return
            # Every answer line, as an SSE stream of events.
            events = "".join(f"event: message\ndata: {line}\n\n" for line in lines).encode()
            self.reply(200, events, [("Content-Type", "text/event-stream"),
                                     ("Mcp-Session-Id", "odd-session")])

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if sys.argv[1] == "http":
    http(int(sys.argv[2]))
else:
    stdio()
