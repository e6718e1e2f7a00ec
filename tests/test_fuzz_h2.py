"""Fuzzing the HTTP/2 codec, header validation and the gRPC message reader (hypothesis).

Invariants: nothing raises but the documented error (h2.H2ConnectionError from the codec,
h2.MalformedHeaders from header validation, LiflError from the message reader); every
connection error can be answered with GOAWAY; nothing malformed is admitted (requests are
valid, DATA belongs to open streams within their content-length, a blob holds exactly the
bytes its messages carried).
"""

from __future__ import annotations

import struct

import hpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifl.errors import LiflError
from lifl.net import lifl_pb2 as pb
from lifl.net import h2
from lifl.net.grpc import MessageReader, chunk_messages
from test_grpc_limits import MemorySink

pytestmark = pytest.mark.fuzz

LIMITS = h2.Limits(max_frame_size=1 << 14, max_header_list_size=4096, max_concurrent_streams=8)
REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/lifl.v1.Gateway/PushUpdate"), (":authority", "gw"),
           ("content-type", "application/grpc")]


# -- the HTTP/2 codec -------------------------------------------------------------------------------------
def frame_actions() -> st.SearchStrategy[bytes]:
    """Client frames, mostly well formed, on a few streams: what a mutated stream is made of."""
    sid = st.sampled_from([1, 3, 5, 7, 2, 0])
    small = st.binary(max_size=40)
    encoder_headers = st.lists(st.tuples(st.sampled_from(["x-a", "te", "content-length", ":path", "X-Up", "connection"]),
                                         st.sampled_from(["1", "trailers", "", "v\n", "/"])), max_size=3)
    return st.one_of(
        st.builds(lambda s, extra, end: h2.headers_frame(s, hpack.Encoder().encode(REQUEST + extra), end_stream=end),
                  sid, encoder_headers, st.booleans()),
        st.builds(lambda s, block, cut: h2.headers_frame(s, block[:cut], end_headers=False) + h2.continuation_frame(s, block[cut:]),
                  sid, st.just(hpack.Encoder().encode(REQUEST)), st.integers(0, 40)),
        st.builds(lambda s, data, end, pad: h2.data_frame(s, data, end_stream=end, padding=pad),
                  sid, small, st.booleans(), st.one_of(st.none(), st.integers(0, 20))),
        st.builds(lambda s, n: h2.window_update_frame(s, n), sid, st.integers(0, 1 << 31)),
        st.builds(lambda s, code: h2.rst_stream_frame(s, code), sid, st.integers(0, 14)),
        st.builds(lambda s, d: h2.priority_frame(s, d), sid, st.sampled_from([0, 1, 3])),
        st.builds(lambda k, v: h2.settings_frame([(k, v)]), st.integers(0, 9), st.integers(0, 1 << 32 - 1)),
        st.builds(lambda d, ack: h2.ping_frame(d, ack=ack), st.binary(min_size=8, max_size=8), st.booleans()),
        st.builds(lambda code: h2.goaway_frame(0, code), st.integers(0, 14)),
        st.builds(lambda t, f, s, p: h2.encode_frame(t, f, s, p), st.integers(0, 12), st.integers(0, 255), sid, small),
    )


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply edits (position, kind, byte): 0 flips a byte, 1 inserts one, 2 deletes one."""
    out = bytearray(data)
    for position, kind, value in edits:
        if not out:
            break
        i = position % len(out)
        if kind == 0:
            out[i] ^= value or 1
        elif kind == 1:
            out.insert(i, value)
        else:
            del out[i]
    return bytes(out)


class Checked:
    """A server codec fed in chunks, with the invariants checked on everything it admits."""

    def __init__(self) -> None:
        self.conn = h2.Connection(h2.Side.SERVER, LIMITS)
        self.conn.initiate()
        self.conn.data_to_send()
        self.open: dict[int, int | None] = {}  # stream -> content-length, while the peer may send on it
        self.received: dict[int, int] = {}

    def feed(self, data: bytes, chunk: int) -> None:
        try:
            for i in range(0, len(data), chunk):
                for event in self.conn.receive_bytes(data[i : i + chunk]):
                    self.check(event)
        except h2.H2ConnectionError as e:
            assert 0 <= e.code <= h2.HTTP_1_1_REQUIRED
            goaway = self.conn.goaway(e.code, str(e))
            assert goaway == b"" or h2.GOAWAY in frame_types(goaway)  # answered, unless it was not HTTP/2 at all
            return
        frame_types(self.conn.data_to_send())  # what we send is well formed

    def check(self, event: h2.Event) -> None:
        if isinstance(event, h2.HeadersReceived):
            kind = h2.HeaderKind.TRAILERS if event.trailers else h2.HeaderKind.REQUEST
            raw = [(n.encode(), v.encode("latin-1")) for n, v in event.headers]
            assert h2.validate_headers(raw, kind) == event.headers
            if not event.trailers:
                assert event.stream_id % 2 == 1 and event.stream_id not in self.open
                self.open[event.stream_id] = h2.content_length(event.headers)
                self.received[event.stream_id] = 0
            else:
                assert event.stream_id in self.open and event.end_stream
            if event.end_stream:
                self.check_length(event.stream_id, final=True)
                del self.open[event.stream_id]
        elif isinstance(event, h2.DataReceived):
            assert event.stream_id in self.open, "DATA admitted on a stream that is not open"
            self.received[event.stream_id] += len(event.data)
            self.check_length(event.stream_id, final=event.end_stream)
            if event.end_stream:
                del self.open[event.stream_id]
        elif isinstance(event, h2.StreamReset):
            self.open.pop(event.stream_id, None)

    def check_length(self, sid: int, final: bool) -> None:
        expected = self.open[sid]
        if expected is not None:
            assert self.received[sid] == expected if final else self.received[sid] <= expected


def frame_types(data: bytes) -> list[int]:
    types = []
    while data:
        header = h2.parse_frame_header(data[:9])
        assert len(data) >= 9 + header.length
        types.append(header.type)
        data = data[9 + header.length :]
    return types


@given(st.binary(max_size=600), st.booleans(), st.integers(1, 64))
def test_arbitrary_bytes(data: bytes, with_preface: bool, chunk: int) -> None:
    Checked().feed((h2.PREFACE + h2.settings_frame() if with_preface else b"") + data, chunk)


@given(st.lists(frame_actions(), max_size=12), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 2),
                                                                  st.integers(0, 255)), max_size=4), st.integers(1, 200))
def test_mutated_frame_sequences(frames: list[bytes], edits: list[tuple[int, int, int]], chunk: int) -> None:
    data = h2.PREFACE + h2.settings_frame() + b"".join(frames)
    Checked().feed(h2.PREFACE + mutate(data[len(h2.PREFACE):], edits), chunk)


@given(st.binary(max_size=300), st.booleans())
def test_arbitrary_header_blocks(block: bytes, end_stream: bool) -> None:
    """Any bytes as an HPACK block, in HEADERS (and split across a CONTINUATION)."""
    cut = len(block) // 2
    Checked().feed(h2.PREFACE + h2.settings_frame() + h2.headers_frame(1, block, end_stream=end_stream), 17)
    Checked().feed(h2.PREFACE + h2.settings_frame() + h2.headers_frame(1, block[:cut], end_headers=False)
                   + h2.continuation_frame(1, block[cut:]), 5)


FIELD_BYTES = st.binary(max_size=12) | st.sampled_from([b":path", b":method", b":status", b"te", b"trailers", b"/",
                                                         b"connection", b"content-length", b"POST", b"http"])


@given(st.lists(st.tuples(FIELD_BYTES, FIELD_BYTES), max_size=8), st.sampled_from(list(h2.HeaderKind)))
def test_header_validation(fields: list[tuple[bytes, bytes]], kind: h2.HeaderKind) -> None:
    try:
        headers = h2.validate_headers(fields, kind)
    except h2.MalformedHeaders:
        return
    for name, value in headers:
        assert name and name == name.lower() and "\n" not in value and "\r" not in value and "\0" not in value
        assert name not in ("connection", "transfer-encoding", "upgrade", "keep-alive", "proxy-connection")
        assert name != "te" or value == "trailers"
    names = [n for n, _ in headers]
    pseudo = [n for n in names if n.startswith(":")]
    assert names[: len(pseudo)] == pseudo and len(set(pseudo)) == len(pseudo)


# -- the gRPC message reader ---------------------------------------------------------------------------------
class BytesSource:
    """A DATA payload from memory; ``most`` caps each read, as a socket may return less."""

    def __init__(self, data: bytes, most: int) -> None:
        self._data, self._most, self.left = memoryview(data), most, len(data)

    def take(self, limit: int) -> bytes:
        out = self.peek(limit)
        self._data, self.left = self._data[len(out):], self.left - len(out)
        return out

    def peek(self, limit: int) -> bytes:
        return bytes(self._data[: min(limit, self.left, self._most)])

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), self.left, self._most)
        view[:n] = self._data[:n]
        self._data, self.left = self._data[n:], self.left - n
        return n


MAX_BLOB = 4096


def read_upload(stream: bytes, frame: int, most: int) -> MemorySink | None:
    """Feed an upload's bytes in DATA payloads of ``frame`` bytes; the sink if the stream was
    accepted whole (ended at a message boundary with the blob complete), else None."""
    sinks: list[MemorySink] = []

    def open_blob(meta: bytes) -> MemorySink:
        size = pb.UpdateMeta.FromString(meta).size  # DecodeError: refused like a bad meta
        if size > MAX_BLOB:
            raise LiflError("too large")
        sinks.append(MemorySink(size))
        return sinks[-1]

    reader = MessageReader(open_blob, max_unary=1024, max_meta=256)
    try:
        for i in range(0, len(stream), frame):
            reader.feed(BytesSource(stream[i : i + frame], most))
    except LiflError:
        return None
    except Exception as e:  # the meta's own parser: the server turns it into BadRequest
        assert "DecodeError" in type(e).__name__, f"undocumented {type(e).__name__}: {e}"
        return None
    if not reader.at_message_boundary or not sinks or not sinks[0].done:
        return None
    return sinks[0]


@given(st.binary(max_size=MAX_BLOB), st.integers(1, 600), st.integers(1, 300), st.integers(1, 64))
def test_well_formed_uploads_arrive_whole(blob: bytes, chunk: int, frame: int, most: int) -> None:
    meta = pb.UpdateMeta(job="j", client="c", samples=1, size=len(blob)).SerializeToString()
    stream = b"".join(bytes(p) for message in chunk_messages(meta, blob, chunk) for p in message)
    sink = read_upload(stream, frame, most)
    assert sink is not None and bytes(sink.data) == blob


@given(st.binary(max_size=600), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 2), st.integers(0, 255)),
                                         min_size=1, max_size=6), st.integers(1, 100), st.integers(1, 64))
def test_mutated_uploads_admit_nothing_but_their_data_fields(blob: bytes, edits, frame: int, most: int) -> None:
    meta = pb.UpdateMeta(job="j", client="c", samples=1, size=len(blob)).SerializeToString()
    stream = mutate(b"".join(bytes(p) for message in chunk_messages(meta, blob, 97) for p in message), edits)
    sink = read_upload(stream, frame, most)
    if sink is None:
        return
    messages = split_messages(stream)  # accepted: protobuf agrees on what the blob holds
    if messages is not None and all(parses(m) for m in messages):
        assert bytes(sink.data) == b"".join(pb.UpdateChunk.FromString(m).data for m in messages)


@given(st.binary(max_size=300), st.integers(1, 50))
def test_arbitrary_uploads(stream: bytes, frame: int) -> None:
    read_upload(stream, frame, 7)


@given(st.binary(max_size=2000), st.integers(1, 300))
def test_unary_requests_are_one_bounded_message(stream: bytes, frame: int) -> None:
    reader = MessageReader(None, max_unary=1024, max_meta=256)
    try:
        for i in range(0, len(stream), frame):
            reader.feed(BytesSource(stream[i : i + frame], 64))
    except LiflError:
        return
    assert reader.messages <= 1 and len(reader.unary) <= 1024
    if reader.at_message_boundary and reader.messages == 1:
        assert stream[5:] == bytes(reader.unary) and struct.unpack(">I", stream[1:5])[0] == len(reader.unary)


def split_messages(stream: bytes) -> list[bytes] | None:
    out = []
    while stream:
        if len(stream) < 5 or stream[0]:
            return None
        n = struct.unpack(">I", stream[1:5])[0]
        out.append(stream[5 : 5 + n])
        stream = stream[5 + n :]
    return out


def parses(message: bytes) -> bool:
    try:
        pb.UpdateChunk.FromString(message)
    except Exception:
        return False
    return True
