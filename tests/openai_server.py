"""A small OpenAI-compatible chat server on 127.0.0.1 for tests, serving a transformers target.

It renders the messages with the target's chat template (`ChatFormat.prompt_ids`, with
`chat_template_kwargs` and `tools`), generates greedily with `HFEngine.generate_ids`, one
request at a time (the model lock), and answers in chat-completion JSON. Faults are
injected by the test: the next N requests fail with a status, are held until the server
stops (past any client timeout, whatever the machine's load), or get a canned message;
`restart()` drops every connection (in-flight requests get no answer, as when a process
dies) and listens again on the same port. Waits are event-based, never timed: a test that
counts requests must hold under a loaded CI machine.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from draftflow.chat import ChatFormat
from draftflow.engines.base import SamplingParams
from draftflow.engines.hf import HFEngine
from draftflow.errors import ConversationError

log = logging.getLogger(__name__)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):  # dropped sockets are expected here
        log.debug("connection from %s ended with an error", client_address)


class OpenAITestServer:
    """Serve `engine` as `model_name` at `self.url` (`http://127.0.0.1:<port>/v1`).

    Attributes the test reads: `handled` (requests answered 200), `dropped` (requests cut
    by `restart`), `peak` (most chat requests in flight at once), `bodies` (request JSON).
    """

    def __init__(self, engine: HFEngine, model_name: str = "tiny", port: int = 0):
        self.engine, self.model_name, self.port = engine, model_name, port
        self.chat = ChatFormat(engine.tokenizer)
        self.delay_s = 0.0  # extra latency per chat request, outside the model lock
        self.faults: collections.deque[tuple[str, Any]] = collections.deque()
        self.handled = self.dropped = self.in_flight = self.peak = 0
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []  # the Authorization header of each chat request
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._epoch = 0
        self._released = threading.Event()  # set by stop(): held requests return (and are dropped)
        self._held = threading.Event()  # set when a request starts being held
        self._gate: tuple[int, threading.Event] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- fault injection ---------------------------------------------------------------
    def fail_next(self, status: int, n: int = 1, message: str = "injected failure") -> None:
        self.faults.extend([("status", (status, message))] * n)

    def hold_next(self, n: int = 1) -> None:
        """The next `n` requests get no answer until the server stops (a client sees a timeout)."""
        self.faults.extend([("hold", None)] * n)

    def gate_first(self, n: int, timeout_s: float = 60.0) -> None:
        """The next `n` requests wait until `n` are in flight at once (or `timeout_s`), then go on."""
        self._gate = (n, threading.Event())
        self._gate_timeout_s = timeout_s

    def canned_next(self, message: dict[str, Any], finish_reason: str = "stop", n: int = 1) -> None:
        self.faults.extend([("canned", (message, finish_reason))] * n)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> OpenAITestServer:
        self._released = threading.Event()
        self._httpd = _HTTPServer(("127.0.0.1", self.port), _make_handler(self))
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection; in-flight requests get no answer."""
        if self._httpd is None:
            return
        with self._lock:
            self._epoch += 1
            conns, self._conns = list(self._conns), set()
        self._released.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd = None
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def restart_when_held(self, down_s: float = 0.2) -> threading.Thread:
        """Hold the next request, and restart the server once it is held: that request is always cut."""
        self._held.clear()
        self.hold_next()

        def run():
            if self._held.wait(timeout=120):
                self.restart(down_s)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    # -- request handling --------------------------------------------------------------
    def track(self, conn: socket.socket, add: bool) -> int:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)
            return self._epoch

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            gate = self._gate
            if gate and self.in_flight >= gate[0]:
                gate[1].set()
        if gate is not None and not gate[1].is_set():
            gate[1].wait(self._gate_timeout_s)

    def leave(self, epoch: int, status: int) -> bool:
        """Count the request out; False when a restart cut it (its answer must not be sent)."""
        with self._lock:
            self.in_flight -= 1
            if epoch != self._epoch:
                self.dropped += 1
                return False
            self.handled += status == 200
            return True

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(status, JSON) for one chat request, after any injected fault."""
        self.bodies.append(body)
        fault = self.faults.popleft() if self.faults else None
        if fault and fault[0] == "status":
            status, message = fault[1]
            return status, {"error": {"message": message, "type": "InjectedError", "code": status}}
        if fault and fault[0] == "hold":
            released = self._released
            self._held.set()
            released.wait()
        time.sleep(self.delay_s)
        if fault and fault[0] == "canned":
            return 200, self._response(*fault[1], {"prompt_tokens": 1, "completion_tokens": 1})
        try:
            return 200, self._generate(body)
        except (ConversationError, KeyError, TypeError, ValueError) as exc:
            return 400, {"error": {"message": f"bad request: {exc}", "type": "BadRequestError", "code": 400}}

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        ids = self.chat.prompt_ids(_template_messages(body["messages"]), **kwargs)
        params = SamplingParams(max_new_tokens=int(body.get("max_tokens") or 16),
                                temperature=float(body.get("temperature") or 0.0))
        c = self.engine.generate_ids([ids], params)[0]
        usage = {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens}
        return self._response({"role": "assistant", "content": c.text}, c.finish_reason, usage)

    def _response(self, message: dict[str, Any], finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        usage = {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}
        return {"id": f"chatcmpl-{self.handled}", "object": "chat.completion", "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], "usage": usage}


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments back to dicts before templating, as vLLM does."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


class _Handler(BaseHTTPRequestHandler):
    """OpenAI routes: GET /v1/models, POST /v1/chat/completions; `owner` is the test server."""

    protocol_version = "HTTP/1.1"  # keep-alive, as real servers: restart must cut pooled connections
    owner: OpenAITestServer

    def setup(self):
        super().setup()
        self.epoch = self.owner.track(self.connection, add=True)

    def finish(self):
        self.owner.track(self.connection, add=False)
        super().finish()

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self):
        if self.path.rstrip("/").endswith("/models"):
            self._send(200, {"object": "list", "data": [{"id": self.owner.model_name, "object": "model"}]})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not self.path.endswith("/chat/completions"):
            return self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})
        self.owner.auth.append(self.headers.get("Authorization"))
        self.owner.enter()
        status, answer = 500, {"error": {"message": "server error", "code": 500}}
        try:
            status, answer = self.owner.answer(body)
        finally:
            alive = self.owner.leave(self.epoch, status)
        if not alive:  # restarted meanwhile: this "process" died before answering
            self.close_connection = True
            return
        self._send(status, answer)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timeout) or the server was stopped
            self.close_connection = True


def _make_handler(server: OpenAITestServer) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"owner": server})
