"""The client SDK under faults: it reconnects, retries only what is safe to retry, honours
Retry-After and gRPC pushback, and gives its lease back when a round fails. Against real
servers: small scripted HTTP and gRPC servers on local sockets, and a node whose gateway is
killed (kill -9) and restarted by the node's supervisor. No client internals are replaced."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from conftest import RunningNode, wait_for
from redis_proxy import PumpedPair
from lifl import errors
from lifl.client import NO_RETRY, ConnectionLost, Gateway, Participant, RetryPolicy, to_blob
from lifl.net import lifl_pb2 as pb

MODEL = bytes(to_blob({"w": np.zeros(4, np.float32)}))
UPDATE = bytes(to_blob({"w": np.ones(4, np.float32)}))
PATIENT = RetryPolicy(max_attempts=10_000, max_elapsed_s=120.0, max_delay_s=0.5)  # outlasts a restart on a loaded machine


# -- the back-off schedule (pure) ------------------------------------------------------------------

POLICY = RetryPolicy(max_attempts=4, max_elapsed_s=10.0, base_delay_s=0.125, max_delay_s=5.0)


@pytest.mark.parametrize(("tries", "draw", "retry_after", "expected"), [
    (1, 0.0, None, 0.125),  # the first back-off is base_delay_s
    (2, 0.0, None, 0.25),  # then it doubles
    (6, 0.0, None, 4.0),
    (7, 0.0, None, 5.0),  # up to max_delay_s
    (10_000, 0.0, None, 5.0),  # however many tries
    (1, 0.5, None, 0.09375),  # the random part takes up to half off
    (7, 0.999, None, 2.5025),
    (1, 0.0, 3.0, 3.0),  # Retry-After is a floor
    (1, 0.5, 3.0, 3.3),  # stretched by up to 20 % so that refused clients spread out
    (7, 0.0, 2.0, 5.0),  # a longer back-off wins over it
    (1, 0.0, 0.0, 0.125),  # Retry-After 0: the back-off alone
])
def test_backoff_delay(tries: int, draw: float, retry_after: float | None, expected: float) -> None:
    assert POLICY.delay(tries, draw, retry_after) == pytest.approx(expected)


@pytest.mark.parametrize(("tries", "elapsed", "retry_after", "expected"), [
    (1, 0.0, None, 0.125),
    (3, 0.0, None, 0.5),  # the last retry max_attempts allows
    (4, 0.0, None, None),  # one past: out of tries
    (1, 9.875, None, 0.125),  # a wait ending exactly at max_elapsed_s
    (1, 9.9, None, None),  # one that would end past it
    (1, 0.0, 10.0, 10.0),  # a Retry-After that fits what is left
    (1, 0.0, 10.5, None),  # one that does not: give up now rather than sleep in vain
])
def test_next_delay_gives_up_at_the_limits(tries: int, elapsed: float, retry_after: float | None,
                                           expected: float | None) -> None:
    assert POLICY.next_delay(tries, elapsed, 0.0, retry_after) == expected


def test_no_retry_gives_up_at_once() -> None:
    assert NO_RETRY.next_delay(1, 0.0, 0.0) is None and NO_RETRY.next_delay(1, 0.0, 0.0, 0.0) is None


@pytest.mark.parametrize(("options", "valid"), [
    ({"max_attempts": 1}, True),
    ({"max_attempts": 0}, False),
    ({"base_delay_s": 5.0, "max_delay_s": 5.0}, True),
    ({"base_delay_s": 5.5, "max_delay_s": 5.0}, False),
    ({"base_delay_s": 0.0}, False),
    ({"max_elapsed_s": 0.0}, True),
    ({"max_elapsed_s": -1.0}, False),
])
def test_policy_limits_are_checked(options: dict[str, Any], valid: bool) -> None:
    if valid:
        RetryPolicy(**options)
    else:
        with pytest.raises(ValueError):
            RetryPolicy(**options)


# -- a scripted HTTP server --------------------------------------------------------------------------

UNACKNOWLEDGED_FIN = {4, 9, 11}  # tcp_info.tcpi_state FIN_WAIT1, LAST_ACK, CLOSING: our FIN not yet acknowledged


def end_acknowledged(sock: socket.socket) -> None:
    """Send the end of the connection (FIN) and return once the peer's kernel has acknowledged it,
    so that the peer sees the connection closed from then on."""
    with contextlib.suppress(OSError):  # already reset by the peer: nothing to wait for
        sock.shutdown(socket.SHUT_WR)
        wait_for(lambda: sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] not in UNACKNOWLEDGED_FIN,
                 what="the peer to acknowledge the end of the connection")


DROP = "drop"  # read the request, then close the connection without an answer
STALL = "stall"  # read the request and answer nothing until the server closes


def error_body(code: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": f"scripted {code}"}}).encode()


class ScriptedHttp(socketserver.ThreadingTCPServer):
    """A real HTTP/1.1 server (keep-alive) answering request i with ``script[i]`` (the last entry
    repeats): (status, headers, body), DROP or STALL. It records each request (arrival time, method,
    path) and each connection it closed. Created bound but not listening, so that connecting is
    refused until ``serve()``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, script: list[Any]) -> None:
        super().__init__(("127.0.0.1", 0), _ScriptedHandler, bind_and_activate=False)
        self.server_bind()
        self.script = script
        self.requests: list[tuple[float, str, str]] = []
        self.closed_connections = 0
        self._lock = threading.Lock()
        self._serving = False
        self.closing = threading.Event()

    @property
    def address(self) -> str:
        return "{}:{}".format(*self.server_address)

    def serve(self) -> None:
        self.server_activate()
        self._serving = True
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        if self._serving:
            self.shutdown()
        self.server_close()

    def answer(self, method: str, path: str) -> Any:
        with self._lock:
            self.requests.append((time.monotonic(), method, path))
            return self.script[min(len(self.requests), len(self.script)) - 1]

    def connection_closed(self) -> None:
        with self._lock:
            self.closed_connections += 1

    def gap(self, first: int, second: int) -> float:
        return self.requests[second][0] - self.requests[first][0]


class _ScriptedHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ScriptedHttp

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        answer = self.server.answer(self.command, self.path)
        if answer in (DROP, STALL):
            if answer == STALL:
                self.server.closing.wait()
            self.close_connection = True
            return
        status, headers, body = answer
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = headers.get("X-Test-Close") == "1"  # close it afterwards, unannounced

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def finish(self) -> None:
        """Close the connection, and count it once the client's side has seen the close."""
        super().finish()
        end_acknowledged(self.connection)
        self.server.connection_closed()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted_http() -> Iterator[Any]:
    servers: list[ScriptedHttp] = []

    def make(script: list[Any], *, listening: bool = True) -> ScriptedHttp:
        server = ScriptedHttp(script)
        servers.append(server)
        if listening:
            server.serve()
        return server

    yield make
    for server in servers:
        server.close()


JOB = (200, {"Content-Type": "application/json"}, b'{"job": "j", "version": 3}')
ACCEPTED = (202, {"Content-Type": "application/json"}, b'{"version": 0}')


def push(gw: Gateway, client: str = "c") -> dict[str, Any]:
    return gw.push("j", UPDATE, client=client, samples=1, base_version=0)


def test_http_gateway_reconnects_after_a_refused_connect(scripted_http: Any) -> None:
    """One failed connect used to leave http.client's connection unusable (CannotSendRequest)."""
    server = scripted_http([JOB, ACCEPTED], listening=False)
    gw = Gateway(server.address, retry=NO_RETRY)
    for _ in range(2):
        with pytest.raises(errors.Unavailable) as info:
            gw.job("j")
        assert info.value.code == "unreachable"
    server.serve()
    assert gw.job("j") == {"job": "j", "version": 3}
    assert push(gw) == {"version": 0}
    gw.close()


@pytest.mark.parametrize("refusal", [
    (503, {"Retry-After": "1"}, error_body("overloaded")),
    (503, {"Retry-After": "1"}, error_body("unavailable")),
    (429, {"Retry-After": "1"}, error_body("too_many")),
    (503, {"Retry-After": "1"}, b"<html>a proxy's page</html>"),
], ids=["overloaded", "unavailable", "429", "not-json"])
@pytest.mark.parametrize("call", ["read", "push"])
def test_back_pressure_is_retried_no_sooner_than_retry_after(scripted_http: Any, refusal: tuple, call: str) -> None:
    server = scripted_http([refusal, JOB if call == "read" else ACCEPTED])
    gw = Gateway(server.address)
    result = gw.job("j") if call == "read" else push(gw)
    assert result == ({"job": "j", "version": 3} if call == "read" else {"version": 0})
    assert len(server.requests) == 2 and server.gap(0, 1) >= 1.0  # it waited as long as it was told
    gw.close()


@pytest.mark.parametrize(("body", "cls"), [(error_body("overloaded"), errors.Overloaded),
                                           (error_body("inflight_budget"), errors.Overloaded),
                                           (error_body("unavailable"), errors.Unavailable),
                                           (error_body("state_unavailable"), errors.Unavailable),
                                           (error_body("agent_unavailable"), errors.Unavailable)])
def test_503_gives_up_after_max_attempts_with_the_gateways_error(scripted_http: Any, body: bytes, cls: type) -> None:
    server = scripted_http([(503, {"Retry-After": "0"}, body)])
    gw = Gateway(server.address, retry=RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.01))
    with pytest.raises(cls) as info:
        push(gw)
    assert type(info.value) is cls and info.value.code == json.loads(body)["error"]["code"]
    assert len(server.requests) == 3
    gw.close()


def test_retry_after_as_a_date_past_the_budget_gives_up_at_once(scripted_http: Any) -> None:
    server = scripted_http([(503, {"Retry-After": formatdate(time.time() + 3600, usegmt=True)}, error_body("overloaded")), JOB])
    gw = Gateway(server.address, retry=RetryPolicy(max_elapsed_s=60.0))
    with pytest.raises(errors.Overloaded) as info:
        gw.job("j")
    assert 3500 < info.value.retry_after <= 3600 and len(server.requests) == 1
    gw.close()


@pytest.mark.parametrize(("status", "code", "cls"), [
    (400, "bad_header", errors.BadRequest), (404, "no_such_job", errors.NotFound), (409, "round_full", errors.Conflict),
    (413, "payload_too_large", errors.PayloadTooLarge), (422, "non_finite", errors.Unprocessable),
    (500, "internal", errors.Internal),
])
def test_other_errors_are_not_retried(scripted_http: Any, status: int, code: str, cls: type) -> None:
    server = scripted_http([(status, {"Retry-After": "0"}, error_body(code)), ACCEPTED])
    gw = Gateway(server.address)
    with pytest.raises(cls) as info:
        push(gw)
    assert info.value.code == code and len(server.requests) == 1
    gw.close()


def test_a_read_is_retried_when_the_connection_drops_after_sending(scripted_http: Any) -> None:
    server = scripted_http([DROP, JOB])
    gw = Gateway(server.address)
    assert gw.job("j")["version"] == 3 and len(server.requests) == 2
    gw.close()


def test_a_read_that_times_out_is_retried_on_a_new_connection(scripted_http: Any) -> None:
    server = scripted_http([STALL, JOB])
    gw = Gateway(server.address, timeout=2.0)
    assert gw.job("j")["version"] == 3 and len(server.requests) == 2
    gw.close()


ALREADY = (409, {"Content-Type": "application/json"},
           b'{"error": {"code": "already_acknowledged", "message": "taken", "version": 0, "round": 0}}')


def test_a_push_whose_answer_was_lost_is_sent_again(scripted_http: Any) -> None:
    """Safe because a round takes one update per client: the retry cannot count twice."""
    server = scripted_http([DROP, ACCEPTED])
    gw = Gateway(server.address)
    assert push(gw) == {"version": 0} and len(server.requests) == 2
    gw.close()


def test_a_push_whose_first_try_was_taken_reports_it_acknowledged(scripted_http: Any) -> None:
    server = scripted_http([DROP, ALREADY])
    gw = Gateway(server.address)
    assert push(gw) == {"version": 0, "acknowledged_earlier": True} and len(server.requests) == 2
    gw.close()


def test_a_second_push_of_a_client_in_a_round_is_refused(scripted_http: Any) -> None:
    server = scripted_http([ALREADY])
    gw = Gateway(server.address)
    with pytest.raises(errors.Conflict) as info:  # not after a lost answer: this client really pushed twice
        push(gw)
    assert info.value.code == "already_acknowledged" and len(server.requests) == 1
    gw.close()


def test_a_push_does_not_go_on_a_connection_the_gateway_closed_while_idle(scripted_http: Any) -> None:
    closing_job = (JOB[0], {**JOB[1], "X-Test-Close": "1"}, JOB[2])  # kept alive, then closed (an idle timeout)
    server = scripted_http([closing_job, ACCEPTED])
    gw = Gateway(server.address)
    gw.job("j")
    wait_for(lambda: server.closed_connections == 1, what="the server to close the connection")
    assert push(gw) == {"version": 0} and len(server.requests) == 2
    gw.close()


# -- a scripted gRPC server and unreachable gRPC ports -----------------------------------------------

class ScriptedGrpc:
    """A grpcio server whose GetRounds and PushUpdate answer call i with ``script[i]`` (the last
    repeats): None for success, or (status, trailers) to fail; it records when calls arrive."""

    def __init__(self, script: list[Any]) -> None:
        self.script, self.calls = script, []
        handler = grpc.method_handlers_generic_handler("lifl.v1.Gateway", {
            "GetRounds": grpc.unary_unary_rpc_method_handler(
                lambda request, context: self._answer(context, pb.Rounds()),
                request_deserializer=pb.GetRoundsRequest.FromString, response_serializer=pb.Rounds.SerializeToString),
            "PushUpdate": grpc.stream_unary_rpc_method_handler(
                lambda requests, context: self._answer(context, pb.PushUpdateReply(version=sum(len(c.data) for c in requests))),
                request_deserializer=pb.UpdateChunk.FromString, response_serializer=pb.PushUpdateReply.SerializeToString),
        })
        self.server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _answer(self, context: grpc.ServicerContext, reply: Any) -> Any:
        self.calls.append(time.monotonic())
        answer = self.script[min(len(self.calls), len(self.script)) - 1]
        if answer is not None:
            status, trailers = answer
            context.set_trailing_metadata(tuple(trailers.items()))
            context.abort(status, "scripted refusal")
        return reply


@pytest.fixture
def scripted_grpc() -> Iterator[Any]:
    servers: list[ScriptedGrpc] = []

    def make(script: list[Any]) -> ScriptedGrpc:
        servers.append(ScriptedGrpc(script))
        return servers[-1]

    yield make
    for s in servers:
        s.server.stop(0)


@pytest.mark.parametrize(("status", "cls"), [(grpc.StatusCode.RESOURCE_EXHAUSTED, errors.Overloaded),
                                             (grpc.StatusCode.UNAVAILABLE, errors.Unavailable)])
@pytest.mark.parametrize("call", ["read", "push"])
def test_grpc_back_pressure_is_retried_no_sooner_than_the_pushback(scripted_grpc: Any, status: grpc.StatusCode,
                                                                   cls: type, call: str) -> None:
    refusal = (status, {"lifl-error-code": cls.default_code, "grpc-retry-pushback-ms": "1000"})
    server = scripted_grpc([refusal, None])
    gw = Gateway(server.address, "grpc")
    assert (gw.rounds("j") == []) if call == "read" else (push(gw)["version"] == len(UPDATE))
    assert len(server.calls) == 2 and server.calls[1] - server.calls[0] >= 1.0
    server.script = [refusal]  # and once out of attempts, the gateway's error
    gw.retry = NO_RETRY
    with pytest.raises(cls) as info:
        gw.rounds("j") if call == "read" else push(gw)
    assert type(info.value) is cls and info.value.retry_after == 1.0
    gw.close()


def test_grpc_conflict_is_not_retried_and_carries_the_version(scripted_grpc: Any) -> None:
    server = scripted_grpc([(grpc.StatusCode.ABORTED, {"lifl-error-code": "version_conflict", "lifl-version": "7"}), None])
    gw = Gateway(server.address, "grpc")
    with pytest.raises(errors.Conflict) as info:
        push(gw)
    assert (info.value.code, info.value.extra, len(server.calls)) == ("version_conflict", {"version": 7}, 1)
    gw.close()


class CuttableProxy:
    """A TCP proxy to ``upstream`` whose connections the test can cut, as a gateway restart or an
    idle timeout would close them."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rsplit(":", 1)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "{}:{}".format(*self.listener.getsockname())
        self.clients: list[socket.socket] = []
        self.pairs: list[PumpedPair] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client = self.listener.accept()[0]
            except OSError:
                return
            server = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            pair = PumpedPair(client, server)
            self.clients.append(client)
            self.pairs.append(pair)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink, pair), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, pair: PumpedPair) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        pair.pump_ended()

    def cut(self) -> None:
        """Close every connection; return once the clients' kernels have seen it."""
        for client in self.clients:
            end_acknowledged(client)
        for pair in self.pairs:
            pair.shut()  # its pumps close it: never a socket under a thread about to use it
        self.clients.clear()
        self.pairs.clear()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accepting thread
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.cut()


def test_grpc_push_does_not_go_on_an_upload_connection_the_gateway_closed_while_idle(scripted_grpc: Any) -> None:
    server = scripted_grpc([None])
    proxy = CuttableProxy(server.address)
    gw = Gateway(proxy.address, "grpc")
    push(gw)
    proxy.cut()  # the kept upload connection is closed while idle
    assert push(gw)["version"] == len(UPDATE) and len(server.calls) == 2  # sent on a new connection
    gw.close()
    proxy.close()


@pytest.fixture(params=["refused", "closed at once"])
def dead_grpc_port(request: pytest.FixtureRequest) -> Iterator[str]:
    """A port where no gRPC server answers: nothing listens, or a listener closes every connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    address = "{}:{}".format(*listener.getsockname())
    if request.param == "closed at once":
        listener.listen()

        def close_all() -> None:
            while True:
                try:
                    listener.accept()[0].close()
                except OSError:
                    return

        threading.Thread(target=close_all, daemon=True).start()
    yield address
    with contextlib.suppress(OSError):  # wakes the accepting thread
        listener.shutdown(socket.SHUT_RDWR)
    listener.close()


def test_grpc_upload_without_a_connection_raises_unavailable(dead_grpc_port: str) -> None:
    """The upload path used to raise AttributeError when its connection could not be made."""
    gw = Gateway(dead_grpc_port, "grpc", retry=RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.01))
    for _ in range(2):
        with pytest.raises(errors.Unavailable) as info:
            push(gw)
        assert info.value.code == "unreachable"
    gw.close()


# -- a node whose gateway is killed and restarted ----------------------------------------------------


def dead(pid: int) -> bool:
    """Exited with all its threads, so that its sockets are closed: gone, or a zombie whose thread
    group is down to itself (the leader turns zombie before the other threads have exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        return state == b"Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except OSError:
        return True


class Outage:
    """The test's node, with `lifl up`'s supervisor (``Node.supervise``) run in a thread once
    ``supervise()`` is called: until then a killed gateway or agent stays down."""

    def __init__(self, running: RunningNode) -> None:
        self.running, self.node = running, running.node
        self._supervisor: threading.Thread | None = None
        self.admin = Gateway(running.http, retry=PATIENT)  # the test's own view of the job

    def address(self, protocol: str) -> str:
        return self.running.http if protocol == "http" else self.running.grpc

    def pid(self, role: str) -> int:
        return self.node.pids()[role][0]

    def kill(self, role: str) -> int:
        """kill -9 the node's gateway or agent; its pid."""
        pid = self.pid(role)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: dead(pid), what=f"the {role} to die")
        return pid

    def supervise(self) -> None:
        self._supervisor = threading.Thread(target=self.node.supervise, daemon=True)
        self._supervisor.start()

    def wait_restarted(self, old_pid: int) -> None:
        wait_for(lambda: self.pid("gateway") != old_pid and self._answers(), timeout=120, what="the gateway restarted")

    def _answers(self) -> bool:
        try:
            return self.running.request("GET", "/healthz")[0] == 200
        except OSError:
            return False

    def create_job(self, job: str) -> None:
        self.admin.create_job(job, 10, lease_ttl_s=3600.0)  # no lease lapses during a test
        self.admin.set_model(job, MODEL)

    def round(self, job: str) -> dict[str, Any]:
        return self.admin.job(job)["round"]

    def stop(self) -> None:
        if self._supervisor is not None:
            self.node.request_stop()
            self._supervisor.join()
        self.admin.close()


@pytest.fixture
def outage(node: RunningNode) -> Iterator[Outage]:
    o = Outage(node)
    yield o
    o.stop()


PROTOCOLS = pytest.mark.parametrize("protocol", ["http", "grpc"])


@pytest.mark.slow
@PROTOCOLS
def test_gateway_client_fails_clearly_during_an_outage_and_works_after_the_restart(outage: Outage, protocol: str) -> None:
    outage.create_job("a")
    # gives up within a few seconds, and reconnects grpcio's channel as often
    gw = Gateway(outage.address(protocol), protocol, retry=RetryPolicy(max_attempts=10_000, max_elapsed_s=5.0, max_delay_s=0.25))
    gw.push("a", UPDATE, client="before", samples=1, base_version=0)
    old = outage.kill("gateway")

    # The first push meets the connection kept from the last one: it fails before sending, or
    # breaks under way (then the gateway might have taken it, but a round takes one update per
    # client, so it is sent again all the same); either way the retries find nothing to connect
    # to until the policy gives up.
    with pytest.raises(errors.Unavailable):
        gw.push("a", UPDATE, client="during", samples=1, base_version=0)
    with pytest.raises(errors.Unavailable) as info:  # nothing to connect to: certainly not sent
        gw.push("a", UPDATE, client="during", samples=1, base_version=0)
    assert info.value.code == "unreachable"
    with pytest.raises(errors.Unavailable if protocol == "http" else ConnectionLost):  # grpcio cannot tell
        gw.job("a")

    outage.supervise()
    outage.wait_restarted(old)
    assert gw.job("a")["round"]["received"] == 1
    gw.push("a", UPDATE, client="after", samples=1, base_version=0)
    assert gw.job("a")["round"]["received"] == 2
    assert gw.model("a") == (0, MODEL)
    lease = gw.take_lease("a", "x")["lease"]
    gw.heartbeat("a", lease)
    gw.release_lease("a", lease)
    gw.close()


@pytest.mark.slow
@PROTOCOLS
def test_calls_made_during_an_outage_succeed_once_the_gateway_is_back(outage: Outage, protocol: str) -> None:
    outage.create_job("b")
    gw = Gateway(outage.address(protocol), protocol, retry=PATIENT)
    assert gw.job("b")["version"] == 0  # a connection is kept ...
    old = outage.kill("gateway")  # ... and broken
    outage.supervise()  # restarted while the calls below are refused and retried
    assert gw.job("b")["version"] == 0
    gw.push("b", UPDATE, client="during", samples=1, base_version=0)
    assert outage.pid("gateway") != old and outage.round("b")["received"] == 1
    gw.close()


@pytest.mark.slow
@PROTOCOLS
def test_participant_round_completes_across_a_gateway_restart(outage: Outage, protocol: str) -> None:
    outage.create_job("c")
    participant = Participant(outage.address(protocol), "c", "p", protocol=protocol, retry=PATIENT)

    def train(state: dict, version: int) -> tuple[dict, int]:
        outage.kill("gateway")  # the gateway dies under the round; its supervisor brings it back
        outage.supervise()
        return {"w": state["w"] + 1}, 3

    result = participant.run_round(train)
    assert (result.outcome, result.version) == ("accepted", 0)
    assert outage.round("c")["received"] == 1 and outage.round("c")["leases"] == 0  # the update took its place
    participant.close()


@pytest.mark.slow
@PROTOCOLS
def test_participant_round_that_fails_during_an_outage_releases_its_lease(outage: Outage, protocol: str) -> None:
    outage.create_job("d")
    participant = Participant(outage.address(protocol), "d", "p", protocol=protocol, retry=PATIENT)

    def train(state: dict, version: int) -> tuple[dict, int]:
        assert outage.round("d")["leases"] == 1
        outage.kill("gateway")
        outage.supervise()
        raise RuntimeError("the GPU fell over")

    with pytest.raises(RuntimeError, match="the GPU fell over") as info:
        participant.run_round(train)
    assert not getattr(info.value, "__notes__", [])  # nothing to add: the lease was given back
    assert outage.round("d")["leases"] == 0  # released, not lapsed (it would live an hour)
    participant.close()


@pytest.mark.slow
@PROTOCOLS
def test_participant_releases_its_lease_when_the_push_is_refused(outage: Outage, protocol: str) -> None:
    outage.create_job("e")
    participant = Participant(outage.address(protocol), "e", "p", protocol=protocol)

    def train_the_wrong_model(state: dict, version: int) -> tuple[dict, int]:
        assert outage.round("e")["leases"] == 1
        return {"v": np.ones(4, np.float32)}, 1

    with pytest.raises((errors.Unprocessable, errors.BadRequest)) as info:  # 422 is INVALID_ARGUMENT over gRPC
        participant.run_round(train_the_wrong_model)
    assert info.value.code == "missing_tensor"
    assert outage.round("e")["leases"] == 0
    participant.close()


@pytest.mark.slow
@PROTOCOLS
def test_participant_without_a_gateway_fails_clearly_holding_no_lease(outage: Outage, protocol: str) -> None:
    outage.create_job("f")
    participant = Participant(outage.address(protocol), "f", "p", protocol=protocol,
                              retry=RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.01))
    old = outage.kill("gateway")
    with pytest.raises(errors.Unavailable if protocol == "http" else ConnectionLost):
        participant.run_round(lambda state, version: (state, 1))
    outage.supervise()
    outage.wait_restarted(old)
    assert outage.round("f")["leases"] == 0
    participant.close()


@pytest.mark.slow
@PROTOCOLS
def test_without_its_agent_calls_are_unavailable_and_a_push_succeeds_once_it_is_back(outage: Outage, protocol: str) -> None:
    outage.create_job("g")
    gw = Gateway(outage.address(protocol), protocol, retry=PATIENT)
    assert gw.model("g") == (0, MODEL)  # the agent's model reference, shared by the gateway's downloads
    gateway = outage.pid("gateway")
    outage.kill("agent")  # not restarted until supervise()
    headers = {"X-Lifl-Client": "raw", "X-Lifl-Samples": "1", "X-Lifl-Base-Version": "0"}
    status, answer_headers, body = outage.running.request("POST", "/v1/jobs/g/updates", UPDATE, headers)
    assert status == 503 and int(answer_headers["Retry-After"]) >= 1, body
    assert json.loads(body)["error"]["code"] == "agent_unavailable"
    impatient = Gateway(outage.address(protocol), protocol, retry=NO_RETRY)
    with pytest.raises(errors.Unavailable) as info:  # over gRPC, the status UNAVAILABLE
        impatient.push("g", UPDATE, client="refused", samples=1, base_version=0)
    assert info.value.code == "agent_unavailable" and info.value.retry_after >= 1
    impatient.close()

    with futures.ThreadPoolExecutor(1) as pool:
        pushed = pool.submit(gw.push, "g", UPDATE, client="during", samples=1, base_version=0)  # retried meanwhile
        outage.supervise()  # brings the agent back; the gateway connects to it again
        assert pushed.result(timeout=180) == {"version": 0}
    assert outage.round("g")["received"] == 1 and outage.pid("gateway") == gateway
    assert gw.model("g") == (0, MODEL)  # restored by the new agent from its checkpoint
    gw.close()
