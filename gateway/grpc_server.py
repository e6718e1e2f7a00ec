"""The gateway's gRPC API (lifl.proto) over lifl's own HTTP/2 codec (lifl.net.h2).

Why not grpcio's server: it assembles every message into a bytes object before the handler
sees it, so an update would be copied twice more on its way to shared memory, which measured
at 2.3-2.5x a raw socket's time here. This module is the codec's I/O shell on the gateway's
event loop: each connection is a state machine that reads a 9-byte frame header and lets the
codec validate it before a byte of the payload is read; a DATA payload then goes to the call's
``MessageReader``, which receives the bytes of each ``data`` field with ``recv_into`` straight
into the update's shared-memory object. Models are streamed back with ``sendmsg`` from shared
memory, within the client's flow-control windows.

No thread per connection or per call: unary calls run on the loop's pool and answer on the
loop; an upload's admission and hand-over are messages to the agent (the connection stops
reading, inside the upload's DATA frame, until the admission is answered); a reply that must
wait for flow-control credit waits in its call's outbox, and is sent when the credit arrives,
as a model download is (at most ``max_downloads_per_connection`` per connection and
``max_downloads`` in all). Every limit is in ``GrpcLimits``, the codec's ``h2.Limits`` and,
for connections and their idle timeout, lifl.net.limits.ConnectionLimits.

Errors: an HTTP/2 connection error ends the connection with GOAWAY; anything else that goes
wrong in one call (a lifl error, or any other exception) fails that call alone, with its gRPC
status. A peer that stalls (inside a frame for ``idle_timeout``, or idle that long) gets GOAWAY
and its connection ends; one that goes away ends it too, and every upload it had open is
aborted so that its round slot is released.

Scope: gRPC over HTTP/2 with prior knowledge, in cleartext (what gRPC clients do for
``insecure_channel``) or over TLS with ALPN ``h2`` (``--tls-cert``), identity encoding only, the
RPCs of lifl.v1.Gateway; any other HTTP/2 request is answered 415 (or 405) with a short text.
Every call is authenticated when it starts (its ``authorization`` metadata or the connection's
client certificate) and authorized by the service.
"""

from __future__ import annotations

import json
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lifl.auth import Principal
from lifl.errors import BadRequest, Internal, LiflError, Overloaded
from lifl.gateway.service import GatewayService, Ingest, ModelView
from lifl.gateway.stream import OPEN, READ_AHEAD, Conn, ConnectionProtocol, LoopServer, PeerGone, Wait
from lifl.jobs import stage_wait_params, version_wait_params
from lifl.net import h2
from lifl.net import lifl_pb2 as pb
from lifl.net.grpc import CONTENT_TYPE, BlobTarget, MessageReader, chunk_messages, message_prefix, status_trailers
from lifl.net.io import MAX_FRAMES_PER_WRITE, take_views
from lifl.net.limits import ConnectionLimits
from lifl.net.loop import IO_POOL, SLOW_POOL

SERVICE = "/lifl.v1.Gateway/"
UNARY = ("CreateJob", "ListJobs", "GetJob", "WaitForVersion", "GetModel", "TakeLease", "Heartbeat", "ReleaseLease", "GetRounds", "GetAssignment",
         "CreateToken", "ListTokens", "RevokeToken", "Query", "GetRetention", "SetRetention",
         "GetQuota", "SetQuota", "Secure")
SLOW_UNARY = ("Query",)  # on the slow pool
BLOB_UPLOADS = ("SetModel", "PushUpdate")
MODEL_CHUNK = 1 << 20  # data bytes per ModelChunk message of a download
DISCARD_CHUNK = 1 << 16  # dropped payload bytes (refused streams, padding) are read this many at a time
FRAMES_PER_TURN = 64  # frames read from one connection before the loop turns to others
WRITE_HIGH_WATER = 1 << 20  # bytes queued on a connection's socket before calls' outboxes wait for it to drain

# The limits' defaults (see GrpcLimits)
MAX_UNARY_MESSAGE = 1 << 20
MAX_META_MESSAGE = 64 << 10
SEND_TIMEOUT = 60.0
MAX_DOWNLOADS_PER_CONNECTION = 8
MAX_DOWNLOADS = 256
DOWNLOAD_PUSHBACK = 1.0  # seconds a client refused a download slot is asked to wait
GOAWAY_TIMEOUT = 1.0  # seconds the last GOAWAY of a connection may take to write (best effort)
GOODBYE = (h2.NO_ERROR, "the client said goodbye")  # our GOAWAY once a client's GOAWAY leaves no call open

RESPONSE_HEADERS = [(":status", "200"), ("content-type", CONTENT_TYPE), ("grpc-accept-encoding", "identity")]
OK_TRAILERS = [("grpc-status", "0")]
NOT_GRPC = b"This is lifl's gRPC endpoint (lifl.v1.Gateway): send gRPC requests (POST, content-type application/grpc).\n"


@dataclass(frozen=True)
class GrpcLimits:
    http2: h2.Limits = field(default_factory=h2.Limits)  # frames, header lists, streams, windows, floods
    max_unary_message: int = MAX_UNARY_MESSAGE  # bytes of a unary request
    max_meta_message: int = MAX_META_MESSAGE  # bytes of an upload's meta
    send_timeout: float = SEND_TIMEOUT  # seconds a download may wait for flow-control credit before it is reset
    max_downloads_per_connection: int = MAX_DOWNLOADS_PER_CONNECTION  # downloads in progress on one connection
    max_downloads: int = MAX_DOWNLOADS  # downloads in progress on the server

    def __post_init__(self) -> None:
        if min(self.max_unary_message, self.max_meta_message, self.max_downloads_per_connection, self.max_downloads) < 1 \
                or not self.send_timeout > 0:
            raise ValueError("gRPC limits must be positive")


class FrameSource:
    """The unread payload of the current frame (a lifl.net.grpc.PayloadSource): small reads
    through the connection's read-ahead buffer, bulk ones straight into the caller's memory.
    Wait (or PeerGone) when its bytes have not come."""

    def __init__(self, conn: Conn, length: int) -> None:
        self._conn = conn
        self.left = length

    def take(self, limit: int) -> bytes:
        n = self._buffered(limit)
        self.left -= n
        return self._conn.take(n)

    def peek(self, limit: int) -> bytes:
        return bytes(self._conn.inbuf[: self._buffered(limit)])

    def _buffered(self, limit: int) -> int:
        """How many of the next ``limit`` bytes are in the read-ahead buffer (at least one: it
        reads if there are none)."""
        conn = self._conn
        if not conn.inbuf:
            conn.fill(min(READ_AHEAD, self.left))
        return min(limit, self.left, len(conn.inbuf))

    def readinto(self, view: memoryview) -> int:
        n = self._conn.read_into(view[: self.left])
        self.left -= n
        return n

    def skip(self) -> None:
        conn = self._conn
        while self.left:
            if not conn.inbuf:
                conn.fill(min(self.left, DISCARD_CHUNK))
            n = min(self.left, len(conn.inbuf))
            del conn.inbuf[:n]
            self.left -= n


class Call:
    """The server side of one stream."""

    def __init__(self, stream_id: int, method: str) -> None:
        self.stream_id = stream_id
        self.method = method
        self.caller: Principal | None = None  # authenticated when the call starts
        self.identified = False  # the caller is known (or the call failed)
        self.reader: MessageReader | None = None  # None: not a gRPC call; its request body is dropped
        self.plain_status = ""  # the HTTP status of a request that is not a gRPC call...
        self.plain_body = b""  # ...and the text that says so
        self.meta: bytes | None = None  # an upload's meta, waiting for its caller to be known
        self.ingest: Ingest | None = None  # an upload in progress
        self.view: ModelView | None = None  # a download's model
        self.download = False  # holds a download slot
        self.ended = False  # the client finished sending (END_STREAM)
        self.completing = False  # the request is complete and being answered
        self.headers_sent = False
        self.outbox: deque[memoryview] = deque()  # response DATA waiting for flow-control credit
        self.trailers: list[tuple[str, str]] | None = None  # sent after the outbox; None: END_STREAM on the last DATA
        self.progress = 0.0  # when its outbox last moved (a download without credit is reset after send_timeout)
        self.answered = False  # the response went out in full
        self.finished = False  # answered in full, or reset
        self.failing = False  # its upload is being given back before the error is sent

    @property
    def receiving(self) -> bool:
        """Whether its request's bytes are still wanted."""
        return not (self.finished or self.failing)


class GrpcConnection(ConnectionProtocol):
    """One HTTP/2 connection's state machine, on the loop: ``_step`` reads the next piece of
    the frame being received (the preface, a frame header, a payload, a DATA payload into its
    call, padding); calls answer as their work completes, in any order."""

    def __init__(self, server: GrpcServer, conn: Conn) -> None:
        self.server = server
        self.service = server.service
        self.conn = conn
        self.limits = server.grpc_limits
        self.idle_timeout = conn.limits.idle_timeout
        self.h2 = h2.Connection(h2.Side.SERVER, self.limits.http2)
        self.calls: dict[int, Call] = {}
        self._downloads = 0
        self._serving = 0  # calls whose work is on the pool or with the agent (the connection is not idle)
        self._step: Callable[[], None] = self._read_preface
        self._frame: h2.FrameHeader | None = None
        self._payload = b""
        self._source: FrameSource | None = None  # the payload (or padding) being read
        self._data: h2.DataFrame | None = None
        self._data_call: Call | None = None
        self._waiting_for: Call | None = None  # reading stopped until this call's blob takes bytes again
        self._pump_queued = False
        self._closing = False
        conn.set_phase(OPEN)
        conn.start_reading()

    # -- the connection's events ----------------------------------------------------------------
    def readable(self) -> None:
        try:
            for _ in range(FRAMES_PER_TURN):
                if self._closing or self._waiting_for is not None:
                    break
                self._step()
            else:
                self.conn.start_reading(at_once=True)  # the rest after the others' turn
        except Wait:
            pass
        except PeerGone:
            self._shutdown(None)
            return
        except h2.H2ConnectionError as e:
            self._shutdown((e.code, str(e)))
            return
        except Exception as e:  # a bug outside any call's work: this connection cannot go on
            traceback.print_exc()
            self._shutdown((h2.INTERNAL_ERROR, f"internal error ({type(e).__name__})"))
            return
        self._flush()

    def check(self, now: float) -> None:
        """Stalls and idleness (every TIMER_RESOLUTION s), and downloads without credit."""
        if self._closing:
            return
        inside_frame = self._step != self._read_frame_header or bool(self.conn.inbuf)
        if inside_frame and self._waiting_for is None and now - self.conn.last_byte >= self.idle_timeout:
            self._shutdown((h2.NO_ERROR, f"closing a stalled connection: no byte for {self.idle_timeout:g} s inside a frame"))
            return
        if not inside_frame and not self._serving and self.h2.idle_for > self.idle_timeout:
            # PINGs or other chatter keep a socket busy, not a connection
            self._shutdown((h2.NO_ERROR, f"idle for {self.idle_timeout:g} s"))
            return
        for call in list(self.calls.values()):
            if call.download and call.outbox and not call.finished and now - call.progress > self.limits.send_timeout:
                try:
                    starved = self.h2.send_window(call.stream_id) <= 0
                except h2.StreamClosedError:
                    continue
                if starved:
                    self._reset(call, h2.CANCEL)

    def closed(self) -> None:
        self._closing = True
        for call in list(self.calls.values()):
            self._finish(call, None)  # aborts an upload in progress: its round slot is released

    def _shutdown(self, goaway: tuple[int, str] | None) -> None:
        """End the connection: every call ends with it. With ``goaway`` it is sent after what is
        queued, and the connection lingers; without (the peer is gone) it closes at once."""
        if self._closing:
            return
        self._closing = True
        self.conn.pause_reading()
        for call in list(self.calls.values()):
            self._finish(call, None)
        if goaway is None:
            self.conn.close()
            return
        self.conn.write([self.h2.goaway(*goaway)])  # after what is queued, within GOAWAY_TIMEOUT
        self.conn.linger_when_sent(GOAWAY_TIMEOUT)

    # -- reading, a step at a time -------------------------------------------------------------------
    def _need(self, n: int) -> None:
        conn = self.conn
        while len(conn.inbuf) < n:
            conn.fill(max(READ_AHEAD, n - len(conn.inbuf)))

    def _read_preface(self) -> None:
        self._need(len(h2.PREFACE))
        self.h2.receive_preface(self.conn.take(len(h2.PREFACE)))
        self.h2.initiate()
        self._step = self._read_frame_header

    def _read_frame_header(self) -> None:
        self._need(h2.FRAME_HEADER_SIZE)
        header = self._frame = self.h2.receive_header(self.conn.take(h2.FRAME_HEADER_SIZE))
        if header.type != h2.DATA:
            self._step = self._read_payload
        elif header.flags & h2.PADDED:
            self._step = self._read_pad_length
        else:
            self._start_data(b"")

    def _read_payload(self) -> None:
        header = self._frame
        assert header is not None
        self._need(header.keep)
        self._payload = self.conn.take(header.keep) if header.keep else b""
        self._source = FrameSource(self.conn, header.length - header.keep)
        self._step = self._end_payload

    def _end_payload(self) -> None:
        assert self._source is not None and self._frame is not None
        self._source.skip()
        self._step = self._read_frame_header
        self._handle(self.h2.receive_frame(self._frame, self._payload))

    def _read_pad_length(self) -> None:
        self._need(1)
        self._start_data(self.conn.take(1))

    def _start_data(self, pad_length: bytes) -> None:
        assert self._frame is not None
        frame = self._data = self.h2.receive_data(self._frame, pad_length)
        if frame.reset is not None:
            self._on_reset(frame.reset)
        self._data_call = self.calls.get(frame.stream_id) if frame.accepted else None
        self._source = FrameSource(self.conn, frame.size)
        self._step = self._feed_data

    def _feed_data(self) -> None:
        call, source = self._data_call, self._source
        assert source is not None and self._data is not None
        if call is not None and call.reader is not None and call.receiving:
            reader = call.reader
            self._guarded(call, lambda: reader.feed(source))
            if source.left and reader.waiting and call.receiving:
                self._waiting_for = call  # its blob is being opened or admitted: readable() stops
                self.conn.pause_reading()
                return
        source.skip()  # what a refused, failed or non-gRPC call leaves unread
        self._source = FrameSource(self.conn, self._data.padding)
        self._step = self._end_data

    def _end_data(self) -> None:
        assert self._source is not None and self._data is not None
        self._source.skip()
        self._step = self._read_frame_header
        call = self._data_call
        if call is not None and self._data.end_stream and call.receiving:
            self._end_of_request(call)

    def _resume(self, call: Call) -> None:
        """``call``'s blob may take bytes again (or ``call`` ended): go on reading."""
        if self._waiting_for is call and not self._closing:
            self._waiting_for = None
            self.conn.start_reading(at_once=True)

    def _handle(self, events: list[h2.Event]) -> None:
        for ev in events:
            if isinstance(ev, h2.HeadersReceived):
                if not ev.trailers:
                    self._on_request(ev)
                elif ev.stream_id in self.calls:
                    self._end_of_request(self.calls[ev.stream_id])  # trailers end the request; lifl uses none
            elif isinstance(ev, h2.StreamReset):
                self._on_reset(ev)
            elif isinstance(ev, (h2.WindowUpdated, h2.SettingsReceived)):
                self._pump()
        if self.h2.goaway_received and not self.calls:  # the client said goodbye and its calls are done
            self._shutdown(GOODBYE)

    def _on_reset(self, ev: h2.StreamReset) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            self._finish(call, None if ev.by_peer else BadRequest(ev.reason, code="protocol_error"))

    # -- calls -----------------------------------------------------------------------------------------
    def _on_request(self, ev: h2.HeadersReceived) -> None:
        headers = dict(ev.headers)
        path = headers.get(":path", "")
        call = Call(ev.stream_id, path[len(SERVICE):] if path.startswith(SERVICE) else "")
        self.calls[call.stream_id] = call
        if not headers.get("content-type", "").startswith(CONTENT_TYPE) or headers.get(":method") != "POST":
            call.plain_status = "405" if headers.get("content-type", "").startswith(CONTENT_TYPE) else "415"
            call.plain_body = b"" if headers.get(":method") == "HEAD" else NOT_GRPC
        else:
            self._guarded(call, lambda: self._start_call(call, headers))
        if ev.end_stream and call.receiving:
            self._end_of_request(call)

    def _start_call(self, call: Call, headers: dict[str, str]) -> None:
        if headers.get("grpc-encoding", "identity") != "identity":
            raise LiflError("only identity encoding is supported", code="unsupported_encoding", grpc_status="UNIMPLEMENTED")
        if call.method not in BLOB_UPLOADS and call.method not in UNARY:
            raise LiflError(f"unknown method {headers.get(':path')}", code="unimplemented", grpc_status="UNIMPLEMENTED")
        limits = self.limits
        if call.method in BLOB_UPLOADS:
            call.reader = MessageReader(lambda meta: self._open_blob(call, meta), max_unary=limits.max_unary_message,
                                        max_meta=limits.max_meta_message)
        else:
            call.reader = MessageReader(None, max_unary=limits.max_unary_message, max_meta=limits.max_meta_message)
        self.service.identify(headers.get("authorization"), self.conn.peer_certificate, self.conn.peer,
                              lambda caller, error: self._identified(call, caller, error))

    def _identified(self, call: Call, caller: Principal | None, error: BaseException | None) -> None:
        if not call.receiving:
            return
        if error is not None:
            self._failed(call, error)
            return
        call.caller, call.identified = caller, True
        if call.meta is not None:  # the upload's meta came first
            meta, call.meta = call.meta, None
            self._guarded(call, lambda: self._opened_later(call, self._begin_blob(call, meta)))
        self._maybe_complete(call)

    def _opened_later(self, call: Call, sink: BlobTarget | None) -> None:
        """A blob opened after its meta was read (None: it is being opened still)."""
        if sink is not None and call.reader is not None and call.receiving:
            call.reader.opened(sink)
            self._resume(call)

    def _end_of_request(self, call: Call) -> None:
        if call.plain_status:
            self._respond_plain(call)
            return
        call.ended = True
        self._maybe_complete(call)

    def _maybe_complete(self, call: Call) -> None:
        """Answer the call once its request is complete: its caller known, its blob open and
        past its admission."""
        reader = call.reader
        if not call.ended or call.completing or not call.receiving or not call.identified or reader is None:
            return
        if reader.opening or (call.ingest is not None and not call.ingest.sink.ready):
            return
        call.completing = True
        self._guarded(call, lambda: self._complete(call))

    def _guarded(self, call: Call, action: Callable[[], None]) -> None:
        """Run one call's work; whatever goes wrong in it fails that call only."""
        try:
            action()
        except (Wait, PeerGone, h2.H2ConnectionError):
            raise
        except Exception as e:
            self._failed(call, e)

    def _failed(self, call: Call, error: BaseException) -> None:
        if isinstance(error, LiflError):
            self._fail(call, error)
            return
        if "DecodeError" in type(error).__name__:  # protobuf: a malformed request message
            self._fail(call, BadRequest(f"bad request message: {error}"))
            return
        traceback.print_exception(error)
        self._fail(call, Internal(f"{type(error).__name__}: {error}"))

    # -- uploads ---------------------------------------------------------------------------------------
    def _open_blob(self, call: Call, meta: bytes) -> BlobTarget | None:
        """The reader's meta came: open the upload (now, if the caller is known and the job
        cached; else once they are: None)."""
        if not call.identified:
            call.meta = meta
            return None
        return self._begin_blob(call, meta)

    def _begin_blob(self, call: Call, meta_bytes: bytes) -> BlobTarget | None:
        assert call.caller is not None
        opened: list[Ingest] = []
        answered_now = True

        def begun(ingest: Ingest | None, error: BaseException | None) -> None:
            if answered_now and error is not None:
                raise error  # within _begin_blob: the call's error, as if raised by it
            if error is not None:
                if call.receiving:
                    self._failed(call, error)
                return
            assert ingest is not None
            if not call.receiving or self._closing:
                ingest.abort(None)
                return
            call.ingest = ingest
            ingest.on_ready = lambda error: self._blob_ready(call, ingest, error)
            opened.append(ingest)
            if not answered_now:
                assert call.reader is not None
                call.reader.opened(ingest.sink)
                self._resume(call)
                self._maybe_complete(call)

        try:
            meta = (pb.UpdateMeta if call.method == "PushUpdate" else pb.ModelMeta).FromString(meta_bytes)
        except Exception as e:  # protobuf decode errors
            raise BadRequest(f"bad meta message: {e}") from None
        try:
            if isinstance(meta, pb.UpdateMeta):
                fields = {"client": meta.client, "samples": meta.samples, "base_version": meta.base_version,
                          "lease": meta.lease}
                self.service.begin_update(call.caller, meta.job, fields, "grpc", meta.size or None, begun)
            else:
                self.service.begin_model(call.caller, meta.job, "grpc", meta.size or None, begun)
        finally:
            answered_now = False
        return opened[0].sink if opened else None

    def _blob_ready(self, call: Call, ingest: Ingest, error: LiflError | None) -> None:
        """The agent answered the blob's admission."""
        if call.ingest is not ingest or not call.receiving:
            return
        if error is not None:
            self._fail(call, error)
        else:
            self._resume(call)
            self._maybe_complete(call)

    def _complete(self, call: Call) -> None:
        """The client finished sending: run the call and answer."""
        reader = call.reader
        assert reader is not None and call.caller is not None
        if not reader.at_message_boundary:
            raise BadRequest("the stream ended inside a message", code="truncated")
        if call.method in BLOB_UPLOADS:
            ingest = call.ingest
            if reader.sink is None or ingest is None:
                raise BadRequest("the stream ended before any meta was sent", code="missing_meta")
            self._serving += 1
            try:
                ingest.finish(lambda result, error: self._finished_blob(call, ingest, result, error))
            except BaseException:
                self._serving -= 1
                raise
            return
        if reader.messages != 1:
            raise BadRequest("a unary request must be exactly one message")
        request = bytes(reader.unary)
        if call.method == "GetModel":
            try:
                job = pb.GetModelRequest.FromString(request).job
            except Exception as e:
                raise BadRequest(f"bad request message: {e}") from None
            self._start_download(call, job)
            return
        caller, method = call.caller, call.method
        if method == "WaitForVersion":
            self._wait_for_version(call, caller, pb.WaitForVersionRequest.FromString(request))
            return
        if method == "Secure":
            try:
                secure = pb.SecureRequest.FromString(request)
            except Exception as e:
                raise BadRequest(f"bad request message: {e}") from None
            if secure.call == "status":
                self._secure_status(call, caller, secure)
            else:
                self._secure_message(call, caller, secure)
            return
        self._serving += 1
        pool = SLOW_POOL if method in SLOW_UNARY else IO_POOL
        self.server.loop.offload(lambda: self._unary(caller, method, request).SerializeToString(),
                                 lambda reply, error: self._answered(call, reply, error), pool)

    def _wait_for_version(self, call: Call, caller: Principal, req: Any) -> None:
        after, wait_s = version_wait_params(req.after, req.wait_s)

        def answered(view: dict[str, Any] | None, error: BaseException | None) -> None:
            reply = None if view is None else pb.JobVersion(
                job=view["job"], tenant=view["tenant"], version=_optional(view["version"]),
                round=_optional(view["round"]["id"]), closed=view["round"]["closed"]).SerializeToString()
            self._answered(call, reply, error)

        self._serving += 1
        try:
            self.service.wait_for_version(caller, req.job, after, wait_s, answered)
        except BaseException:
            self._serving -= 1
            raise

    def _secure_status(self, call: Call, caller: Principal, req: Any) -> None:
        """A secure round's status: ``body_json`` may hold ``round``, ``after`` and ``wait_s`` (a long poll)."""
        body = _json_field(req.body_json or "{}", "body_json")
        if not isinstance(body, dict) or sorted(set(body) - {"round", "after", "wait_s"}):
            raise BadRequest("a secure status body is a JSON object of round, after and wait_s", code="bad_stage_wait")
        after, wait_s = stage_wait_params(body.get("round"), body.get("after"), body.get("wait_s", 0))

        def answered(view: dict[str, Any] | None, error: BaseException | None) -> None:
            self._answered(call, None if view is None else _json_reply(view).SerializeToString(), error)

        self._serving += 1
        try:
            self.service.secure_status(caller, req.job, req.client or None, after, wait_s, answered)
        except BaseException:
            self._serving -= 1
            raise

    def _secure_message(self, call: Call, caller: Principal, req: Any) -> None:
        """A message for a stage of a secure round: ``body_json`` as HTTP's body (``wait_s`` in it
        too); ``client`` as the body's."""
        def body() -> Any:
            found = _json_field(req.body_json or "{}", "body_json")
            return {**found, "client": req.client} if isinstance(found, dict) and req.client else found

        def answered(view: dict[str, Any] | None, error: BaseException | None) -> None:
            self._answered(call, None if view is None else _json_reply(view).SerializeToString(), error)

        self._serving += 1
        try:
            self.service.secure_message(caller, req.job, req.call, body, answered)
        except BaseException:
            self._serving -= 1
            raise

    def _finished_blob(self, call: Call, ingest: Ingest, result: dict[str, Any] | None, error: BaseException | None) -> None:
        self._serving -= 1
        if call.ingest is ingest:
            call.ingest = None  # handed over: nothing to abort any more
        if call.finished or self._closing:
            return
        if error is not None:
            self._failed(call, error)
            return
        assert result is not None
        reply = pb.PushUpdateReply if call.method == "PushUpdate" else pb.SetModelReply
        self._reply(call, reply(version=result["version"]).SerializeToString())

    def _answered(self, call: Call, reply: bytes | None, error: BaseException | None) -> None:
        self._serving -= 1
        if call.finished or self._closing:
            return
        if error is not None:
            self._failed(call, error)
        else:
            assert reply is not None
            self._reply(call, reply)

    def _unary(self, caller: Principal, method: str, request: bytes) -> Any:
        """(On the pool.) A unary call's reply message."""
        service = self.service
        if method == "CreateJob":
            req = pb.CreateJobRequest.FromString(request)
            body: dict[str, Any] = {"job": req.job, "goal": req.goal}
            for name in ("tenant", "leaf_fan_in", "max_update_bytes", "max_inflight", "round_deadline_s", "min_updates",
                         "lease_ttl_s", "over_selection", "max_samples", "architecture"):
                if getattr(req, name):  # proto3: 0 or "" means "use the default"
                    body[name] = getattr(req, name)
            for name in ("retention", "strategy", "fixed_point", "secure_aggregation"):
                if text := getattr(req, f"{name}_json"):
                    body[name] = _json_field(text, f"{name}_json")
            return _job_status(service.create_job(caller, body))
        if method == "ListJobs":
            return pb.JobList(jobs=service.job_names(caller))
        if method == "Query":
            req = pb.QueryRequest.FromString(request)
            return _json_reply(service.query(caller, req.job, _json_field(req.query_json, "query_json")))
        if method == "GetRetention":
            return _json_reply(service.retention(caller, pb.GetRetentionRequest.FromString(request).job))
        if method == "SetRetention":
            req = pb.SetRetentionRequest.FromString(request)
            return _json_reply(service.set_retention(caller, req.job, _json_field(req.policy_json, "policy_json")))
        if method == "GetQuota":
            return _json_reply(service.quota(caller, pb.GetQuotaRequest.FromString(request).tenant))
        if method == "SetQuota":
            req = pb.SetQuotaRequest.FromString(request)
            if not req.quota_json:
                raise BadRequest("quota_json is required: a quota object, or null for the defaults", code="bad_quota")
            quota = _json_field(req.quota_json, "quota_json")
            return _json_reply(service.reset_quota(caller, req.tenant) if quota is None
                               else service.set_quota(caller, req.tenant, quota))
        if method == "GetJob":
            return _job_status(service.job_status(caller, pb.GetJobRequest.FromString(request).job))
        if method == "TakeLease":
            req = pb.TakeLeaseRequest.FromString(request)
            return pb.Lease(**service.take_lease(caller, req.job, req.client))
        if method == "Heartbeat":
            req = pb.LeaseRequest.FromString(request)
            return pb.Lease(**service.heartbeat(caller, req.job, req.lease))
        if method == "ReleaseLease":
            req = pb.LeaseRequest.FromString(request)
            service.release_lease(caller, req.job, req.lease)
            return pb.Lease(lease=req.lease)
        if method == "GetAssignment":
            req = pb.AssignmentRequest.FromString(request)
            return pb.Assignment(**service.assignment(caller, req.job, req.client))
        if method == "CreateToken":
            req = pb.CreateTokenRequest.FromString(request)
            body = {"role": req.role, "tenant": req.tenant}
            for name in ("job", "client", "ttl_s"):
                if getattr(req, name):
                    body[name] = getattr(req, name)
            return pb.Token(**service.create_token(caller, body))
        if method == "ListTokens":
            return pb.TokenList(tokens=[pb.Token(**t) for t in service.list_tokens(caller)])
        if method == "RevokeToken":
            service.revoke_token(caller, pb.RevokeTokenRequest.FromString(request).id)
            return pb.RevokeTokenReply()
        req = pb.GetRoundsRequest.FromString(request)
        return pb.Rounds(rounds=[_last_round(r) for r in service.rounds(caller, req.job, req.limit or 100)])

    # -- downloads ---------------------------------------------------------------------------------------
    def _start_download(self, call: Call, job: str) -> None:
        server = self.server
        if self._downloads >= self.limits.max_downloads_per_connection or server.downloads >= self.limits.max_downloads:
            raise Overloaded("too many model downloads in progress", code="too_many_downloads", retry_after=DOWNLOAD_PUSHBACK)
        self._downloads += 1
        server.downloads += 1
        call.download = True
        self._serving += 1
        assert call.caller is not None
        self.service.open_model(call.caller, job, lambda view, error: self._model_opened(call, job, view, error))

    def _model_opened(self, call: Call, job: str, view: ModelView | None, error: BaseException | None) -> None:
        self._serving -= 1
        if error is not None:
            if not call.finished:
                self._failed(call, error)
            self._release_download(call)
            return
        assert view is not None
        if call.finished or self._closing:
            view.release()
            self._release_download(call)
            return
        call.view = view
        mm = self.service.mappings.map_fd(view.fd, writable=False)
        data = memoryview(mm)[: view.size]  # the model straight from shared memory
        meta = pb.ModelMeta(job=job, version=view.version, size=view.size).SerializeToString()
        self._send_headers(call, RESPONSE_HEADERS)
        call.outbox.extend(memoryview(p) for message in chunk_messages(meta, data, MODEL_CHUNK) for p in message)
        call.trailers = OK_TRAILERS
        call.progress = time.monotonic()
        self._pump()

    def _release_download(self, call: Call) -> None:
        if call.download:
            call.download = False
            self._downloads -= 1
            self.server.downloads -= 1

    # -- writing -------------------------------------------------------------------------------------------
    def _reply(self, call: Call, message: bytes) -> None:
        """Answer with one message and status OK; what the client's windows do not take now
        waits in the outbox for its WINDOW_UPDATE."""
        self._send_headers(call, RESPONSE_HEADERS)
        call.outbox.append(memoryview(message_prefix(len(message)) + message))
        call.trailers = OK_TRAILERS
        self._pump()

    def _respond_plain(self, call: Call) -> None:
        """A request that is not a gRPC call: an HTTP status and a short text saying so."""
        self._send_headers(call, [(":status", call.plain_status), ("content-type", "text/plain; charset=utf-8"),
                                  ("content-length", str(len(NOT_GRPC)))], end_stream=not call.plain_body)
        if not call.plain_body:
            self._finish(call, None)
            return
        call.outbox.append(memoryview(call.plain_body))
        self._pump()

    def _fail(self, call: Call, error: LiflError) -> None:
        """Answer with an error status (trailers only, if nothing was sent yet) and tell the
        client to stop sending (RST_STREAM NO_ERROR, if it had not finished); an upload in
        progress is given back first, so that a client told of the refusal finds its round
        slot free. The rest of the call's request is dropped meanwhile."""
        if call.finished or call.failing:
            return
        ingest, call.ingest = call.ingest, None
        if ingest is not None:
            call.failing = True
            self._resume(call)
            ingest.abort(error, then=lambda: self._send_failure(call, error))
            return
        self._send_failure(call, error)

    def _send_failure(self, call: Call, error: LiflError) -> None:
        if not call.finished and not self._closing:
            head = [] if call.headers_sent else [(":status", "200"), ("content-type", CONTENT_TYPE)]
            call.outbox.clear()
            try:
                self.h2.send_headers(call.stream_id, head + status_trailers(error), end_stream=True)
                self.h2.reset_stream(call.stream_id, h2.NO_ERROR)
            except h2.StreamClosedError:
                pass  # reset meanwhile
            self._flush()
        self._finish(call, error)

    def _reset(self, call: Call, code: int) -> None:
        self.h2.reset_stream(call.stream_id, code)
        self._flush()
        self._finish(call, None)

    def _send_headers(self, call: Call, headers: list[tuple[str, str]], end_stream: bool = False) -> None:
        try:
            self.h2.send_headers(call.stream_id, headers, end_stream)
        except h2.StreamClosedError:
            return  # reset meanwhile: the call is finished by whoever saw the reset
        call.headers_sent = True
        self._flush()

    def _pump(self) -> None:
        """Move what flow control lets through from the calls' outboxes to the socket, while
        the socket's queue is short; the rest goes when credit comes or the queue drains."""
        if self._closing:
            return
        now = time.monotonic()
        for call in list(self.calls.values()):
            while call.outbox or call.trailers is not None:
                if self.conn.queued >= WRITE_HIGH_WATER:
                    self._pump_when_drained()
                    return
                step = self._next_frames(call)
                if step is None:
                    break
                parts, size, complete = step
                self.conn.write(parts)
                if size:
                    call.progress = now
                if complete:
                    call.answered = True
                    self._finish(call, None)
                    break

    def _pump_when_drained(self) -> None:
        if not self._pump_queued:
            self._pump_queued = True
            self.conn.write([], then=self._drained)

    def _drained(self) -> None:
        self._pump_queued = False
        self._pump()

    def _next_frames(self, call: Call) -> tuple[list[bytes | memoryview], int, bool] | None:
        """The call's next frames that flow control lets through: the parts to write, their
        DATA bytes, and whether they complete the response; None: wait."""
        if call.finished:
            return None
        try:
            if not call.outbox:
                if call.trailers is not None:
                    self.h2.send_headers(call.stream_id, call.trailers, end_stream=True)
                return [self.h2.data_to_send()], 0, True
            window = self.h2.send_window(call.stream_id)
            if window <= 0:
                return None
            parts: list[bytes | memoryview] = []
            size, frames, end = 0, 0, False
            while call.outbox and size < window and frames < MAX_FRAMES_PER_WRITE and not end:
                views = take_views(call.outbox, min(window - size, self.h2.peer_max_frame_size))
                n = sum(len(v) for v in views)
                end = not call.outbox and call.trailers is None
                parts += [self.h2.send_data(call.stream_id, n, end_stream=end), *views]
                size, frames = size + n, frames + 1
            return parts, size, end
        except h2.StreamClosedError:
            return [], 0, True  # reset meanwhile

    def _flush(self) -> None:
        """Send the frames the codec queued (our own, and its ACKs, WINDOW_UPDATEs, RST_STREAMs)."""
        if self.h2.has_data_to_send and not self._closing:
            self.conn.write([self.h2.data_to_send()])

    def _finish(self, call: Call, error: LiflError | None) -> None:
        """The call is over (answered, reset, or its connection ends): forget it, give back an
        upload's object if it was not handed over, and a download's model and slot."""
        call.finished = True
        call.outbox.clear()
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
        ingest, call.ingest = call.ingest, None
        if ingest is not None:
            ingest.abort(error)
        view, call.view = call.view, None
        if view is not None:
            if call.answered:
                self.service.metrics.bytes_out.labels("grpc").inc(view.size)
            view.release()
        self._release_download(call)  # a model still being opened is released when it comes
        self._resume(call)
        if self.h2.goaway_received and not self.calls and not self._closing:
            self._shutdown(GOODBYE)


def _optional(value: Any) -> int:
    return -1 if value is None else value


def _last_round(r: dict[str, Any]) -> pb.LastRound:
    return pb.LastRound(
        version=r["version"], updates=r["updates"], samples=r["samples"], seconds=r["seconds"] or 0.0,
        outcome=r["outcome"], round=r["round"], new_version=_optional(r["new_version"]), reason=r.get("reason", ""),
        nodes=r.get("nodes", {}), top=r.get("top") or "", lost=r.get("lost", {}),
    )


def _json_field(text: str, name: str) -> Any:
    try:
        return json.loads(text) if text else None
    except (ValueError, RecursionError):
        raise BadRequest(f"{name} is not valid JSON", code="bad_json") from None


def _json_reply(body: dict[str, Any]) -> pb.JsonReply:
    return pb.JsonReply(json=json.dumps(body))


def _job_status(status: dict[str, Any]) -> pb.JobStatus:
    rnd = status["round"]
    if "goal" not in status:  # a client's view: its version and round only
        return pb.JobStatus(job=status["job"], tenant=status["tenant"], version=_optional(status["version"]),
                            round=pb.RoundStatus(id=_optional(rnd["id"]), version=_optional(rnd["version"]),
                                                 closed=rnd["closed"]))
    out = pb.JobStatus(
        job=status["job"], tenant=status["tenant"], goal=status["goal"], leaf_fan_in=status["leaf_fan_in"],
        version=_optional(status["version"]), queued=status["queued"],
        round=pb.RoundStatus(
            version=_optional(rnd["version"]), received=rnd["received"], in_progress=rnd["in_progress"],
            aggregated=rnd["aggregated"], rejected=rnd["rejected"], id=_optional(rnd["id"]),
            opened_at=rnd["opened_at"] or 0.0, closed=rnd["closed"], leases=rnd["leases"],
            nodes=rnd["nodes"], top=rnd["top"] or "", lost=rnd["lost"],
        ),
        aggregators=status["aggregators"], strategy_json=json.dumps(status["strategy"], sort_keys=True),
    )
    if status.get("last_round"):
        out.last_round.CopyFrom(_last_round(status["last_round"]))
    return out


class GrpcServer(LoopServer):
    def __init__(self, service: GatewayService, host: str, port: int, limits: ConnectionLimits | None = None,
                 grpc_limits: GrpcLimits | None = None) -> None:
        super().__init__(service.loop, host, port, limits)
        self.service = service
        self.grpc_limits = grpc_limits or GrpcLimits()
        self.downloads = 0  # in progress, on every connection

    def protocol(self, conn: Conn) -> GrpcConnection:
        return GrpcConnection(self, conn)

    def refuse(self, sock: socket.socket) -> None:
        """Over the connection limits: say so in HTTP/2 before closing, so gRPC clients report it."""
        sock.send(h2.settings_frame() + h2.goaway_frame(0, h2.ENHANCE_YOUR_CALM, b"connection limit reached"))
