"""The shim of lifl's aggregator function: the template's part, kept apart from the handler.

The handler (``function/handler.py``, the repo's ``functions/aggregator``) speaks only lifl's
``Context``; this shim gives it work and speaks the function platform's HTTP contract:

- it attaches to the node agent's function socket (``LIFL_AGENT_SOCKET``, the host's /run/lifl
  mounted into the pod) as one of ``LIFL_TENANT``'s instances, and is invoked there: object
  keys arrive on its key endpoint, model bytes never travel (they stay in the node's shared
  memory, which the pod shares through hostIPC);
- on ``PORT`` it answers the watchdog's health check ``GET /_/health`` (200 once attached,
  503 while it waits for the node's agent) and ``GET|POST /`` with its status as JSON, which is
  all an HTTP invocation through a gateway can do for a function the agent invokes.

SIGTERM (the pod going away) ends it: the agent runs a task it had again elsewhere. A refusal by
the agent (the pod runs as the wrong user for its tenant) ends it with status 2 and the reason.
"""

from __future__ import annotations

import dataclasses
import http.server
import importlib.util
import json
import os
import signal
import socketserver
import sys
import threading
from pathlib import Path
from typing import Any

from lifl.jobs import TENANT_NAME
from lifl.runtime import AttachedInstance, AttachRefused, Handler

MAX_REQUEST_BYTES = 64 << 10  # a status request carries nothing: larger bodies are refused
REQUEST_TIMEOUT_S = 10.0  # a client that sends nothing for this long is dropped
DEFAULT_SOCKET = "/run/lifl/functions.sock"


def load_handler(directory: Path) -> Handler:
    """``handle`` of ``directory/handler.py``, loaded by path as the platform's templates do."""
    spec = importlib.util.spec_from_file_location("handler", directory / "handler.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"lifl function: no handler at {directory / 'handler.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.handle


def status_server(instance: AttachedInstance, port: int) -> http.server.ThreadingHTTPServer:
    class Status(http.server.BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S
        server_version = "lifl-function"

        def _reply(self, code: int, body: dict[str, Any] | str) -> None:
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _status(self) -> dict[str, Any]:
            return {**dataclasses.asdict(instance.status), "ready": instance.status.ready}

        def do_GET(self) -> None:
            if self.path == "/_/health":
                ready = instance.status.ready
                self._reply(200 if ready else 503, "OK" if ready else (instance.status.problem or "attaching") + "\n")
            elif self.path == "/":
                self._reply(200, self._status())
            else:
                self._reply(404, {"error": f"no such path {self.path!r}: / and /_/health"})

        def do_POST(self) -> None:
            if self.path != "/":
                self._reply(404, {"error": f"no such path {self.path!r}: /"})
                return
            length = self.headers.get("Content-Length", "0")
            if not length.isdecimal() or int(length) > MAX_REQUEST_BYTES:
                self.close_connection = True
                self._reply(413, {"error": f"a request body is at most {MAX_REQUEST_BYTES} bytes"})
                return
            self.rfile.read(int(length))
            self._reply(200, self._status())

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probes every few seconds: nothing worth a log line

    return StatusServer(("0.0.0.0", port), Status)


class StatusServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # not HTTPServer's: it resolves its own name (a DNS lookup a pod may wait on for seconds)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "lifl-function", self.server_address[1]


def main() -> int:
    tenant = os.environ.get("LIFL_TENANT", "")
    if not TENANT_NAME.fullmatch(tenant):
        print(f"lifl function: LIFL_TENANT must name the tenant (1-31 lowercase letters, digits, '-'), got {tenant!r}",
              file=sys.stderr)
        return 2
    port_text = os.environ.get("PORT", "8080")
    if not port_text.isdecimal() or int(port_text) > 65535:
        print(f"lifl function: PORT must be a port number, got {port_text!r}", file=sys.stderr)
        return 2
    socket_path = os.environ.get("LIFL_AGENT_SOCKET", DEFAULT_SOCKET)
    directory = Path(os.environ.get("LIFL_FUNCTION_DIR") or Path(__file__).resolve().parent / "function")
    instance = AttachedInstance(socket_path, tenant, load_handler(directory))
    server = status_server(instance, int(port_text))
    threading.Thread(target=server.serve_forever, name="status", daemon=True).start()
    print(f"lifl function: tenant {tenant}, status on :{server.server_address[1]}, attaching to {socket_path}",
          file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: instance.stop())
    try:
        instance.run()
    except AttachRefused as e:
        print(f"lifl function: the node's agent refused this instance: {e}", file=sys.stderr)
        return 2
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
