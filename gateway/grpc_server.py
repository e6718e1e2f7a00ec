"""The gateway's gRPC API (lifl.proto) over lifl's own HTTP/2 codec (lifl.net.h2).

Why not grpcio's server: it assembles every message into a bytes object before the handler
sees it, so an update would be copied twice more on its way to shared memory, which measured
at 2.3-2.5x a raw socket's time here. This module is the codec's I/O shell: a connection's
reader thread reads each 9-byte frame header and lets the codec validate it before a byte of
the payload is read; a DATA payload then goes to the call's ``MessageReader``, which receives
the bytes of each ``data`` field with ``recv_into`` straight into the update's shared-memory
object. Models are streamed back with ``sendmsg`` from shared memory, within the client's
flow-control windows.

Threads: the reader runs unary calls and answers them. A reply that must wait for flow-control
credit waits in its call's outbox and is sent by the reader when the credit arrives; a model
download is sent by a thread of its own, at most ``max_downloads_per_connection`` per
connection and ``max_downloads`` in all. Every limit is in ``GrpcLimits``, the codec's
``h2.Limits`` and, for connections and their idle timeout, lifl.net.limits.ConnectionLimits.

Errors: an HTTP/2 connection error ends the connection with GOAWAY; anything else that goes
wrong in one call (a lifl error, or any other exception) fails that call alone, with its gRPC
status. A peer that stalls (a read times out) or goes away ends the connection, and every
upload it had open is aborted so that its round slot is released.

Scope: gRPC over HTTP/2 with prior knowledge, in cleartext (what gRPC clients do for
``insecure_channel``) or over TLS with ALPN ``h2`` (``--tls-cert``), identity encoding only, the
RPCs of lifl.v1.Gateway; any other HTTP/2 request is answered 415 (or 405) with a short text.
Every call is authenticated when it starts (its ``authorization`` metadata or the connection's
client certificate) and authorized by the service.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from lifl.auth import Principal
from lifl.errors import BadRequest, Internal, LiflError, Overloaded
from lifl.net import lifl_pb2 as pb
from lifl.gateway.service import GatewayService, Ingest, ModelView
from lifl.gateway.stream import Stream, ThreadedServer
from lifl.net.limits import ConnectionLimits
from lifl.net import h2
from lifl.net.grpc import CONTENT_TYPE, BlobTarget, MessageReader, chunk_messages, message_prefix, status_trailers
from lifl.net.io import MAX_FRAMES_PER_WRITE, sendmsg_all, take_views

SERVICE = "/lifl.v1.Gateway/"
UNARY = ("CreateJob", "ListJobs", "GetJob", "GetModel", "TakeLease", "Heartbeat", "ReleaseLease", "GetRounds", "GetAssignment",
         "CreateToken", "ListTokens", "RevokeToken", "Query", "GetRetention", "SetRetention")
BLOB_UPLOADS = ("SetModel", "PushUpdate")
MODEL_CHUNK = 1 << 20  # data bytes per ModelChunk message of a download
DISCARD_CHUNK = 1 << 16  # dropped payload bytes (refused streams, padding) are read this many at a time

# The limits' defaults (see GrpcLimits)
MAX_UNARY_MESSAGE = 1 << 20
MAX_META_MESSAGE = 64 << 10
SEND_TIMEOUT = 60.0
MAX_DOWNLOADS_PER_CONNECTION = 8
MAX_DOWNLOADS = 256
DOWNLOAD_PUSHBACK = 1.0  # seconds a client refused a download slot is asked to wait
GOAWAY_TIMEOUT = 1.0  # seconds the last GOAWAY of a connection may take to write (best effort)

RESPONSE_HEADERS = [(":status", "200"), ("content-type", CONTENT_TYPE), ("grpc-accept-encoding", "identity")]
OK_TRAILERS = [("grpc-status", "0")]
NOT_GRPC = b"This is lifl's gRPC endpoint (lifl.v1.Gateway): send gRPC requests (POST, content-type application/grpc).\n"


@dataclass(frozen=True)
class GrpcLimits:
    http2: h2.Limits = field(default_factory=h2.Limits)  # frames, header lists, streams, windows, floods
    max_unary_message: int = MAX_UNARY_MESSAGE  # bytes of a unary request
    max_meta_message: int = MAX_META_MESSAGE  # bytes of an upload's meta
    send_timeout: float = SEND_TIMEOUT  # seconds a download may wait for flow-control credit before it is reset
    max_downloads_per_connection: int = MAX_DOWNLOADS_PER_CONNECTION  # download threads of one connection
    max_downloads: int = MAX_DOWNLOADS  # download threads of the server

    def __post_init__(self) -> None:
        if min(self.max_unary_message, self.max_meta_message, self.max_downloads_per_connection, self.max_downloads) < 1 \
                or not self.send_timeout > 0:
            raise ValueError("gRPC limits must be positive")


class PeerGone(Exception):
    """The connection's socket failed or the peer closed it. Socket errors are turned into this
    where they happen, so that a call's handler tells them from failures of its own."""


class PeerStalled(PeerGone):
    """A read timed out (idle, or slower than the connection's limits allow)."""


class FrameSource:
    """The unread payload of the current DATA frame (a lifl.net.grpc.PayloadSource)."""

    def __init__(self, stream: Stream, length: int) -> None:
        self._stream = stream
        self.left = length

    def take(self, limit: int) -> bytes:
        with _socket_errors():
            b = self._stream.read_some(min(limit, self.left))
        self.left -= len(b)
        return b

    def readinto(self, view: memoryview) -> int:
        with _socket_errors():
            n = self._stream.readinto(view[: self.left])
        if n == 0:
            raise PeerGone("connection closed inside a DATA frame")
        self.left -= n
        return n

    def skip(self) -> None:
        while self.left:
            self.take(min(self.left, DISCARD_CHUNK))


@contextmanager
def _socket_errors() -> Iterator[None]:
    """Turns a socket's failures into PeerStalled (timeouts) or PeerGone (the rest)."""
    try:
        yield
    except TimeoutError as e:
        raise PeerStalled(str(e)) from e
    except (OSError, EOFError) as e:
        raise PeerGone(str(e)) from e


class Call:
    """The server side of one stream."""

    def __init__(self, stream_id: int, method: str) -> None:
        self.stream_id = stream_id
        self.method = method
        self.caller: Principal | None = None  # authenticated when the call starts
        self.reader: MessageReader | None = None  # None: not a gRPC call; its request body is dropped
        self.plain_status = ""  # the HTTP status of a request that is not a gRPC call...
        self.plain_body = b""  # ...and the text that says so
        self.ingest: Ingest | None = None  # an upload in progress
        self.headers_sent = False
        self.outbox: deque[memoryview] = deque()  # response DATA waiting for flow-control credit
        self.trailers: list[tuple[str, str]] | None = None  # sent after the outbox; None: END_STREAM on the last DATA
        self.own_sender = False  # a download: its thread sends the outbox (others' wait for the reader)
        self.answered = False  # the response went out in full
        self.finished = False  # answered in full, or reset


class GrpcConnection:
    """One HTTP/2 connection: the reader loop, and the writes of every thread serving it.

    Locks: ``_write`` orders whole frames on the socket (and HPACK blocks in the order they were
    encoded); ``_state`` guards the codec and the calls. Always take ``_write`` first."""

    def __init__(self, sock: socket.socket, stream: Stream, service: GatewayService, limits: GrpcLimits,
                 download_slots: threading.BoundedSemaphore) -> None:
        self.sock = sock
        self.stream = stream
        self.service = service
        self.limits = limits
        self.idle_timeout = stream.limits.idle_timeout
        self.h2 = h2.Connection(h2.Side.SERVER, limits.http2)
        self.calls: dict[int, Call] = {}
        self._download_slots = download_slots
        self._downloads = 0
        self._write = threading.RLock()
        self._state = threading.Condition()
        self._closed = False

    # -- the connection ------------------------------------------------------------------------------
    def run(self) -> None:
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(self.idle_timeout)
        goaway: tuple[int, str] | None = None
        try:
            self.h2.receive_preface(self._read_exact(len(h2.PREFACE)))
            self.h2.initiate()
            self._flush()
            while not (self.h2.goaway_received and not self.calls):  # the client said goodbye: finish its calls
                self._read_frame()
                if self.h2.idle_for > self.idle_timeout:  # PINGs or other chatter keep a socket busy, not a connection
                    goaway = (h2.NO_ERROR, f"idle for {self.idle_timeout:g} s")
                    break
        except h2.H2ConnectionError as e:
            goaway = (e.code, str(e))
        except PeerStalled as e:
            goaway = (h2.NO_ERROR, f"closing a stalled connection: {e}")
        except PeerGone:
            pass
        finally:
            self._shutdown(goaway)

    def _shutdown(self, goaway: tuple[int, str] | None) -> None:
        with self._state:
            self._closed = True
            self._state.notify_all()
        if goaway is not None and self._write.acquire(timeout=GOAWAY_TIMEOUT):
            try:
                self.sock.settimeout(GOAWAY_TIMEOUT)
                with self._state:
                    last = self.h2.goaway(*goaway)
                sendmsg_all(self.sock, [last])
            except OSError:
                pass
            finally:
                self._write.release()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a download blocked on the socket fails now
        except OSError:
            pass
        with self._state:
            while self._downloads:  # their threads see the end (and release their models) first
                self._state.wait()
            calls = list(self.calls.values())
        for call in calls:
            self._finish(call, None)  # aborts an upload in progress: its round slot is released
        self.service.close_thread()

    def _read_frame(self) -> None:
        raw = self._next_frame_header()
        with self._state:
            header = self.h2.receive_header(raw)
        if header.type == h2.DATA:
            self._on_data(header)
        else:
            payload = self._read_exact(header.keep) if header.keep else b""
            self._discard(header.length - header.keep)
            with self._state:
                events = self.h2.receive_frame(header, payload)
            self._handle(events)
        self._flush()

    def _next_frame_header(self) -> bytearray:
        """The next frame's header. Silence is fine while the connection is busy otherwise (a
        download the client reads without answering); an idle one ends."""
        header = bytearray(h2.FRAME_HEADER_SIZE)
        view, got = memoryview(header), 0
        while got < len(header):
            try:
                # exactly the header: a larger read would pull the DATA behind it through a buffer
                n = FrameSource(self.stream, len(header) - got).readinto(view[got:])
            except PeerStalled:
                if got == 0 and self.h2.idle_for <= self.idle_timeout:
                    continue  # silent, but not idle
                raise
            got += n
        return header

    def _read_exact(self, n: int) -> bytes:
        with _socket_errors():
            return self.stream.read_exact(n)

    def _discard(self, n: int) -> None:
        FrameSource(self.stream, n).skip()

    def _on_data(self, header: h2.FrameHeader) -> None:
        pad_length = self._read_exact(1) if header.flags & h2.PADDED else b""
        with self._state:
            frame = self.h2.receive_data(header, pad_length)
        if frame.reset is not None:
            self._on_reset(frame.reset)
        call = self.calls.get(frame.stream_id) if frame.accepted else None
        src = FrameSource(self.stream, frame.size)
        if call is not None and call.reader is not None and not call.finished:
            reader = call.reader
            self._guarded(call, lambda: reader.feed(src))
        src.skip()  # what a refused, failed or non-gRPC call leaves unread
        self._discard(frame.padding)
        if call is not None and frame.end_stream and not call.finished:
            self._end_of_request(call)

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
                with self._state:
                    self._state.notify_all()  # downloads waiting for credit
                    waiting = [c for c in self.calls.values() if c.outbox and not c.own_sender]
                for call in waiting:
                    self._drain(call)

    def _on_reset(self, ev: h2.StreamReset) -> None:
        call = self.calls.get(ev.stream_id)
        if call is not None:
            self._finish(call, None if ev.by_peer else BadRequest(ev.reason, code="protocol_error"))

    # -- calls -----------------------------------------------------------------------------------------
    def _on_request(self, ev: h2.HeadersReceived) -> None:
        headers = dict(ev.headers)
        path = headers.get(":path", "")
        call = Call(ev.stream_id, path[len(SERVICE):] if path.startswith(SERVICE) else "")
        with self._state:
            self.calls[call.stream_id] = call
        if not headers.get("content-type", "").startswith(CONTENT_TYPE) or headers.get(":method") != "POST":
            call.plain_status = "405" if headers.get("content-type", "").startswith(CONTENT_TYPE) else "415"
            call.plain_body = b"" if headers.get(":method") == "HEAD" else NOT_GRPC
        else:
            self._guarded(call, lambda: self._start_call(call, headers))
        if ev.end_stream and not call.finished:
            self._end_of_request(call)

    def _start_call(self, call: Call, headers: dict[str, str]) -> None:
        if headers.get("grpc-encoding", "identity") != "identity":
            raise LiflError("only identity encoding is supported", code="unsupported_encoding", grpc_status="UNIMPLEMENTED")
        if call.method not in BLOB_UPLOADS and call.method not in UNARY:
            raise LiflError(f"unknown method {headers.get(':path')}", code="unimplemented", grpc_status="UNIMPLEMENTED")
        call.caller = self.service.authenticate(headers.get("authorization"), self.stream.peer_certificate)
        limits = self.limits
        if call.method in BLOB_UPLOADS:
            call.reader = MessageReader(lambda meta: self._open_blob(call, meta), max_unary=limits.max_unary_message,
                                        max_meta=limits.max_meta_message)
        else:
            call.reader = MessageReader(None, max_unary=limits.max_unary_message, max_meta=limits.max_meta_message)

    def _end_of_request(self, call: Call) -> None:
        if call.plain_status:
            self._respond_plain(call)
        else:
            self._guarded(call, lambda: self._complete(call))

    def _guarded(self, call: Call, action: Callable[[], None]) -> None:
        """Run one call's work; whatever goes wrong in it fails that call only."""
        try:
            action()
        except PeerGone:
            raise
        except LiflError as e:
            self._fail(call, e)
        except Exception as e:
            traceback.print_exc()
            self._fail(call, Internal(f"{type(e).__name__}: {e}"))

    def _open_blob(self, call: Call, meta_bytes: bytes) -> BlobTarget:
        assert call.caller is not None
        try:
            if call.method == "PushUpdate":
                m = pb.UpdateMeta.FromString(meta_bytes)
                fields = {"client": m.client, "samples": m.samples, "base_version": m.base_version, "lease": m.lease}
                call.ingest = self.service.begin_update(call.caller, m.job, fields, "grpc", m.size or None)
            else:
                mm = pb.ModelMeta.FromString(meta_bytes)
                call.ingest = self.service.begin_model(call.caller, mm.job, "grpc", mm.size or None)
        except LiflError:
            raise
        except Exception as e:  # protobuf decode errors
            raise BadRequest(f"bad meta message: {e}") from None
        return call.ingest.sink

    def _complete(self, call: Call) -> None:
        """The client finished sending: run the call and answer."""
        reader = call.reader
        if reader is None:
            return  # refused when it started
        if not reader.at_message_boundary:
            raise BadRequest("the stream ended inside a message", code="truncated")
        if call.method in BLOB_UPLOADS:
            if reader.sink is None or call.ingest is None:
                raise BadRequest("the stream ended before any meta was sent", code="missing_meta")
            result = call.ingest.finish()
            call.ingest = None  # handed over: nothing to abort any more
            if call.method == "PushUpdate":
                self._reply(call, pb.PushUpdateReply(version=result["version"]).SerializeToString())
            else:
                self._reply(call, pb.SetModelReply(version=result["version"]).SerializeToString())
            return
        if reader.messages != 1:
            raise BadRequest("a unary request must be exactly one message")
        request = bytes(reader.unary)
        assert call.caller is not None
        try:
            if call.method == "GetModel":
                self._start_download(call, pb.GetModelRequest.FromString(request).job)
            else:
                self._reply(call, self._unary(call.caller, call.method, request).SerializeToString())
        except LiflError:
            raise
        except Exception as e:
            if "DecodeError" in type(e).__name__:
                raise BadRequest(f"bad request message: {e}") from None
            raise

    def _unary(self, caller: Principal, method: str, request: bytes) -> Any:
        service = self.service
        if method == "CreateJob":
            req = pb.CreateJobRequest.FromString(request)
            body: dict[str, Any] = {"job": req.job, "goal": req.goal}
            for name in ("tenant", "leaf_fan_in", "max_update_bytes", "max_inflight", "round_deadline_s", "min_updates",
                         "lease_ttl_s", "over_selection", "max_samples", "architecture"):
                if getattr(req, name):  # proto3: 0 or "" means "use the default"
                    body[name] = getattr(req, name)
            for field in ("retention", "strategy", "fixed_point"):
                if text := getattr(req, f"{field}_json"):
                    body[field] = _json_field(text, f"{field}_json")
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
        with self._state:
            if self._downloads >= self.limits.max_downloads_per_connection or not self._download_slots.acquire(blocking=False):
                raise Overloaded("too many model downloads in progress", code="too_many_downloads",
                                 retry_after=DOWNLOAD_PUSHBACK)
            self._downloads += 1
        try:
            assert call.caller is not None
            view = self.service.open_model(call.caller, job)
            call.own_sender = True
            threading.Thread(target=self._download, args=(call, job, view), name="grpc-download", daemon=True).start()
        except BaseException:
            self._release_download_slot()
            raise

    def _release_download_slot(self) -> None:
        self._download_slots.release()
        with self._state:
            self._downloads -= 1
            self._state.notify_all()

    def _download(self, call: Call, job: str, view: ModelView) -> None:
        """A download's thread: the model straight from shared memory, within flow control."""
        try:
            self._guarded(call, lambda: self._send_model(call, job, view))
        except PeerGone:
            pass
        finally:
            self._finish(call, None)
            try:
                view.release()
            finally:
                self._release_download_slot()

    def _send_model(self, call: Call, job: str, view: ModelView) -> None:
        mm = self.service.mappings.map_fd(view.fd, writable=False)
        data = memoryview(mm)[: view.size]
        meta = pb.ModelMeta(job=job, version=view.version, size=view.size).SerializeToString()
        self._send_headers(call, RESPONSE_HEADERS)
        with self._state:
            call.outbox.extend(memoryview(p) for message in chunk_messages(meta, data, MODEL_CHUNK) for p in message)
            call.trailers = OK_TRAILERS
        self._send_outbox(call)
        if call.answered:
            self.service.metrics.bytes_out.labels("grpc").inc(view.size)

    def _send_outbox(self, call: Call) -> None:
        """Send a download's outbox as flow control allows; reset it with CANCEL if no credit
        comes for ``send_timeout`` seconds."""
        progress = time.monotonic()
        while not call.finished:
            if self._drain(call):
                progress = time.monotonic()
            with self._state:
                if call.finished or self._closed:
                    return
                try:
                    if self.h2.send_window(call.stream_id) > 0:
                        continue
                except h2.StreamClosedError:
                    return
                left = self.limits.send_timeout - (time.monotonic() - progress)
                if left > 0:
                    self._state.wait(left)
                    continue
            self._reset(call, h2.CANCEL)
            return

    # -- writing -------------------------------------------------------------------------------------------
    def _reply(self, call: Call, message: bytes) -> None:
        """Answer with one message and status OK; what the client's windows do not take now
        waits in the outbox for its WINDOW_UPDATE."""
        self._send_headers(call, RESPONSE_HEADERS)
        with self._state:
            call.outbox.append(memoryview(message_prefix(len(message)) + message))
            call.trailers = OK_TRAILERS
        self._drain(call)

    def _respond_plain(self, call: Call) -> None:
        """A request that is not a gRPC call: an HTTP status and a short text saying so."""
        self._send_headers(call, [(":status", call.plain_status), ("content-type", "text/plain; charset=utf-8"),
                                  ("content-length", str(len(NOT_GRPC)))], end_stream=not call.plain_body)
        if not call.plain_body:
            self._finish(call, None)
            return
        with self._state:
            call.outbox.append(memoryview(call.plain_body))
        self._drain(call)

    def _fail(self, call: Call, error: LiflError) -> None:
        """Answer with an error status (trailers only, if nothing was sent yet) and tell the
        client to stop sending (RST_STREAM NO_ERROR, if it had not finished)."""
        head = [] if call.headers_sent else [(":status", "200"), ("content-type", CONTENT_TYPE)]

        def frames() -> list[bytes | memoryview]:
            if call.finished:
                return []
            call.outbox.clear()
            try:
                self.h2.send_headers(call.stream_id, head + status_trailers(error), end_stream=True)
                self.h2.reset_stream(call.stream_id, h2.NO_ERROR)
            except h2.StreamClosedError:
                pass  # reset meanwhile
            return [self.h2.data_to_send()]

        self._send(frames)
        self._finish(call, error)

    def _reset(self, call: Call, code: int) -> None:
        def frames() -> list[bytes | memoryview]:
            self.h2.reset_stream(call.stream_id, code)
            return [self.h2.data_to_send()]

        self._send(frames)
        self._finish(call, None)

    def _send_headers(self, call: Call, headers: list[tuple[str, str]], end_stream: bool = False) -> None:
        def frames() -> list[bytes | memoryview]:
            try:
                self.h2.send_headers(call.stream_id, headers, end_stream)
            except h2.StreamClosedError:
                return []  # reset meanwhile: the call is finished by whoever saw the reset
            call.headers_sent = True
            return [self.h2.data_to_send()]

        self._send(frames)

    def _drain(self, call: Call) -> int:
        """Send as much of the call's outbox as flow control allows now, and once it is empty the
        trailers (or END_STREAM on the last DATA); DATA bytes sent."""
        sent = 0
        while True:
            with self._write:
                with self._state:
                    step = self._next_frames(call)
                if step is None:
                    return sent
                parts, size, complete = step
                self._emit(parts)
            sent += size
            if complete:
                call.answered = True
                self._finish(call, None)
                return sent

    def _next_frames(self, call: Call) -> tuple[list[bytes | memoryview], int, bool] | None:
        """(Both locks held.) The call's next frames that flow control lets through: the parts
        to write, their DATA bytes, and whether they complete the response; None: wait."""
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
        """Send the frames the codec queued by itself (ACKs, WINDOW_UPDATEs, RST_STREAMs)."""
        if self.h2.has_data_to_send:
            self._send(lambda: [self.h2.data_to_send()])

    def _send(self, frames: Callable[[], list[bytes | memoryview]]) -> None:
        """Write what ``frames`` queues in the codec: produced under both locks (HPACK order),
        written under the write lock alone."""
        with self._write:
            with self._state:
                parts = frames()
            self._emit(parts)

    def _emit(self, parts: list[bytes | memoryview]) -> None:
        with _socket_errors():
            sendmsg_all(self.sock, parts)

    def _finish(self, call: Call, error: LiflError | None) -> None:
        """The call is over (answered, reset, or its connection ends): forget it, and give back an
        upload's object if it was not handed over."""
        with self._state:
            if call.finished and call.ingest is None:
                return
            call.finished = True
            call.outbox.clear()
            self.calls.pop(call.stream_id, None)
            self._state.notify_all()
            ingest, call.ingest = call.ingest, None
        if ingest is not None:
            ingest.abort(error)


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


class GrpcServer(ThreadedServer):
    def __init__(self, service: GatewayService, host: str, port: int, limits: ConnectionLimits | None = None,
                 grpc_limits: GrpcLimits | None = None) -> None:
        super().__init__(host, port, limits)
        self.service = service
        self.grpc_limits = grpc_limits or GrpcLimits()
        self._download_slots = threading.BoundedSemaphore(self.grpc_limits.max_downloads)

    def serve(self, sock: socket.socket) -> None:
        GrpcConnection(sock, self.connection(sock).stream, self.service, self.grpc_limits, self._download_slots).run()

    def refuse(self, sock: socket.socket) -> None:
        """Over the connection limits: say so in HTTP/2 before closing, so gRPC clients report it."""
        sock.send(h2.settings_frame() + h2.goaway_frame(0, h2.ENHANCE_YOUR_CALM, b"connection limit reached"))
