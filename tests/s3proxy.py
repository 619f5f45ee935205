"""Failure injection for S3 tests: an HTTP proxy on 127.0.0.1 in front of the real S3 server.

Requests pass through unchanged (the Host header too, so SigV4 signatures stay valid) unless the
proxy's ``plan`` says otherwise for that request: ``"503"`` / ``"500"`` answer with an S3 error
(SlowDown / InternalError) without reaching the server, ``"reset"`` drops the connection without
an answer, ``"down"`` drops it and calls ``down(down_seconds)``. ``down(seconds)`` closes the
listening socket and every open connection, as a server restart does, and listens again on the
same port after ``seconds``. Every request is logged with
what was done to it, so a test can count attempts.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PASS, ERROR_503, ERROR_500, RESET, DOWN = "pass", "503", "500", "reset", "down"
_ERRORS = {ERROR_503: ("SlowDown", "Please reduce your request rate."),
           ERROR_500: ("InternalError", "We encountered an internal error. Please try again.")}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer",
               "upgrade"}


@dataclass
class Logged:
    method: str
    path: str
    action: str


@dataclass
class S3Proxy:
    """A proxy to ``upstream`` (host, port); ``plan(n, method, path)`` picks the action of request n."""

    upstream: tuple[str, int]
    plan: Callable[[int, str, str], str] = lambda n, method, path: PASS
    log: list[Logged] = field(default_factory=list)
    port: int = 0
    down_seconds: float = 1.5
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sockets: set = field(default_factory=set)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Proxy:
        """Listen on 127.0.0.1 (the same port again after a restart)."""
        self._server = _QuietServer(("127.0.0.1", self.port), _handler(self))
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection (clients see refused / reset)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            for sock in list(self._sockets):
                _abort(sock)
            self._sockets.clear()

    def down(self, seconds: float) -> threading.Thread:
        """Go down now (refusing connections, dropping open ones) and come back on the same port
        after ``seconds`` (in the background)."""
        self.stop()

        def _back() -> None:
            time.sleep(seconds)
            self.start()

        thread = threading.Thread(target=_back, daemon=True)
        thread.start()
        return thread

    def record(self, method: str, path: str) -> str:
        """Log a request and return its action."""
        with self._lock:
            action = self.plan(len(self.log), method, path)
            self.log.append(Logged(method, path, action))
        return action

    def count(self, action: str | None = None) -> int:
        return sum(1 for r in self.log if action is None or r.action == action)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # dropped connections are the point
        pass


def every(k: int, action: str, first: int = 0) -> Callable[[int, str, str], str]:
    """A plan: every k-th request (counting from ``first``) gets ``action``, the rest pass."""
    return lambda n, method, path: action if n >= first and (n - first) % k == 0 else PASS


def first(count: int, action: str) -> Callable[[int, str, str], str]:
    """A plan: the first ``count`` requests get ``action``, the rest pass."""
    return lambda n, method, path: action if n < count else PASS


def at_put(k: int, action: str) -> Callable[[int, str, str], str]:
    """A plan: the k-th PUT (1-based) gets ``action``, every other request passes."""
    puts = []

    def plan(n: int, method: str, path: str) -> str:
        if method != "PUT":
            return PASS
        puts.append(n)
        return action if len(puts) == k else PASS

    return plan


def _abort(sock: socket.socket) -> None:
    """Drop a connection now with RST (SO_LINGER 0): the peer sees 'connection reset', no answer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)  # acts at once, even while the handler's files hold the socket
    except OSError:
        pass
    sock.close()


def _handler(proxy: S3Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def setup(self) -> None:
            super().setup()
            with proxy._lock:
                proxy._sockets.add(self.connection)

        def finish(self) -> None:
            with proxy._lock:
                proxy._sockets.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _handle(self) -> None:
            body = self._body()
            action = proxy.record(self.command, self.path)
            if action == DOWN:  # stop listening before the client can see a failure and retry
                proxy.down(proxy.down_seconds)
                return
            if action == RESET:
                _abort(self.connection)
                self.close_connection = True
                return
            if action in _ERRORS:
                self._s3_error(int(action), *_ERRORS[action])
                return
            self._forward(body)

        def _s3_error(self, status: int, code: str, message: str) -> None:
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                   f"<Message>{message}</Message></Error>").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)

        def _forward(self, body: bytes) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
            try:
                conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST")
                             else None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            self.send_response(resp.status, resp.reason)
            for key, value in resp.getheaders():
                if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                    self.send_header(key, value)
            length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", length or "0")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    return Handler
