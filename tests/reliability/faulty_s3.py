"""A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 server (moto): 5xx, SlowDown, connection resets.

Every request is forwarded unchanged (bodies as sent, chunked or not) unless a `Fault` matches it: the
`nth` request (counting from 1) whose method and path match fails `times` times in a row, with

- `500`: InternalError, the body read and dropped;
- `503`: SlowDown (S3's throttling answer);
- `reset`: the connection is reset (RST) after reading half of the request body: a reset mid-upload;
- `die`: the endpoint goes away: this request is reset and the proxy stops listening, so every later
  connection is refused (a new `FaultyProxy` on the same `port` brings it back).

`hits` counts the faults injected per rule, so a test can check every fault fired.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}
HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailers", "upgrade"}


@dataclass
class Fault:
    method: str  # GET, PUT, HEAD, POST, DELETE
    path: str  # a regex searched in the request path (with query)
    kind: str  # "500", "503", "reset" or "die"
    nth: int = 1
    times: int = 1
    seen: int = 0
    hits: int = 0

    def fires(self, method: str, path: str) -> bool:
        if method != self.method or not re.search(self.path, path):
            return False
        self.seen += 1
        if self.nth <= self.seen < self.nth + self.times:
            self.hits += 1
            return True
        return False


class FaultyProxy:
    """`with FaultyProxy(upstream, faults) as endpoint:` an endpoint URL for s3fs/botocore."""

    def __init__(self, upstream: str, faults: list[Fault] | None = None, port: int = 0):
        self.upstream = urlsplit(upstream)
        self.faults = list(faults or [])
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.dead = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.endpoint

    def __exit__(self, *exc) -> None:
        if not self.dead:
            self.server.shutdown()
        self.server.server_close()

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.requests.append((req.command, req.path))
            fault = None if self.dead else next((f for f in self.faults if f.fires(req.command, req.path)), None)
            if fault is not None and fault.kind == "die":
                self.dead = True
                threading.Thread(target=self._die, daemon=True).start()
        body = _read_body(req, half=fault is not None and fault.kind == "reset")
        if self.dead or (fault is not None and fault.kind == "reset"):  # kept-alive connections die too
            req.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            req.close_connection = True
            req.connection.close()  # RST: the client sees "connection reset by peer" mid-request
            return
        if fault is not None:
            status, code, message = ERRORS[fault.kind]
            data = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                    f"</Message><RequestId>fault</RequestId></Error>").encode()
            _answer(req, status, [("Content-Type", "application/xml")], data)
            return
        self._forward(req, body)

    def _die(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # the port is closed: connections are refused

    def _forward(self, req: BaseHTTPRequestHandler, body: bytes) -> None:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() not in HOP}
            conn.request(req.command, req.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP | {"transfer-encoding",
                                                                                      "content-length"}]
            if req.command == "HEAD":
                kept.append(("Content-Length", resp.getheader("Content-Length", "0")))
                data = b""
            _answer(req, resp.status, kept, data, head=req.command == "HEAD")
        finally:
            conn.close()


def _read_body(req: BaseHTTPRequestHandler, half: bool = False) -> bytes:
    """The request body as sent (chunked bodies raw, chunk framing included); with `half`, half of it."""
    length = req.headers.get("Content-Length")
    if length is not None:
        n = int(length)
        return req.rfile.read(n // 2 if half else n)
    if req.headers.get("Transfer-Encoding", "").lower() != "chunked":
        return b""
    raw = b""
    while True:
        line = req.rfile.readline()
        raw += line
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if half and raw:
            return raw
        if size == 0:  # the last chunk, then trailers (aws-chunked checksums) up to an empty line
            while line not in (b"\r\n", b""):
                line = req.rfile.readline()
                raw += line
            return raw
        raw += req.rfile.read(size + 2)  # data + CRLF


def _answer(req: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], data: bytes,
            head: bool = False) -> None:
    req.send_response_only(status)
    for k, v in headers:
        req.send_header(k, v)
    if not head:
        req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    if data:
        req.wfile.write(data)
    req.wfile.flush()
