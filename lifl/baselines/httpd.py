"""The HTTP/1.1 plumbing of the baselines' servers (frontend, sidecar, function), on the standard
library's threading server: one thread per connection, bodies read with ``readinto`` into one
preallocated buffer, responses written from the caller's buffers without joining them.

Every limit is explicit: a body must declare its length (no chunked uploads) and stay under
the server's ``max_body``; a request whose body is refused closes its connection."""

from __future__ import annotations

import json
import socket
import socketserver
import sys
import threading
import traceback
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lifl.errors import BadRequest, Internal, LiflError, PayloadTooLarge

READ_CHUNK = 1 << 20  # what one readinto asks for: large reads, few system calls


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_body: int) -> None:
        self.max_body = max_body
        super().__init__(address, handler)

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: it resolves the host name

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"


def serve(handler: type[BaseHTTPRequestHandler], address: str, max_body: int) -> Server:
    """A server for ``handler`` on ``address`` (port 0: any), serving in a thread of its own."""
    host, port = address.rsplit(":", 1)
    server = Server((host, int(port)), handler, max_body)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request would cost more than the baselines' work

    def body_length(self) -> int:
        text = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest("send the body with Content-Length (chunked bodies are not taken)", code="chunked_body")
        if text is None or not text.isdigit() or len(text) > 19:
            raise BadRequest("a body needs Content-Length, a decimal byte count", code="no_length")
        size = int(text)
        if size > self.server.max_body:
            raise PayloadTooLarge(f"body of {size} bytes is over the limit of {self.server.max_body} bytes", code="too_large")
        return size

    def read_body(self) -> bytearray:
        """The whole body, read into one buffer of its declared size."""
        size = self.body_length()
        body = bytearray(size)
        view = memoryview(body)
        got = 0
        while got < size:
            n = self.rfile.readinto(view[got : got + READ_CHUNK])
            if not n:
                raise BadRequest(f"body ended after {got} of {size} bytes", code="truncated")
            got += n
        return body

    def send_parts(self, status: int, parts: Sequence[bytes | bytearray | memoryview], content_type: str,
                   headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(sum(len(p) for p in parts)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        for part in parts:
            self.wfile.write(part)

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.send_parts(status, [json.dumps(obj).encode()], "application/json", headers)

    def send_error_of(self, error: LiflError) -> None:
        self.close_connection = True  # an unread body may follow: never reuse the connection
        self.send_json(error.status, error.body(), {"Connection": "close"})

    def guarded(self, serve: Any) -> None:
        """Run one request's handler, answering a LiflError with its status and anything else with 500."""
        try:
            serve()
        except LiflError as e:
            self.send_error_of(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.send_error_of(Internal(f"internal error: {type(e).__name__}"))
