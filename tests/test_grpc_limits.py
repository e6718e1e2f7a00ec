"""The gRPC server's limits, each at the limit and one past it, and its failure handling: a
real GrpcServer in this process, on a stand-in for the gateway service, driven by raw HTTP/2."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import hpack
import pytest

from conftest import wait_for
from lifl.auth import OPERATOR, Principal
from lifl.errors import Unavailable
from lifl.net import lifl_pb2 as pb
from lifl.gateway.grpc_server import SERVICE, GrpcLimits, GrpcServer
from lifl.gateway.service import GatewayMetrics
from lifl.net.limits import ConnectionLimits
from lifl.net.loop import Loop
from lifl.client.grpcwire import UploadConnection
from lifl.net import h2
from lifl.net.grpc import GRPC_STATUS, chunk_messages, message_prefix
from lifl.store import MappingCache

FOREVER = 3600.0  # a flood period no test outlasts


# -- a stand-in for GatewayService: uploads into memory, a model from a memfd -------------------------
class MemorySink:
    ready = True  # admitted at once

    def __init__(self, size: int) -> None:
        self.data = bytearray(size)
        self.received = 0

    @property
    def done(self) -> bool:
        return self.received == len(self.data)

    def buffer(self) -> memoryview:
        return memoryview(self.data)[self.received :]

    def advance(self, n: int) -> None:
        self.received += n


class FakeIngest:
    def __init__(self, size: int) -> None:
        self.sink = MemorySink(size)
        self.aborted = threading.Event()

    def finish(self, done) -> None:
        assert self.sink.done
        done({"version": 0}, None)

    def abort(self, error, then=lambda: None) -> None:
        self.aborted.set()
        then()


class FakeView:
    def __init__(self, service: FakeService) -> None:
        self.service = service
        self.fd = os.memfd_create("model")
        os.write(self.fd, service.model)
        self.size, self.version = len(service.model), 3

    def release(self) -> None:
        os.close(self.fd)
        self.service.released += 1


class FakeService:
    def __init__(self, model: bytes = b"model bytes " * 1000) -> None:
        self.loop = Loop("fake gateway")
        self.mappings = MappingCache()
        self.metrics = GatewayMetrics()
        self.model = model
        self.ingests: list[FakeIngest] = []
        self.released = 0

    def identify(self, authorization: str | None, certificate: dict | None, peer: str, done) -> None:
        done(Principal(OPERATOR), None)  # the server's limits are the subject here, not who calls

    def begin_update(self, caller: Principal, job: str, fields: dict, protocol: str, size: int | None, done) -> None:
        self.ingests.append(FakeIngest(size or 16))
        done(self.ingests[-1], None)

    def rounds(self, caller: Principal, job: str, limit: int) -> list:
        if job == "boom":
            raise RuntimeError("boom")
        if job == "agent-gone":
            raise ConnectionRefusedError("the agent's socket refused")
        if job == "redis-down":
            raise Unavailable("redis is down", retry_after=2.5)
        return []

    def open_model(self, caller: Principal, job: str, done) -> None:
        done(FakeView(self), None)


@pytest.fixture
def start() -> Iterator[Callable[..., tuple[str, FakeService, GrpcServer]]]:
    servers: list[GrpcServer] = []

    def start_server(grpc: GrpcLimits = GrpcLimits(), connections: ConnectionLimits | None = None,
                     http2: h2.Limits | None = None) -> tuple[str, FakeService, GrpcServer]:
        service = FakeService()
        if http2 is not None:
            grpc = dataclasses.replace(grpc, http2=http2)
        server = GrpcServer(service, "127.0.0.1", 0, connections, grpc)  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return "{}:{}".format(*server.address), service, server

    yield start_server
    for server in servers:
        server.stop()


# -- a raw HTTP/2 client: the frames a test builds, the server's frames one by one ----------------------
class Peer:
    def __init__(self, address: str, settings: list[tuple[int, int]] | None = None) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.decoder = hpack.Decoder()
        self.encoder = hpack.Encoder()
        self.buffer = b""
        self.send(h2.PREFACE + h2.settings_frame(settings or []))

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def close(self) -> None:
        self.sock.close()

    def next_frame(self) -> tuple[h2.FrameHeader, bytes] | None:
        """The server's next frame; None once it has closed the connection."""
        while True:
            if len(self.buffer) >= 9:
                header = h2.parse_frame_header(self.buffer[:9])
                if len(self.buffer) >= 9 + header.length:
                    payload = self.buffer[9 : 9 + header.length]
                    self.buffer = self.buffer[9 + header.length :]
                    if header.type in (h2.HEADERS, h2.CONTINUATION):
                        payload = self.decoder.decode(payload)  # the table must see every block
                    return header, payload
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None
            self.buffer += chunk

    def until(self, wanted: Callable[[h2.FrameHeader, bytes], bool]) -> tuple[h2.FrameHeader, bytes]:
        while True:
            frame = self.next_frame()
            assert frame is not None, "the server closed the connection"
            if wanted(*frame):
                return frame

    def goaway_code(self) -> int | None:
        """The error code of the server's GOAWAY (None: it closed without one)."""
        while True:
            frame = self.next_frame()
            if frame is None:
                return None
            if frame[0].type == h2.GOAWAY:
                return struct.unpack_from(">I", frame[1], 4)[0]

    def trailers(self, sid: int) -> dict[str, str]:
        """The headers that end stream ``sid`` (a response's trailers)."""
        _, headers = self.until(lambda hd, p: hd.type == h2.HEADERS and hd.stream_id == sid and bool(hd.flags & h2.END_STREAM))
        return dict(headers)

    def rst_code(self, sid: int) -> int:
        _, payload = self.until(lambda hd, p: hd.type == h2.RST_STREAM and hd.stream_id == sid)
        return struct.unpack(">I", payload)[0]

    def request(self, sid: int, method: str, *, end_stream: bool = False, **kw) -> bytes:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
                                     (":authority", "gw"), ("content-type", "application/grpc"), ("te", "trailers")])
        return h2.headers_frame(sid, block, end_stream=end_stream, **kw)

    def unary(self, sid: int, method: str, message: bytes) -> bytes:
        return self.request(sid, method) + h2.data_frame(sid, message_prefix(len(message)) + message, end_stream=True)

    def rounds_call(self, sid: int, job: str = "ok") -> dict[str, str]:
        self.send(self.unary(sid, "GetRounds", pb.GetRoundsRequest(job=job).SerializeToString()))
        return self.trailers(sid)


def push_meta(size: int) -> bytes:
    """The first message of a PushUpdate stream (its meta), framed."""
    meta = pb.UpdateMeta(job="j", client="c", samples=1, size=size).SerializeToString()
    return b"".join(bytes(p) for p in next(chunk_messages(meta, b"", 1)))


# -- frame size -----------------------------------------------------------------------------------------
def test_a_data_frame_of_the_advertised_size_is_taken_and_one_byte_more_is_refused_unread(start) -> None:
    limit = 32768
    address, service, _ = start(http2=h2.Limits(max_frame_size=limit))
    peer = Peer(address)
    data = bytes(range(256)) * 200
    field = b"\x12" + b"\xf7\xff\x01"  # data = 2, 32759 bytes: the message fills the frame exactly
    message = message_prefix(len(field) + 32759) + field + data[:32759]
    assert len(message) == limit
    peer.send(peer.request(1, "PushUpdate"), h2.data_frame(1, push_meta(32759)), h2.data_frame(1, message, end_stream=True))
    assert peer.trailers(1)["grpc-status"] == "0"
    assert service.ingests[0].sink.data == data[:32759]
    peer.send(peer.request(3, "PushUpdate"), h2.frame_header(limit + 1, h2.DATA, 0, 3))  # the payload never comes
    assert peer.goaway_code() == h2.FRAME_SIZE_ERROR


def test_a_connection_error_ends_with_goaway_and_a_clean_close_however_much_the_peer_still_sends(start) -> None:
    """The GOAWAY must reach the client, then EOF: closing with unread bytes would reset the
    connection instead (h2spec 5.4.1 and 6.7 read a reset as a failure)."""
    address, _, _ = start()
    peer = Peer(address)
    peer.until(lambda hd, p: hd.type == h2.SETTINGS and not hd.flags & h2.ACK)
    peer.send(h2.frame_header(8, h2.PING, 0, 3), bytes(1 << 18))  # PING on a stream: a connection error, then more bytes
    assert frames_until_eof(peer)[-1] == (h2.GOAWAY, h2.PROTOCOL_ERROR)


def test_a_client_that_says_goodbye_gets_goaway_and_a_clean_close_however_much_it_still_sends(start) -> None:
    address, _, _ = start()
    peer = Peer(address)
    peer.until(lambda hd, p: hd.type == h2.SETTINGS and not hd.flags & h2.ACK)
    peer.send(h2.encode_frame(h2.GOAWAY, 0, 0, struct.pack(">II", 0, 0xFF)), h2.ping_frame(b"h2spec\0\0") * 20000)
    assert frames_until_eof(peer)[-1] == (h2.GOAWAY, h2.NO_ERROR)


def frames_until_eof(peer: Peer) -> list[tuple[int, int | None]]:
    """The server's frames up to its close, as (type, GOAWAY's code); a reset fails the test."""
    frames: list[tuple[int, int | None]] = []
    while True:
        chunk = peer.sock.recv(1 << 16)  # a reset raises here
        if not chunk:
            break
        peer.buffer += chunk
        while len(peer.buffer) >= 9 and len(peer.buffer) >= 9 + h2.parse_frame_header(peer.buffer[:9]).length:
            header = h2.parse_frame_header(peer.buffer[:9])
            code = struct.unpack_from(">I", peer.buffer, 9 + 4)[0] if header.type == h2.GOAWAY else None
            frames.append((header.type, code))
            peer.buffer = peer.buffer[9 + header.length:]
    assert not peer.buffer
    return frames


# -- header list size --------------------------------------------------------------------------------------
def headers_of_list_size(size: int) -> list[tuple[str, str]]:
    base = [(":method", "POST"), (":scheme", "http"), (":path", SERVICE + "GetRounds"), (":authority", "gw"),
            ("content-type", "application/grpc")]
    used = sum(len(n) + len(v) + 32 for n, v in base) + len("x-pad") + 32
    return base + [("x-pad", "p" * (size - used))]


def test_a_header_list_of_the_advertised_size_is_taken_and_one_byte_more_is_refused(start) -> None:
    limit = 4096
    address, _, _ = start(http2=h2.Limits(max_header_list_size=limit))
    peer = Peer(address)
    message = pb.GetRoundsRequest(job="ok").SerializeToString()
    body = h2.data_frame(1, message_prefix(len(message)) + message, end_stream=True)
    peer.send(h2.headers_frame(1, hpack.Encoder().encode(headers_of_list_size(limit))), body)
    assert peer.trailers(1)["grpc-status"] == "0"
    peer.send(h2.headers_frame(3, hpack.Encoder().encode(headers_of_list_size(limit + 1))))
    assert peer.goaway_code() == h2.ENHANCE_YOUR_CALM


def test_a_header_block_over_the_limit_is_refused_before_it_is_read(start) -> None:
    address, _, _ = start(http2=h2.Limits(max_header_list_size=4096))
    peer = Peer(address)
    peer.send(h2.frame_header(4097, h2.HEADERS, h2.END_HEADERS, 1))  # no payload follows
    assert peer.goaway_code() == h2.ENHANCE_YOUR_CALM


# -- message sizes ------------------------------------------------------------------------------------------
def test_a_unary_request_of_the_limit_is_taken_and_one_byte_more_is_refused(start) -> None:
    address, _, _ = start(GrpcLimits(max_unary_message=100))
    peer = Peer(address)
    for sid, job_length, status in ((1, 98, "0"), (3, 99, str(GRPC_STATUS["INVALID_ARGUMENT"]))):
        message = pb.GetRoundsRequest(job="j" * job_length).SerializeToString()
        assert len(message) == 100 + (sid == 3)
        peer.send(peer.unary(sid, "GetRounds", message))
        assert peer.trailers(sid)["grpc-status"] == status


def test_an_upload_meta_of_the_limit_is_taken_and_one_byte_more_is_refused(start) -> None:
    address, service, _ = start(GrpcLimits(max_meta_message=64))
    peer = Peer(address)
    for sid, extra, status in ((1, 0, "0"), (3, 1, str(GRPC_STATUS["INVALID_ARGUMENT"]))):
        base = pb.UpdateMeta(job="j", client="", samples=1, size=3)
        meta = pb.UpdateMeta(job="j", client="c" * (64 - len(base.SerializeToString()) - 2 + extra), samples=1, size=3)
        assert len(meta.SerializeToString()) == 64 + extra
        stream = b"".join(bytes(p) for m in chunk_messages(meta.SerializeToString(), b"abc", 3) for p in m)
        peer.send(peer.request(sid, "PushUpdate"), h2.data_frame(sid, stream, end_stream=True))
        assert peer.trailers(sid)["grpc-status"] == status
    assert len(service.ingests) == 1


# -- concurrent streams, and streams that end early ----------------------------------------------------------
def test_streams_past_the_concurrent_limit_are_refused(start) -> None:
    address, _, _ = start(http2=h2.Limits(max_concurrent_streams=4))
    peer = Peer(address)
    peer.send(*(peer.request(sid, "PushUpdate") for sid in (1, 3, 5, 7, 9)))
    assert peer.rst_code(9) == h2.REFUSED_STREAM
    peer.send(h2.rst_stream_frame(1, h2.CANCEL))
    assert peer.rounds_call(11)["grpc-status"] == "0"


def test_streams_cancelled_before_their_end_are_forgotten(start) -> None:
    """Once, 128 such streams made a connection refuse every new one."""
    address, service, _ = start()
    peer = Peer(address)
    for sid in range(1, 601, 2):
        peer.send(peer.request(sid, "PushUpdate"), h2.data_frame(sid, push_meta(100)), h2.rst_stream_frame(sid, h2.CANCEL))
    assert peer.rounds_call(601)["grpc-status"] == "0"
    assert len(service.ingests) == 300 and all(i.aborted.is_set() for i in service.ingests)


# -- floods: the limit within a period is fine, one more ends the connection ----------------------------------
# each builds one frame of a flood; ``sid``: a new stream it may open
def flood_settings(peer: Peer, sid: int) -> bytes:
    return h2.settings_frame([(h2.HEADER_TABLE_SIZE, 4096)])


def flood_pings(peer: Peer, sid: int) -> bytes:
    return h2.ping_frame(struct.pack(">Q", sid))


def flood_empty(peer: Peer, sid: int) -> bytes:
    return h2.data_frame(1, b"")


def flood_resets(peer: Peer, sid: int) -> bytes:
    return peer.request(sid, "PushUpdate") + h2.rst_stream_frame(sid, h2.CANCEL)


def flood_continuations(peer: Peer, sid: int) -> bytes:
    block = peer.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", SERVICE + "GetRounds"),
                                 (":authority", "gw"), ("content-type", "application/grpc")])
    return (h2.headers_frame(sid, block[:1], end_headers=False) + h2.continuation_frame(sid, block[1:])
            + h2.rst_stream_frame(sid, h2.CANCEL))


FLOODS = [
    ("max_settings", flood_settings, 1),  # the opening SETTINGS counts
    ("max_pings", flood_pings, 0),
    ("max_empty_frames", flood_empty, 0),
    ("max_resets", flood_resets, 0),
    ("max_continuations", flood_continuations, 0),
]


@pytest.mark.parametrize("limit_name,frame,already", FLOODS, ids=[c[0] for c in FLOODS])
def test_floods_end_the_connection(start, limit_name: str, frame, already: int) -> None:
    limit = 20
    limits = {"max_settings": 1000, "max_pings": 1000, "max_empty_frames": 1000, "max_resets": 1000,
              "max_continuations": 1000, limit_name: limit}
    address, _, _ = start(http2=h2.Limits(flood_period=FOREVER, **limits))
    peer = Peer(address)
    peer.send(peer.request(1, "PushUpdate"))  # a stream for the empty DATA frames
    sids = iter(range(3, 1000, 2))
    peer.send(*(frame(peer, next(sids)) for _ in range(already, limit)))
    assert peer.rounds_call(next(sids))["grpc-status"] == "0"  # still served
    peer.send(frame(peer, next(sids)))
    assert peer.goaway_code() == h2.ENHANCE_YOUR_CALM


# -- time: idle connections, stalled peers, downloads without credit ------------------------------------------
PING_FOREVER = h2.Limits(max_pings=10**9)  # for clients that ping without pause


def test_an_idle_connection_is_closed_with_goaway_however_much_it_pings(start) -> None:
    address, service, _ = start(connections=ConnectionLimits(idle_timeout=1.0), http2=PING_FOREVER)
    peer = Peer(address)
    peer.send(peer.request(1, "PushUpdate"), h2.data_frame(1, push_meta(100)))  # an upload that stops
    for i in range(10**7):
        peer.send(h2.ping_frame(struct.pack(">Q", i)))
        header, payload = peer.next_frame() or (None, b"")
        while header is not None and header.type not in (h2.PING, h2.GOAWAY):
            header, payload = peer.next_frame() or (None, b"")
        if header is None or header.type == h2.GOAWAY:
            break
    assert header is not None and header.type == h2.GOAWAY and struct.unpack_from(">I", payload, 4)[0] == h2.NO_ERROR
    assert service.ingests[0].aborted.wait(60)  # its round slot is given back


def test_a_peer_that_stalls_inside_a_frame_ends_its_connection_and_uploads(start) -> None:
    address, service, _ = start(connections=ConnectionLimits(idle_timeout=1.0))
    peer = Peer(address)
    peer.send(peer.request(1, "PushUpdate"), h2.data_frame(1, push_meta(100)), h2.frame_header(50, h2.DATA, 0, 1), b"12345")
    assert peer.goaway_code() == h2.NO_ERROR
    assert service.ingests[0].aborted.wait(60)


def test_the_upload_client_reconnects_after_an_idle_goaway(start) -> None:
    address, service, server = start(connections=ConnectionLimits(idle_timeout=3.0))  # a call's frames come well within it
    conn = UploadConnection(address)
    meta = pb.UpdateMeta(job="j", client="c", samples=1, size=3).SerializeToString()
    try:
        assert pb.PushUpdateReply.FromString(conn.call(SERVICE + "PushUpdate", chunk_messages(meta, b"abc", 2))).version == 0
        wait_for(lambda: server.connections == 0, timeout=60, what="the idle connection to be closed")
        assert pb.PushUpdateReply.FromString(conn.call(SERVICE + "PushUpdate", chunk_messages(meta, b"xyz", 2))).version == 0
    finally:
        conn.close()
    assert [bytes(i.sink.data) for i in service.ingests] == [b"abc", b"xyz"]


def test_a_download_without_flow_control_credit_is_reset_after_the_send_timeout(start) -> None:
    address, service, _ = start(GrpcLimits(send_timeout=1.0), http2=PING_FOREVER)
    peer = Peer(address, [(h2.INITIAL_WINDOW_SIZE, 0)])
    peer.send(peer.unary(1, "GetModel", pb.GetModelRequest(job="j").SerializeToString()))
    reset = None
    for i in range(10**7):  # PINGs keep the socket busy, not the download
        peer.send(h2.ping_frame(struct.pack(">Q", i)))
        header, payload = peer.until(lambda hd, p: hd.type in (h2.PING, h2.RST_STREAM))
        if header.type == h2.RST_STREAM:
            reset = struct.unpack(">I", payload)[0]
            break
    assert reset == h2.CANCEL
    wait_for(lambda: service.released == 1, timeout=60, what="the model view to be released")


def test_a_download_with_credit_completes(start) -> None:
    address, service, _ = start()
    peer = Peer(address, [(h2.INITIAL_WINDOW_SIZE, 100)])
    peer.send(peer.unary(1, "GetModel", pb.GetModelRequest(job="j").SerializeToString()))
    body = b""
    while True:
        header, payload = peer.until(lambda hd, p: hd.stream_id == 1 and hd.type in (h2.DATA, h2.HEADERS))
        if header.type == h2.DATA:
            body += payload
            peer.send(h2.window_update_frame(1, len(payload)))
        elif header.flags & h2.END_STREAM:
            assert dict(payload)["grpc-status"] == "0"
            break
    assert service.model in body


# -- downloads and threads ---------------------------------------------------------------------------------------
def get_model(peer: Peer, sid: int) -> bytes:
    return peer.unary(sid, "GetModel", pb.GetModelRequest(job="j").SerializeToString())


def test_downloads_are_capped_per_connection_and_in_all(start) -> None:
    address, service, _ = start(GrpcLimits(max_downloads_per_connection=2, max_downloads=3, send_timeout=FOREVER))
    first, second = Peer(address, [(h2.INITIAL_WINDOW_SIZE, 0)]), Peer(address, [(h2.INITIAL_WINDOW_SIZE, 0)])
    first.send(get_model(first, 1), get_model(first, 3))  # at the connection's limit: both wait for credit
    first.until(lambda hd, p: hd.type == h2.HEADERS and hd.stream_id == 3)
    first.send(get_model(first, 5))
    refused = first.trailers(5)
    assert (refused["grpc-status"], refused["lifl-error-code"]) == (str(GRPC_STATUS["RESOURCE_EXHAUSTED"]), "too_many_downloads")
    assert int(refused["grpc-retry-pushback-ms"]) > 0
    second.send(get_model(second, 1))  # the server's last slot
    second.until(lambda hd, p: hd.type == h2.HEADERS and hd.stream_id == 1)
    second.send(get_model(second, 3))
    assert second.trailers(3)["lifl-error-code"] == "too_many_downloads"
    first.send(h2.rst_stream_frame(1, h2.CANCEL))  # a download ends: its slot is free again
    wait_for(lambda: service.released == 1, timeout=60, what="the cancelled download to end")
    second.send(get_model(second, 5))
    second.until(lambda hd, p: hd.type == h2.HEADERS and hd.stream_id == 5 and not hd.flags & h2.END_STREAM)


def test_replies_waiting_for_credit_take_no_thread(start) -> None:
    address, _, _ = start()
    peer = Peer(address, [(h2.INITIAL_WINDOW_SIZE, 0)])
    peer.until(lambda hd, p: hd.type == h2.SETTINGS)  # the connection's thread is running
    before = threading.active_count()
    sids = range(1, 81, 2)
    peer.send(*(peer.unary(sid, "GetRounds", pb.GetRoundsRequest(job="ok").SerializeToString()) for sid in sids))
    for sid in sids:
        peer.until(lambda hd, p: hd.type == h2.HEADERS and hd.stream_id == sid)  # answered, the message waiting
    assert threading.active_count() <= before
    peer.send(h2.settings_frame([(h2.INITIAL_WINDOW_SIZE, 65535)]))
    assert all(peer.trailers(sid)["grpc-status"] == "0" for sid in sids)


# -- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("job", ["boom", "agent-gone"])
def test_an_unexpected_error_fails_only_its_call(start, job: str) -> None:
    address, _, _ = start()
    peer = Peer(address)
    peer.send(peer.request(1, "PushUpdate"))  # another call in progress on the connection
    failed = peer.rounds_call(3, job)
    assert failed["grpc-status"] == str(GRPC_STATUS["INTERNAL"]) and failed["lifl-error-code"] == "internal"
    assert peer.rounds_call(5)["grpc-status"] == "0"


def test_unavailable_is_grpc_unavailable_with_pushback(start) -> None:
    address, _, _ = start()
    trailers = Peer(address).rounds_call(1, "redis-down")
    assert trailers["grpc-status"] == str(GRPC_STATUS["UNAVAILABLE"]) and trailers["lifl-error-code"] == "unavailable"
    assert trailers["grpc-retry-pushback-ms"] == "2500"


def test_a_connection_over_the_limits_is_told_goaway(start) -> None:
    address, _, server = start(connections=ConnectionLimits(max_connections=1, max_per_peer=1, reserved=0))
    first = Peer(address)
    assert first.rounds_call(1)["grpc-status"] == "0"
    assert Peer(address).goaway_code() == h2.ENHANCE_YOUR_CALM
    assert first.rounds_call(3)["grpc-status"] == "0"
