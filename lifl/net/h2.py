"""HTTP/2 (RFC 9113) without I/O: frames, stream states, flow control, HPACK and limits.

One ``Connection`` per TCP connection, for either side. Bytes go in, events come out, and the
frames to send accumulate in ``data_to_send()``. There are two ways in:

- ``receive_bytes(data)``: everything buffered, DATA payloads delivered as bytes in
  ``DataReceived`` events (the client SDK, tests, fuzzing).
- frame by frame (the gateway, so that DATA can be received straight into shared memory):
  ``receive_header(9 bytes)`` validates a frame header before a byte of its payload is read
  and says how many payload bytes to keep (``FrameHeader.keep``; the rest is dropped as it is
  read); ``receive_frame(header, kept)`` handles frames other than DATA; for DATA,
  ``receive_data(header, pad_length_byte)`` does the bookkeeping and returns how many bytes
  the caller reads into its own buffer and how much padding it drops.

DATA is sent the same way round: ``send_data`` reserves flow-control credit and returns the
bytes to write before the payload, which the caller writes straight from its own memory.

Errors: the receive methods raise only ``H2ConnectionError`` (send ``goaway()`` and close).
A peer's error confined to one stream resets that stream (RST_STREAM is queued) and comes out
as a ``StreamReset`` event with ``by_peer=False``; the connection goes on. The send methods
raise ``StreamClosedError`` for a stream that has been reset or closed meanwhile.

Every limit a peer could abuse is named in ``Limits``: frame size and header-list size
(checked before the payload is read or decoded; frames of a header block are held to
``MAX_HEADER_FRAME_SIZE`` whatever the frame size), concurrent streams, flood rates of SETTINGS,
PING, empty frames, CONTINUATION and stream resets (GOAWAY ENHANCE_YOUR_CALM). Time limits
are the I/O shell's; the codec keeps ``last_activity``, the last time a stream made progress
(PINGs do not count), for its idle timeout.
"""

from __future__ import annotations

import re
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9

# frame types (RFC 9113 §6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
FRAME_NAMES = ("DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING", "GOAWAY", "WINDOW_UPDATE",
               "CONTINUATION")
# flags
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# settings (§6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = range(1, 7)
# error codes (§7)
(NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, STREAM_CLOSED, FRAME_SIZE_ERROR,
 REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, CONNECT_ERROR, ENHANCE_YOUR_CALM, INADEQUATE_SECURITY,
 HTTP_1_1_REQUIRED) = range(14)

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME_SIZE = 1 << 14
LARGEST_FRAME_SIZE = (1 << 24) - 1
MAX_WINDOW = (1 << 31) - 1
DEFAULT_HEADER_TABLE_SIZE = 4096
# HEADERS and CONTINUATION frames carry at most the protocol's default frame size either way,
# sent or received (FRAME_SIZE_ERROR): the larger SETTINGS_MAX_FRAME_SIZE we advertise is for
# DATA (uploads), and peers such as h2spec assume header frames over 16 KiB are refused.
MAX_HEADER_FRAME_SIZE = DEFAULT_MAX_FRAME_SIZE

# Payloads of frames other than DATA and header blocks are buffered whole only up to the frame
# size every HTTP/2 endpoint must accept; GOAWAY debug data beyond it and unknown frame types
# are dropped as they are read, and a longer SETTINGS frame (2,730 settings) is abuse.
BUFFERED_PAYLOAD_MAX = DEFAULT_MAX_FRAME_SIZE
# Closed streams are forgotten (a connection serves any number of streams); the most recent
# ones are remembered to tell "closed" from "never opened" and to ignore what a peer had in
# flight when we reset a stream (§5.1: those frames must be ignored, not answered).
CLOSED_STREAMS_REMEMBERED = 1024

# The limits' defaults, one place for all of them (see Limits).
# DATA goes zero-copy into shared memory, but each frame costs system calls and parsing: at
# 16 KiB (the protocol's default) 4x the copy itself; with 128 KiB frames a 45 MB update still
# took 1.7x as long as with 1 MiB ones (a client's usual message), where the cost is lost in
# the noise. Nothing else is buffered at this size (BUFFERED_PAYLOAD_MAX, max_header_list_size).
MAX_FRAME_SIZE_DEFAULT = 1 << 20
MAX_HEADER_LIST_SIZE_DEFAULT = 64 << 10  # hpack's decoding is quadratic in a block's fields: 13 ms at 64 KiB, 1.8 s at 256 KiB
MAX_CONCURRENT_STREAMS_DEFAULT = 128
STREAM_WINDOW_DEFAULT = 4 << 20
CONNECTION_WINDOW_DEFAULT = 1 << 30
FLOOD_PERIOD_DEFAULT = 10.0  # seconds over which the flood limits below are counted
MAX_SETTINGS_DEFAULT = 100
MAX_PINGS_DEFAULT = 500
MAX_EMPTY_FRAMES_DEFAULT = 500
MAX_CONTINUATIONS_DEFAULT = 1000
MAX_RESETS_DEFAULT = 500


@dataclass(frozen=True)
class Limits:
    """What one connection may cost us; advertised in SETTINGS where HTTP/2 has a setting."""

    max_frame_size: int = MAX_FRAME_SIZE_DEFAULT  # SETTINGS_MAX_FRAME_SIZE (header frames: MAX_HEADER_FRAME_SIZE)
    max_header_list_size: int = MAX_HEADER_LIST_SIZE_DEFAULT  # SETTINGS_MAX_HEADER_LIST_SIZE; also caps a header block's bytes
    max_concurrent_streams: int = MAX_CONCURRENT_STREAMS_DEFAULT  # SETTINGS_MAX_CONCURRENT_STREAMS
    stream_window: int = STREAM_WINDOW_DEFAULT  # SETTINGS_INITIAL_WINDOW_SIZE
    connection_window: int = CONNECTION_WINDOW_DEFAULT
    flood_period: float = FLOOD_PERIOD_DEFAULT
    max_settings: int = MAX_SETTINGS_DEFAULT  # SETTINGS frames per flood period
    max_pings: int = MAX_PINGS_DEFAULT  # PING frames per flood period
    max_empty_frames: int = MAX_EMPTY_FRAMES_DEFAULT  # frames that carry nothing and end nothing, per period
    max_continuations: int = MAX_CONTINUATIONS_DEFAULT  # CONTINUATION frames per period
    max_resets: int = MAX_RESETS_DEFAULT  # streams reset by the peer, or for its errors, per period

    def __post_init__(self) -> None:
        if not DEFAULT_MAX_FRAME_SIZE <= self.max_frame_size <= LARGEST_FRAME_SIZE:
            raise ValueError(f"max_frame_size must be within [{DEFAULT_MAX_FRAME_SIZE}, {LARGEST_FRAME_SIZE}]")
        if not 1 <= self.stream_window <= MAX_WINDOW or not DEFAULT_WINDOW <= self.connection_window <= MAX_WINDOW:
            raise ValueError(f"windows must be within [1, {MAX_WINDOW}] (the connection's at least {DEFAULT_WINDOW})")
        if min(self.max_header_list_size, self.max_concurrent_streams, self.max_settings, self.max_pings,
               self.max_empty_frames, self.max_continuations, self.max_resets) < 1 or not self.flood_period > 0:
            raise ValueError("limits must be positive")


class Side(Enum):
    CLIENT = "client"
    SERVER = "server"


class H2ConnectionError(Exception):
    """A connection error (§5.4.1): send ``Connection.goaway(e.code, str(e))`` and close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamClosedError(Exception):
    """Sending on a stream that is closed (the peer reset it, or it ended)."""


class FrameHeader(NamedTuple):
    length: int
    type: int
    flags: int
    stream_id: int
    keep: int  # payload bytes to read and pass on; the rest of ``length`` is read and dropped


# -- events --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HeadersReceived:
    """A request (server), a response (client) or trailers, validated per §8.2-8.3."""

    stream_id: int
    headers: list[tuple[str, str]]
    end_stream: bool
    trailers: bool


@dataclass(frozen=True, slots=True)
class DataReceived:
    """DATA through ``receive_bytes`` (the frame-by-frame path returns a ``DataFrame``)."""

    stream_id: int
    data: bytes
    end_stream: bool


@dataclass(frozen=True, slots=True)
class StreamReset:
    """A stream ended abnormally: the peer sent RST_STREAM, or we did for its error."""

    stream_id: int
    error_code: int
    by_peer: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class WindowUpdated:
    """Flow-control credit grew: for one stream, or for all of them (``stream_id`` 0)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class SettingsReceived:
    changes: dict[int, int]


@dataclass(frozen=True, slots=True)
class PingAcked:
    data: bytes


@dataclass(frozen=True, slots=True)
class GoAwayReceived:
    error_code: int
    last_stream_id: int
    debug: bytes


Event = HeadersReceived | DataReceived | StreamReset | WindowUpdated | SettingsReceived | PingAcked | GoAwayReceived


@dataclass(frozen=True, slots=True)
class DataFrame:
    """What to do with a DATA frame's payload: read ``size`` bytes (into the stream's consumer
    if ``accepted``, else drop them), then drop ``padding`` bytes. ``reset``: the frame broke
    its stream's rules and the stream was reset."""

    stream_id: int
    size: int
    padding: int
    end_stream: bool
    accepted: bool
    reset: StreamReset | None = None


# -- frame writing -------------------------------------------------------------------------------
_HEADER = struct.Struct(">BHBBI")


def frame_header(length: int, ftype: int, flags: int, stream_id: int) -> bytes:
    return _HEADER.pack(length >> 16, length & 0xFFFF, ftype, flags, stream_id)


def parse_frame_header(raw: bytes | bytearray | memoryview) -> FrameHeader:
    high, low, ftype, flags, stream_id = _HEADER.unpack(raw)
    length = high << 16 | low
    return FrameHeader(length, ftype, flags, stream_id & 0x7FFFFFFF, length)  # the reserved bit is ignored (§4.1)


def encode_frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return frame_header(len(payload), ftype, flags, stream_id) + payload


def data_frame(stream_id: int, data: bytes, *, end_stream: bool = False, padding: int | None = None) -> bytes:
    flags = END_STREAM if end_stream else 0
    if padding is not None:
        return encode_frame(DATA, flags | PADDED, stream_id, bytes([padding]) + data + bytes(padding))
    return encode_frame(DATA, flags, stream_id, data)


def headers_frame(stream_id: int, block: bytes, *, end_stream: bool = False, end_headers: bool = True,
                  padding: int | None = None, depends_on: int | None = None, weight: int = 16) -> bytes:
    flags = (END_STREAM if end_stream else 0) | (END_HEADERS if end_headers else 0)
    payload = block
    if depends_on is not None:
        flags |= PRIORITY_FLAG
        payload = struct.pack(">IB", depends_on, weight - 1) + payload
    if padding is not None:
        flags |= PADDED
        payload = bytes([padding]) + payload + bytes(padding)
    return encode_frame(HEADERS, flags, stream_id, payload)


def continuation_frame(stream_id: int, block: bytes, *, end_headers: bool = True) -> bytes:
    return encode_frame(CONTINUATION, END_HEADERS if end_headers else 0, stream_id, block)


def priority_frame(stream_id: int, depends_on: int, weight: int = 16, exclusive: bool = False) -> bytes:
    return encode_frame(PRIORITY, 0, stream_id, struct.pack(">IB", depends_on | (exclusive << 31), weight - 1))


def rst_stream_frame(stream_id: int, error_code: int) -> bytes:
    return encode_frame(RST_STREAM, 0, stream_id, struct.pack(">I", error_code))


def settings_frame(settings: Iterable[tuple[int, int]] = (), *, ack: bool = False) -> bytes:
    return encode_frame(SETTINGS, ACK if ack else 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in settings))


def push_promise_frame(stream_id: int, promised_stream_id: int, block: bytes) -> bytes:
    return encode_frame(PUSH_PROMISE, END_HEADERS, stream_id, struct.pack(">I", promised_stream_id) + block)


def ping_frame(data: bytes, *, ack: bool = False) -> bytes:
    return encode_frame(PING, ACK if ack else 0, 0, data)


def goaway_frame(last_stream_id: int, error_code: int, debug: bytes = b"") -> bytes:
    return encode_frame(GOAWAY, 0, 0, struct.pack(">II", last_stream_id, error_code) + debug)


def window_update_frame(stream_id: int, increment: int) -> bytes:
    return encode_frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


# -- header fields (§8.2, §8.3) ------------------------------------------------------------------
class MalformedHeaders(ValueError):
    """A header list that breaks §8.2-8.3: the stream is reset with PROTOCOL_ERROR."""


class HeaderKind(Enum):
    REQUEST = "request"
    RESPONSE = "response"
    TRAILERS = "trailers"


_REQUEST_PSEUDO = frozenset({":method", ":scheme", ":path", ":authority"})
_RESPONSE_PSEUDO = frozenset({":status"})
_CONNECTION_SPECIFIC = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"})
# a field name: visible ASCII except uppercase (and ':' outside pseudo-headers), at least one octet
_NAME = re.compile(rb"[\x21-\x39\x3b-\x40\x5b-\x7e]+")
_VALUE_FORBIDDEN = (b"\x00", b"\r", b"\n")


def validate_headers(fields: Sequence[tuple[bytes, bytes]], kind: HeaderKind) -> list[tuple[str, str]]:
    """Check a decoded header list and return it as text (values latin-1, which keeps every
    octet); MalformedHeaders says why it is not acceptable."""
    out: list[tuple[str, str]] = []
    pseudo: set[str] = set()
    regular_seen = False
    allowed_pseudo = {HeaderKind.REQUEST: _REQUEST_PSEUDO, HeaderKind.RESPONSE: _RESPONSE_PSEUDO}.get(kind, frozenset())
    for raw_name, raw_value in fields:
        is_pseudo = raw_name[:1] == b":"
        if not raw_name or not (_NAME.fullmatch(raw_name, 1) if is_pseudo else _NAME.fullmatch(raw_name)):
            raise MalformedHeaders(f"invalid field name {raw_name[:64]!r}")
        if any(c in raw_value for c in _VALUE_FORBIDDEN) or raw_value[:1] in (b" ", b"\t") or raw_value[-1:] in (b" ", b"\t"):
            raise MalformedHeaders(f"invalid value of field {raw_name[:64]!r}")
        name, value = raw_name.decode("ascii"), raw_value.decode("latin-1")
        if is_pseudo:
            if name not in allowed_pseudo:
                raise MalformedHeaders(f"pseudo-header {name} is not allowed in a {kind.value}")
            if regular_seen:
                raise MalformedHeaders(f"pseudo-header {name} after a regular field")
            if name in pseudo:
                raise MalformedHeaders(f"duplicate pseudo-header {name}")
            pseudo.add(name)
        else:
            regular_seen = True
            if name in _CONNECTION_SPECIFIC:
                raise MalformedHeaders(f"connection-specific field {name}")
            if name == "te" and value != "trailers":
                raise MalformedHeaders("te may only be 'trailers'")
        out.append((name, value))
    if kind is HeaderKind.REQUEST:
        method = next((v for n, v in out if n == ":method"), None)
        if method == "CONNECT":
            if pseudo != {":method", ":authority"}:
                raise MalformedHeaders("CONNECT takes :method and :authority only")
        elif not {":method", ":scheme", ":path"} <= pseudo:
            raise MalformedHeaders("a request needs :method, :scheme and :path")
        elif not next(v for n, v in out if n == ":path"):
            raise MalformedHeaders("empty :path")
    elif kind is HeaderKind.RESPONSE:
        status = next((v for n, v in out if n == ":status"), "")
        if len(status) != 3 or not status.isascii() or not status.isdigit():
            raise MalformedHeaders(f"invalid :status {status!r}")
    return out


def content_length(headers: Sequence[tuple[str, str]]) -> int | None:
    """The declared content-length, None if absent; MalformedHeaders if invalid or inconsistent."""
    values = {v.strip() for n, v in headers if n == "content-length"}
    if not values:
        return None
    if len(values) > 1 or not all(v.isascii() and v.isdigit() for v in values):
        raise MalformedHeaders("invalid content-length")
    return int(values.pop())


# -- the connection --------------------------------------------------------------------------------
class _Stream:
    """An open or half-closed stream (§5.1); idle and closed streams have no object."""

    __slots__ = ("id", "local_closed", "remote_closed", "send_window", "recv_window", "recv_unacked", "expected_length",
                 "received_length", "header_blocks")

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.id = stream_id
        self.local_closed = False  # we sent END_STREAM: half-closed (local)
        self.remote_closed = False  # the peer sent END_STREAM: half-closed (remote)
        self.send_window = send_window
        self.recv_window = recv_window
        self.recv_unacked = 0
        self.expected_length: int | None = None
        self.received_length = 0
        self.header_blocks = 0


class _HeaderBlock:
    """A header block being received: HEADERS and the CONTINUATIONs that complete it."""

    __slots__ = ("stream_id", "end_stream", "self_dependent", "fragments")

    def __init__(self, stream_id: int, end_stream: bool, self_dependent: bool, fragment: bytes) -> None:
        self.stream_id = stream_id
        self.end_stream = end_stream
        self.self_dependent = self_dependent
        self.fragments = bytearray(fragment)


class _FloodLimit:
    """At most ``limit`` frames of one kind per period (fixed windows: cheap, and a burst at
    a window's edge costs at most twice the limit)."""

    __slots__ = ("what", "limit", "count", "since")

    def __init__(self, what: str, limit: int) -> None:
        self.what, self.limit, self.count, self.since = what, limit, 0, float("-inf")

    def hit(self, now: float, period: float) -> None:
        if now - self.since >= period:
            self.since, self.count = now, 0
        self.count += 1
        if self.count > self.limit:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, f"more than {self.limit} {self.what} in {period:g} s")


_STREAM_FRAMES = frozenset({DATA, HEADERS, PRIORITY, RST_STREAM, PUSH_PROMISE, CONTINUATION})
_CONNECTION_FRAMES = frozenset({SETTINGS, PING, GOAWAY})


class Connection:
    """The state of one HTTP/2 connection, for ``side``. Not thread-safe: callers that share
    one across threads hold a lock around every call."""

    def __init__(self, side: Side, limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.side = side
        self.limits = limits
        self._clock = clock
        self._out = bytearray()
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder(max_header_list_size=limits.max_header_list_size)
        self._streams: dict[int, _Stream] = {}
        self._recently_closed: OrderedDict[int, bool] = OrderedDict()  # stream id -> we reset it
        self._highest_peer_stream = 0
        self._next_local_stream = 1 if side is Side.CLIENT else 2
        self._header_block: _HeaderBlock | None = None
        self._preface_received = side is Side.CLIENT  # only a server receives the preface
        self._settings_received = False  # the peer's first frame must be SETTINGS (§3.4)
        self._local_settings_acked = False
        self.peer_max_frame_size = DEFAULT_MAX_FRAME_SIZE
        self._peer_initial_window = DEFAULT_WINDOW
        self._send_window = DEFAULT_WINDOW
        # until the peer acknowledges our SETTINGS it may use either initial window: allow the larger
        self._recv_initial_window = max(limits.stream_window, DEFAULT_WINDOW)
        self._recv_window = DEFAULT_WINDOW
        self._recv_unacked = 0
        self.goaway_received = False
        self.last_activity = clock()  # the last stream progress either way (requests, DATA); not PINGs
        self._floods = {name: _FloodLimit(what, getattr(limits, name)) for name, what in (
            ("max_settings", "SETTINGS frames"), ("max_pings", "PING frames"), ("max_empty_frames", "empty frames"),
            ("max_continuations", "CONTINUATION frames"), ("max_resets", "stream resets"))}
        self._buffer = bytearray()  # receive_bytes: bytes not yet parsed
        self._buffered_header: FrameHeader | None = None

    # -- the connection's start and end ------------------------------------------------------------
    def initiate(self) -> None:
        """Queue what opens the connection: the client's preface, our SETTINGS and the
        connection window (§3.4)."""
        if self.side is Side.CLIENT:
            self._out += PREFACE
        settings = [(MAX_CONCURRENT_STREAMS, self.limits.max_concurrent_streams), (INITIAL_WINDOW_SIZE, self.limits.stream_window),
                    (MAX_FRAME_SIZE, self.limits.max_frame_size), (MAX_HEADER_LIST_SIZE, self.limits.max_header_list_size)]
        if self.side is Side.CLIENT:
            settings.append((ENABLE_PUSH, 0))
        self._out += settings_frame(settings)
        if self.limits.connection_window > DEFAULT_WINDOW:
            self._out += window_update_frame(0, self.limits.connection_window - DEFAULT_WINDOW)
            self._recv_window = self.limits.connection_window

    def receive_preface(self, data: bytes) -> None:
        """The client's 24-byte connection preface (server side, frame-by-frame path)."""
        if data != PREFACE:
            raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        self._preface_received = True

    def goaway(self, error_code: int, message: str = "") -> bytes:
        """Everything still queued, then GOAWAY: the last bytes to write before closing. Nothing
        for a peer that never sent the preface (it does not speak HTTP/2)."""
        if self._preface_received:
            self._out += goaway_frame(self._highest_peer_stream, error_code, message.encode()[:256])
        return self.data_to_send()

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    @property
    def has_data_to_send(self) -> bool:
        return bool(self._out)

    @property
    def idle_for(self) -> float:
        """Seconds since a stream last made progress (HEADERS or DATA either way)."""
        return self._clock() - self.last_activity

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # -- receiving, buffered -------------------------------------------------------------------------
    def receive_bytes(self, data: bytes) -> list[Event]:
        """Feed bytes as they come; returns the events of every complete frame."""
        self._buffer += data
        events: list[Event] = []
        if not self._preface_received:
            if len(self._buffer) < len(PREFACE):
                if not PREFACE.startswith(self._buffer):
                    raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return events
            self.receive_preface(bytes(self._buffer[: len(PREFACE)]))
            del self._buffer[: len(PREFACE)]
        while True:
            header = self._buffered_header
            if header is None:
                if len(self._buffer) < FRAME_HEADER_SIZE:
                    return events
                header = self._buffered_header = self.receive_header(self._buffer[:FRAME_HEADER_SIZE])
                del self._buffer[:FRAME_HEADER_SIZE]
            if len(self._buffer) < header.length:
                return events
            payload = bytes(self._buffer[: header.length])
            del self._buffer[: header.length]
            self._buffered_header = None
            if header.type == DATA:
                pad = payload[:1] if header.flags & PADDED else b""
                frame = self.receive_data(header, pad)
                if frame.reset is not None:
                    events.append(frame.reset)
                if frame.accepted:
                    events.append(DataReceived(frame.stream_id, payload[len(pad) : len(pad) + frame.size], frame.end_stream))
            else:
                events += self.receive_frame(header, payload[: header.keep])

    # -- receiving, frame by frame ---------------------------------------------------------------------
    def receive_header(self, raw: bytes | bytearray | memoryview) -> FrameHeader:
        """Validate a frame header before its payload is read (length, stream id, sequence)."""
        header = parse_frame_header(raw)
        length, ftype, flags, sid = header.length, header.type, header.flags, header.stream_id
        if not self._settings_received and ftype != SETTINGS:
            raise H2ConnectionError(PROTOCOL_ERROR, "the first frame must be SETTINGS")
        if length > self.limits.max_frame_size:
            raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds SETTINGS_MAX_FRAME_SIZE")
        if ftype in (HEADERS, CONTINUATION) and length > MAX_HEADER_FRAME_SIZE:
            raise H2ConnectionError(FRAME_SIZE_ERROR, f"{FRAME_NAMES[ftype]} frame of {length} bytes exceeds "
                                                      f"{MAX_HEADER_FRAME_SIZE}, the most a header frame may carry")
        block = self._header_block
        if block is not None and (ftype != CONTINUATION or sid != block.stream_id):
            raise H2ConnectionError(PROTOCOL_ERROR, f"header block of stream {block.stream_id} interrupted")
        if ftype in _STREAM_FRAMES and sid == 0:
            raise H2ConnectionError(PROTOCOL_ERROR, f"{FRAME_NAMES[ftype]} on stream 0")
        if ftype in _CONNECTION_FRAMES and sid != 0:
            raise H2ConnectionError(PROTOCOL_ERROR, f"{FRAME_NAMES[ftype]} on stream {sid}")
        keep = length
        if ftype == DATA:
            if flags & PADDED and length < 1:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "padded DATA without a pad length")
            if length == 0 and not flags & END_STREAM:
                self._flood("max_empty_frames")
            keep = 0  # the payload is the caller's (receive_data)
        elif ftype == HEADERS:
            if length < (1 if flags & PADDED else 0) + (5 if flags & PRIORITY_FLAG else 0):
                raise H2ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its padding and priority fields")
            if sid % 2 == 0:  # only clients open streams (push is disabled)
                raise H2ConnectionError(PROTOCOL_ERROR, f"HEADERS on even-numbered stream {sid}")
            self._check_header_budget(length)
            if length == 0 and not flags & END_HEADERS:
                self._flood("max_empty_frames")
        elif ftype == CONTINUATION:
            if block is None:
                raise H2ConnectionError(PROTOCOL_ERROR, "CONTINUATION without a header block before it")
            self._flood("max_continuations")
            self._check_header_budget(len(block.fragments) + length)
            if length == 0 and not flags & END_HEADERS:
                self._flood("max_empty_frames")
        elif ftype == PRIORITY:
            if length != 5:
                keep = 0  # a stream error (§6.3), reported by receive_frame
        elif ftype in (RST_STREAM, WINDOW_UPDATE):
            if length != 4:
                raise H2ConnectionError(FRAME_SIZE_ERROR, f"{FRAME_NAMES[ftype]} must be 4 bytes")
        elif ftype == SETTINGS:
            if flags & ACK and length:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            if length % 6:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6")
            if length > BUFFERED_PAYLOAD_MAX:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "SETTINGS frame too large")
            if not flags & ACK:  # each one costs us an ACK
                self._flood("max_settings")
        elif ftype == PUSH_PROMISE:
            raise H2ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE: push is disabled")  # servers never accept it either
        elif ftype == PING:
            if length != 8:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "PING must be 8 bytes")
            self._flood("max_pings")
        elif ftype == GOAWAY:
            if length < 8:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
            keep = min(length, BUFFERED_PAYLOAD_MAX)
        else:  # unknown frame types are ignored (§5.5)
            keep = 0
            if length == 0:
                self._flood("max_empty_frames")
        if ftype == SETTINGS:
            self._settings_received = True
        return header._replace(keep=keep)

    def receive_frame(self, header: FrameHeader, payload: bytes) -> list[Event]:
        """A frame other than DATA, with the ``header.keep`` bytes of its payload."""
        ftype = header.type
        if ftype == HEADERS:
            return self._on_headers(header, payload)
        if ftype == CONTINUATION:
            return self._on_continuation(header, payload)
        if ftype == SETTINGS:
            return self._on_settings(header, payload)
        if ftype == WINDOW_UPDATE:
            return self._on_window_update(header.stream_id, payload)
        if ftype == RST_STREAM:
            return self._on_rst_stream(header.stream_id, payload)
        if ftype == PING:
            if header.flags & ACK:
                return [PingAcked(payload)]
            self._out += ping_frame(payload, ack=True)
            return []
        if ftype == PRIORITY:
            if header.length != 5:
                return self._stream_error(header.stream_id, FRAME_SIZE_ERROR, "PRIORITY must be 5 bytes")
            if struct.unpack_from(">I", payload)[0] & 0x7FFFFFFF == header.stream_id:
                return self._stream_error(header.stream_id, PROTOCOL_ERROR, "a stream cannot depend on itself")
            return []
        if ftype == GOAWAY:
            last_stream_id, code = struct.unpack_from(">II", payload)
            self.goaway_received = True
            return [GoAwayReceived(code, last_stream_id & 0x7FFFFFFF, payload[8:])]
        return []

    def receive_data(self, header: FrameHeader, pad_length: bytes) -> DataFrame:
        """A DATA frame's bookkeeping, before its payload is read: ``pad_length`` is the
        payload's first byte if the frame is PADDED, else empty."""
        sid, length, end_stream = header.stream_id, header.length, bool(header.flags & END_STREAM)
        padding = pad_length[0] if pad_length else 0
        if padding > length - len(pad_length):
            raise H2ConnectionError(PROTOCOL_ERROR, "padding exceeds the DATA frame")
        size = length - len(pad_length) - padding
        if self._is_idle(sid):
            raise H2ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
        if length > self._recv_window:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "DATA exceeds the connection's flow-control window")
        # the connection's window counts every DATA byte, accepted or not; it is given back at once
        # because the bytes are consumed (read off the socket) before the next frame
        self._recv_window -= length
        self._recv_unacked += length
        if self._recv_unacked >= max(1, self.limits.connection_window // 2):
            self._out += window_update_frame(0, self._recv_unacked)
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        stream = self._streams.get(sid)
        if stream is None or stream.remote_closed:
            if stream is None and self._recently_closed.get(sid):
                return DataFrame(sid, size, padding, end_stream, accepted=False)  # in flight when we reset it
            return DataFrame(sid, size, padding, end_stream, accepted=False,
                             reset=self._reset(sid, STREAM_CLOSED, f"DATA on closed stream {sid}"))
        if length > stream.recv_window:
            return DataFrame(sid, size, padding, end_stream, accepted=False,
                             reset=self._reset(sid, FLOW_CONTROL_ERROR, "DATA exceeds the stream's flow-control window"))
        stream.recv_window -= length
        stream.received_length += size
        expected = stream.expected_length
        if expected is not None and (stream.received_length > expected or end_stream and stream.received_length != expected):
            return DataFrame(sid, size, padding, end_stream, accepted=False,
                             reset=self._reset(sid, PROTOCOL_ERROR, "DATA does not match content-length"))
        if size or end_stream:
            self.last_activity = self._clock()
        if end_stream:
            self._close_remote(stream)
        else:
            stream.recv_unacked += length
            if stream.recv_unacked >= max(1, self._recv_initial_window // 4):
                self._out += window_update_frame(sid, stream.recv_unacked)
                stream.recv_window += stream.recv_unacked
                stream.recv_unacked = 0
        return DataFrame(sid, size, padding, end_stream, accepted=True)

    # -- sending -----------------------------------------------------------------------------------------
    def new_stream_id(self) -> int:
        """The id of the next stream we open (client side)."""
        return self._next_local_stream

    def send_headers(self, stream_id: int, headers: Sequence[tuple[str, str]], end_stream: bool = False) -> None:
        """Queue a header block (split into HEADERS and CONTINUATION frames of at most the peer's
        frame size and MAX_HEADER_FRAME_SIZE); opens the stream if it is our next one."""
        stream = self._streams.get(stream_id)
        if stream is None and stream_id == self._next_local_stream and self.side is Side.CLIENT:
            stream = self._streams[stream_id] = _Stream(stream_id, self._peer_initial_window, self._recv_initial_window)
            self._next_local_stream += 2
        if stream is None or stream.local_closed:
            raise StreamClosedError(f"stream {stream_id} is closed")
        block = self._encoder.encode(headers)
        max_frame = min(self.peer_max_frame_size, MAX_HEADER_FRAME_SIZE)
        first, rest = block[:max_frame], block[max_frame:]
        flags = (END_STREAM if end_stream else 0) | (0 if rest else END_HEADERS)
        self._out += encode_frame(HEADERS, flags, stream_id, first)
        while rest:
            piece, rest = rest[:max_frame], rest[max_frame:]
            self._out += continuation_frame(stream_id, piece, end_headers=not rest)
        self.last_activity = self._clock()
        if end_stream:
            self._close_local(stream)

    def send_window(self, stream_id: int) -> int:
        """DATA bytes the stream may send now (flow control of stream and connection)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed:
            raise StreamClosedError(f"stream {stream_id} is closed")
        return min(self._send_window, stream.send_window)

    def send_data(self, stream_id: int, size: int, end_stream: bool = False) -> bytes:
        """Spend flow-control credit on ``size`` bytes (at most ``send_window`` and the peer's
        frame size) and return what to write before them: queued frames and the DATA header.
        The caller writes the payload right after, from its own buffer."""
        window = self.send_window(stream_id)
        if size and (size > window or size > self.peer_max_frame_size):  # empty DATA needs no credit
            raise ValueError(f"DATA of {size} bytes exceeds the window ({window}) or frame size ({self.peer_max_frame_size})")
        stream = self._streams[stream_id]
        stream.send_window -= size
        self._send_window -= size
        if size:
            self.last_activity = self._clock()
        self._out += frame_header(size, DATA, END_STREAM if end_stream else 0, stream_id)
        if end_stream:
            self._close_local(stream)
        return self.data_to_send()

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Queue RST_STREAM for a stream that is not closed yet (closed ones need nothing)."""
        if stream_id in self._streams:
            self._out += rst_stream_frame(stream_id, error_code)
            self._forget(stream_id, reset_by_us=True)

    # -- frame handlers ------------------------------------------------------------------------------------
    def _on_headers(self, header: FrameHeader, payload: bytes) -> list[Event]:
        start, end = 0, len(payload)
        if header.flags & PADDED:
            start, end = 1, len(payload) - payload[0]
        self_dependent = False
        if header.flags & PRIORITY_FLAG:
            self_dependent = struct.unpack_from(">I", payload, start)[0] & 0x7FFFFFFF == header.stream_id
            start += 5
        if end < start:
            raise H2ConnectionError(PROTOCOL_ERROR, "padding exceeds the HEADERS frame")
        block = _HeaderBlock(header.stream_id, bool(header.flags & END_STREAM), self_dependent, payload[start:end])
        if header.flags & END_HEADERS:
            return self._on_header_block(block)
        self._header_block = block
        return []

    def _on_continuation(self, header: FrameHeader, payload: bytes) -> list[Event]:
        block = self._header_block
        assert block is not None  # receive_header checked
        block.fragments += payload
        if header.flags & END_HEADERS:
            self._header_block = None
            return self._on_header_block(block)
        return []

    def _on_header_block(self, block: _HeaderBlock) -> list[Event]:
        try:  # decoded even for streams we refuse: the peer's HPACK table counts on it
            fields = self._decoder.decode(bytes(block.fragments), raw=True)
        except hpack.OversizedHeaderListError:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header list exceeds SETTINGS_MAX_HEADER_LIST_SIZE") from None
        except Exception as e:  # hpack raises several types (and may raise others) for an undecodable block
            raise H2ConnectionError(COMPRESSION_ERROR, f"undecodable header block: {e}") from None
        sid = block.stream_id
        stream = self._streams.get(sid)
        if stream is None:
            if self._is_idle(sid):
                if self._is_peer_initiated_id(sid):
                    return self._open_peer_stream(block, fields)
                raise H2ConnectionError(PROTOCOL_ERROR, f"HEADERS on idle stream {sid}")
            reset_by_us = self._recently_closed.get(sid)
            if reset_by_us:
                return []  # in flight when we reset it
            if reset_by_us is None and self._is_peer_initiated_id(sid):  # never opened (or long forgotten)
                raise H2ConnectionError(PROTOCOL_ERROR, f"stream {sid} is lower than a stream already opened")
            raise H2ConnectionError(STREAM_CLOSED, f"HEADERS on closed stream {sid}")
        if stream.remote_closed:
            return [self._reset(sid, STREAM_CLOSED, f"HEADERS on half-closed stream {sid}")]
        if block.self_dependent:
            return [self._reset(sid, PROTOCOL_ERROR, "a stream cannot depend on itself")]
        trailers = stream.header_blocks > 0 or self.side is Side.SERVER
        if trailers and not block.end_stream:
            return [self._reset(sid, PROTOCOL_ERROR, "trailers without END_STREAM")]
        try:
            headers = validate_headers(fields, HeaderKind.TRAILERS if trailers else HeaderKind.RESPONSE)
            if not trailers:
                stream.expected_length = content_length(headers)
            if block.end_stream and stream.expected_length is not None and stream.received_length != stream.expected_length:
                raise MalformedHeaders("DATA does not match content-length")
        except MalformedHeaders as e:
            return [self._reset(sid, PROTOCOL_ERROR, str(e))]
        stream.header_blocks += 1
        self.last_activity = self._clock()
        if block.end_stream:
            self._close_remote(stream)
        return [HeadersReceived(sid, headers, block.end_stream, trailers)]

    def _open_peer_stream(self, block: _HeaderBlock, fields: list[tuple[bytes, bytes]]) -> list[Event]:
        sid = block.stream_id
        self._highest_peer_stream = sid
        stream = self._streams[sid] = _Stream(sid, self._peer_initial_window, self._recv_initial_window)
        if block.self_dependent:
            return [self._reset(sid, PROTOCOL_ERROR, "a stream cannot depend on itself")]
        try:
            headers = validate_headers(fields, HeaderKind.REQUEST)
            stream.expected_length = content_length(headers)
            if block.end_stream and stream.expected_length:
                raise MalformedHeaders("END_STREAM with a non-zero content-length")
        except MalformedHeaders as e:
            return [self._reset(sid, PROTOCOL_ERROR, str(e))]
        if len(self._streams) > self.limits.max_concurrent_streams:
            return [self._reset(sid, REFUSED_STREAM, "SETTINGS_MAX_CONCURRENT_STREAMS exceeded")]
        stream.header_blocks = 1
        self.last_activity = self._clock()
        if block.end_stream:
            self._close_remote(stream)
        return [HeadersReceived(sid, headers, block.end_stream, trailers=False)]

    def _on_settings(self, header: FrameHeader, payload: bytes) -> list[Event]:
        if header.flags & ACK:
            if not self._local_settings_acked:
                self._local_settings_acked = True
                delta = self.limits.stream_window - self._recv_initial_window
                self._recv_initial_window = self.limits.stream_window
                for stream in self._streams.values():
                    stream.recv_window += delta
            return []
        changes: dict[int, int] = {}
        for i in range(0, len(payload), 6):
            ident, value = struct.unpack_from(">HI", payload, i)
            if ident == ENABLE_PUSH and (value > 1 or value == 1 and self.side is Side.CLIENT):
                raise H2ConnectionError(PROTOCOL_ERROR, "invalid SETTINGS_ENABLE_PUSH")
            if ident == INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
            if ident == MAX_FRAME_SIZE and not DEFAULT_MAX_FRAME_SIZE <= value <= LARGEST_FRAME_SIZE:
                raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
            changes[ident] = value
        for ident, value in changes.items():
            if ident == INITIAL_WINDOW_SIZE:
                delta = value - self._peer_initial_window
                for stream in self._streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise H2ConnectionError(FLOW_CONTROL_ERROR, f"stream {stream.id}'s window exceeds 2^31-1")
                self._peer_initial_window = value
            elif ident == MAX_FRAME_SIZE:
                self.peer_max_frame_size = value
            elif ident == HEADER_TABLE_SIZE:
                self._encoder.header_table_size = min(value, DEFAULT_HEADER_TABLE_SIZE)  # we need no bigger table
        self._out += settings_frame(ack=True)
        return [SettingsReceived(changes)]

    def _on_window_update(self, sid: int, payload: bytes) -> list[Event]:
        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE with an increment of 0")
            if self._send_window + increment > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "the connection's window exceeds 2^31-1")
            self._send_window += increment
            return [WindowUpdated(0)]
        if self._is_idle(sid):
            raise H2ConnectionError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
        stream = self._streams.get(sid)
        if stream is None:
            return []  # closed: may still arrive for a while (§5.1)
        if increment == 0:
            return [self._reset(sid, PROTOCOL_ERROR, "WINDOW_UPDATE with an increment of 0")]
        if stream.send_window + increment > MAX_WINDOW:
            return [self._reset(sid, FLOW_CONTROL_ERROR, "the stream's window exceeds 2^31-1")]
        stream.send_window += increment
        return [WindowUpdated(sid)]

    def _on_rst_stream(self, sid: int, payload: bytes) -> list[Event]:
        if self._is_idle(sid):
            raise H2ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        self._flood("max_resets")
        if sid not in self._streams:
            return []
        self._forget(sid, reset_by_us=False)
        return [StreamReset(sid, struct.unpack(">I", payload)[0], by_peer=True)]

    # -- stream bookkeeping ------------------------------------------------------------------------------
    def _is_peer_initiated_id(self, sid: int) -> bool:
        return sid % 2 == (1 if self.side is Side.SERVER else 0)

    def _is_idle(self, sid: int) -> bool:
        if self._is_peer_initiated_id(sid):
            return sid > self._highest_peer_stream
        return sid >= self._next_local_stream

    def _stream_error(self, sid: int, code: int, reason: str) -> list[Event]:
        """A stream error in a frame that may name an idle stream (PRIORITY): RST_STREAM must
        not be sent on an idle stream, so it becomes a connection error there."""
        if self._is_idle(sid):
            raise H2ConnectionError(code, reason)
        return [self._reset(sid, code, reason)]

    def _reset(self, sid: int, code: int, reason: str) -> StreamReset:
        """A stream error (§5.4.2): RST_STREAM, and the stream is closed."""
        self._flood("max_resets")
        self._out += rst_stream_frame(sid, code)
        self._forget(sid, reset_by_us=True)
        return StreamReset(sid, code, by_peer=False, reason=reason)

    def _close_local(self, stream: _Stream) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            self._forget(stream.id, reset_by_us=False)

    def _close_remote(self, stream: _Stream) -> None:
        stream.remote_closed = True
        if stream.local_closed:
            self._forget(stream.id, reset_by_us=False)

    def _forget(self, sid: int, *, reset_by_us: bool) -> None:
        self._streams.pop(sid, None)
        self._recently_closed[sid] = reset_by_us
        self._recently_closed.move_to_end(sid)
        while len(self._recently_closed) > CLOSED_STREAMS_REMEMBERED:
            self._recently_closed.popitem(last=False)

    def _check_header_budget(self, block_bytes: int) -> None:
        if block_bytes > self.limits.max_header_list_size:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block exceeds SETTINGS_MAX_HEADER_LIST_SIZE")

    def _flood(self, name: str) -> None:
        self._floods[name].hit(self._clock(), self.limits.flood_period)
