"""The HTTP/2 codec (lifl.net.h2) on its own: bytes in, events and frames out, no sockets."""

from __future__ import annotations

import struct

import hpack
import pytest

from lifl.net import h2

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/lifl.v1.Gateway/GetJob"), (":authority", "gw"),
           ("content-type", "application/grpc"), ("te", "trailers")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def block(headers: list[tuple[str, str]] | list[tuple[bytes, bytes]]) -> bytes:
    """A header block from a fresh encoder: static table and literals only, so that blocks can
    be sent in any order (a shared encoder's dynamic table would couple them)."""
    encoder = hpack.Encoder()
    encoder.header_table_size = 0
    return encoder.encode(headers)


def request(sid: int, *, end_stream: bool = True, headers: list | None = None, **kw) -> bytes:
    return h2.headers_frame(sid, block(headers if headers is not None else REQUEST), end_stream=end_stream, **kw)


def header_frames(sid: int, whole: bytes, *, end_stream: bool = True, end_headers: bool = True) -> bytes:
    """A header block as a HEADERS frame and CONTINUATIONs, each of MAX_HEADER_FRAME_SIZE at most."""
    size = h2.MAX_HEADER_FRAME_SIZE
    pieces = [whole[i : i + size] for i in range(0, len(whole), size)]
    out = h2.headers_frame(sid, pieces[0], end_stream=end_stream, end_headers=end_headers and len(pieces) == 1)
    for i, piece in enumerate(pieces[1:], 2):
        out += h2.continuation_frame(sid, piece, end_headers=end_headers and i == len(pieces))
    return out


def frames(data: bytes) -> list[tuple[h2.FrameHeader, bytes]]:
    out = []
    while data:
        header = h2.parse_frame_header(data[:9])
        out.append((header, data[9 : 9 + header.length]))
        data = data[9 + header.length :]
    return out


def server(limits: h2.Limits = h2.Limits(), clock: Clock | None = None) -> h2.Connection:
    """A server codec past the handshake (preface, both SETTINGS, our ACK drained)."""
    conn = h2.Connection(h2.Side.SERVER, limits, clock or Clock())
    conn.initiate()
    conn.receive_bytes(h2.PREFACE + h2.settings_frame() + h2.settings_frame(ack=True))
    conn.data_to_send()
    return conn


def connection_error(conn: h2.Connection, data: bytes) -> int:
    with pytest.raises(h2.H2ConnectionError) as info:
        conn.receive_bytes(data)
    code = info.value.code
    goaway = [(hd, p) for hd, p in frames(conn.goaway(code, str(info.value))) if hd.type == h2.GOAWAY]
    assert len(goaway) == 1 and struct.unpack_from(">I", goaway[0][1], 4)[0] == code
    return code


def still_alive(conn: h2.Connection) -> bool:
    """The connection goes on: a PING is answered."""
    conn.data_to_send()
    conn.receive_bytes(h2.ping_frame(b"8 bytes!"))
    return frames(conn.data_to_send()) == [(h2.FrameHeader(8, h2.PING, h2.ACK, 0, 8), b"8 bytes!")]


# -- connection errors (RFC 9113 §5.4.1): GOAWAY with the code, and the connection ends --------------
OPEN = request(1, end_stream=False)
CONNECTION_ERRORS = [
    ("data-on-stream-0", h2.data_frame(0, b"x"), h2.PROTOCOL_ERROR),
    ("data-on-idle-stream", h2.data_frame(1, b"x"), h2.PROTOCOL_ERROR),
    ("headers-on-stream-0", request(0), h2.PROTOCOL_ERROR),
    ("headers-on-even-stream", request(2), h2.PROTOCOL_ERROR),
    ("stream-id-lower-than-before", request(5) + request(3), h2.PROTOCOL_ERROR),
    ("headers-on-closed-stream", OPEN + h2.rst_stream_frame(1, h2.CANCEL) + request(1), h2.STREAM_CLOSED),
    ("frame-over-max-frame-size", OPEN + h2.data_frame(1, bytes(h2.Limits().max_frame_size + 1)), h2.FRAME_SIZE_ERROR),
    ("settings-not-multiple-of-6", h2.encode_frame(h2.SETTINGS, 0, 0, bytes(5)), h2.FRAME_SIZE_ERROR),
    ("settings-ack-with-payload", h2.encode_frame(h2.SETTINGS, h2.ACK, 0, bytes(6)), h2.FRAME_SIZE_ERROR),
    ("settings-on-a-stream", h2.encode_frame(h2.SETTINGS, 0, 1), h2.PROTOCOL_ERROR),
    ("settings-enable-push-2", h2.settings_frame([(h2.ENABLE_PUSH, 2)]), h2.PROTOCOL_ERROR),
    ("settings-window-over-2^31-1", h2.settings_frame([(h2.INITIAL_WINDOW_SIZE, 1 << 31)]), h2.FLOW_CONTROL_ERROR),
    ("settings-frame-size-too-small", h2.settings_frame([(h2.MAX_FRAME_SIZE, 16383)]), h2.PROTOCOL_ERROR),
    ("settings-frame-size-too-large", h2.settings_frame([(h2.MAX_FRAME_SIZE, 1 << 24)]), h2.PROTOCOL_ERROR),
    ("settings-too-large", h2.encode_frame(h2.SETTINGS, 0, 0, bytes(6 * 2731)), h2.ENHANCE_YOUR_CALM),
    ("window-overflow-via-settings", OPEN + h2.window_update_frame(1, h2.MAX_WINDOW - h2.DEFAULT_WINDOW)
     + h2.settings_frame([(h2.INITIAL_WINDOW_SIZE, h2.DEFAULT_WINDOW + 1)]), h2.FLOW_CONTROL_ERROR),
    ("ping-on-a-stream", h2.encode_frame(h2.PING, 0, 1, bytes(8)), h2.PROTOCOL_ERROR),
    ("ping-of-7-bytes", h2.encode_frame(h2.PING, 0, 0, bytes(7)), h2.FRAME_SIZE_ERROR),
    ("goaway-on-a-stream", h2.encode_frame(h2.GOAWAY, 0, 1, bytes(8)), h2.PROTOCOL_ERROR),
    ("goaway-of-7-bytes", h2.encode_frame(h2.GOAWAY, 0, 0, bytes(7)), h2.FRAME_SIZE_ERROR),
    ("window-update-of-0", h2.window_update_frame(0, 0), h2.PROTOCOL_ERROR),
    ("connection-window-over-2^31-1", h2.window_update_frame(0, h2.MAX_WINDOW), h2.FLOW_CONTROL_ERROR),
    ("window-update-on-idle-stream", h2.window_update_frame(1, 1), h2.PROTOCOL_ERROR),
    ("window-update-of-3-bytes", h2.encode_frame(h2.WINDOW_UPDATE, 0, 0, bytes(3)), h2.FRAME_SIZE_ERROR),
    ("rst-stream-on-idle-stream", h2.rst_stream_frame(1, h2.CANCEL), h2.PROTOCOL_ERROR),
    ("rst-stream-on-stream-0", h2.rst_stream_frame(0, h2.CANCEL), h2.PROTOCOL_ERROR),
    ("rst-stream-of-3-bytes", OPEN + h2.encode_frame(h2.RST_STREAM, 0, 1, bytes(3)), h2.FRAME_SIZE_ERROR),
    ("priority-on-stream-0", h2.priority_frame(0, 1), h2.PROTOCOL_ERROR),
    ("priority-self-dependency-on-idle-stream", h2.priority_frame(3, 3), h2.PROTOCOL_ERROR),
    ("continuation-without-headers", h2.continuation_frame(1, block(REQUEST)), h2.PROTOCOL_ERROR),
    ("continuation-after-end-headers", request(1) + h2.continuation_frame(1, b""), h2.PROTOCOL_ERROR),
    ("header-block-interrupted", request(1, end_headers=False) + h2.ping_frame(bytes(8)), h2.PROTOCOL_ERROR),
    ("continuation-on-another-stream", request(1, end_headers=False) + h2.continuation_frame(3, b""), h2.PROTOCOL_ERROR),
    ("continuation-on-stream-0", request(1, end_headers=False) + h2.continuation_frame(0, b""), h2.PROTOCOL_ERROR),
    ("push-promise", h2.push_promise_frame(1, 2, block(REQUEST)), h2.PROTOCOL_ERROR),
    ("undecodable-header-block", h2.headers_frame(1, b"\xff\xff\xff\xff"), h2.COMPRESSION_ERROR),
    ("table-size-update-over-settings", h2.headers_frame(1, b"\x3f\xe2\x1f" + block(REQUEST)), h2.COMPRESSION_ERROR),
    ("headers-padding-too-long", h2.encode_frame(h2.HEADERS, h2.END_HEADERS | h2.PADDED, 1, b"\x05" + b"\x82"),
     h2.PROTOCOL_ERROR),
    ("data-padding-too-long", OPEN + h2.encode_frame(h2.DATA, h2.PADDED, 1, b"\x05abc"), h2.PROTOCOL_ERROR),
    ("padded-data-without-pad-length", OPEN + h2.encode_frame(h2.DATA, h2.PADDED, 1), h2.FRAME_SIZE_ERROR),
    ("header-block-over-header-list-size", header_frames(1, block(REQUEST) + bytes(h2.Limits().max_header_list_size)),
     h2.ENHANCE_YOUR_CALM),
    ("header-list-over-header-list-size", header_frames(1, block(REQUEST + [("x-big", "v" * 40000)] * 2)),
     h2.ENHANCE_YOUR_CALM),
    # header frames stay within the protocol's default frame size, whatever SETTINGS_MAX_FRAME_SIZE says
    ("headers-over-header-frame-size", h2.headers_frame(1, block(REQUEST) + bytes(h2.MAX_HEADER_FRAME_SIZE)),
     h2.FRAME_SIZE_ERROR),
    ("continuation-over-header-frame-size", request(1, end_headers=False)
     + h2.continuation_frame(1, bytes(h2.MAX_HEADER_FRAME_SIZE + 1)), h2.FRAME_SIZE_ERROR),
]


@pytest.mark.parametrize("data,code", [c[1:] for c in CONNECTION_ERRORS], ids=[c[0] for c in CONNECTION_ERRORS])
def test_connection_errors(data: bytes, code: int) -> None:
    assert connection_error(server(), data) == code


@pytest.mark.parametrize("data", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", h2.PREFACE + h2.ping_frame(bytes(8))],
                         ids=["not-http2", "first-frame-not-settings"])
def test_what_is_not_http2_is_refused_and_answered_with_nothing(data: bytes) -> None:
    conn = h2.Connection(h2.Side.SERVER)
    conn.initiate()
    conn.data_to_send()
    with pytest.raises(h2.H2ConnectionError) as info:
        conn.receive_bytes(data)
    assert info.value.code == h2.PROTOCOL_ERROR
    if data.startswith(h2.PREFACE):  # an HTTP/2 client is told why
        assert [hd.type for hd, _ in frames(conn.goaway(info.value.code))] == [h2.GOAWAY]
    else:
        assert conn.goaway(info.value.code) == b""


# -- stream errors (§5.4.2): RST_STREAM with the code; the connection goes on ------------------------
def with_request(*extra: tuple[str, str], drop: str = "", first: tuple[str, str] | None = None) -> list:
    headers = [(n, v) for n, v in REQUEST if n != drop] + list(extra)
    return [first, *headers] if first else headers


STREAM_ERRORS = [
    ("uppercase-field-name", request(1, headers=with_request(("X-Upper", "1"))), h2.PROTOCOL_ERROR),
    ("connection-specific-field", request(1, headers=with_request(("connection", "keep-alive"))), h2.PROTOCOL_ERROR),
    ("te-other-than-trailers", request(1, headers=with_request(("te", "gzip"))), h2.PROTOCOL_ERROR),
    ("missing-path", request(1, headers=with_request(drop=":path")), h2.PROTOCOL_ERROR),
    ("missing-method", request(1, headers=with_request(drop=":method")), h2.PROTOCOL_ERROR),
    ("missing-scheme", request(1, headers=with_request(drop=":scheme")), h2.PROTOCOL_ERROR),
    ("empty-path", request(1, headers=with_request(drop=":path", first=(":path", ""))), h2.PROTOCOL_ERROR),
    ("duplicate-method", request(1, headers=with_request(first=(":method", "POST"))), h2.PROTOCOL_ERROR),
    ("pseudo-after-regular", request(1, headers=with_request((":authority", "late"))), h2.PROTOCOL_ERROR),
    ("unknown-pseudo", request(1, headers=with_request(first=(":test", "1"))), h2.PROTOCOL_ERROR),
    ("response-pseudo-in-request", request(1, headers=with_request(first=(":status", "200"))), h2.PROTOCOL_ERROR),
    ("value-with-newline", request(1, headers=with_request(("x-a", "1\n2"))), h2.PROTOCOL_ERROR),
    ("value-with-leading-space", request(1, headers=with_request(("x-a", " 1"))), h2.PROTOCOL_ERROR),
    ("name-with-colon", request(1, headers=with_request(("x:a", "1"))), h2.PROTOCOL_ERROR),
    ("pseudo-in-trailers", OPEN + h2.headers_frame(1, block([(":path", "/")]), end_stream=True), h2.PROTOCOL_ERROR),
    ("trailers-without-end-stream", OPEN + h2.headers_frame(1, block([("x-a", "1")])), h2.PROTOCOL_ERROR),
    ("data-beyond-content-length", request(1, end_stream=False, headers=with_request(("content-length", "1")))
     + h2.data_frame(1, b"ab"), h2.PROTOCOL_ERROR),
    ("data-short-of-content-length", request(1, end_stream=False, headers=with_request(("content-length", "3")))
     + h2.data_frame(1, b"a") + h2.data_frame(1, b"b", end_stream=True), h2.PROTOCOL_ERROR),
    ("invalid-content-length", request(1, headers=with_request(("content-length", "²"))), h2.PROTOCOL_ERROR),
    ("data-on-half-closed-stream", request(1) + h2.data_frame(1, b"x"), h2.STREAM_CLOSED),
    ("headers-on-half-closed-stream", request(1) + h2.headers_frame(1, block([("x-a", "1")]), end_stream=True),
     h2.STREAM_CLOSED),
    ("stream-window-update-of-0", OPEN + h2.window_update_frame(1, 0), h2.PROTOCOL_ERROR),
    ("stream-window-over-2^31-1", OPEN + h2.window_update_frame(1, h2.MAX_WINDOW), h2.FLOW_CONTROL_ERROR),
    ("priority-self-dependency", OPEN + h2.priority_frame(1, 1), h2.PROTOCOL_ERROR),
    ("priority-of-4-bytes", OPEN + h2.encode_frame(h2.PRIORITY, 0, 1, bytes(4)), h2.FRAME_SIZE_ERROR),
    ("headers-self-dependency", request(1, depends_on=1), h2.PROTOCOL_ERROR),
]


@pytest.mark.parametrize("data,code", [c[1:] for c in STREAM_ERRORS], ids=[c[0] for c in STREAM_ERRORS])
def test_stream_errors_reset_only_the_stream(data: bytes, code: int) -> None:
    conn = server()
    events = conn.receive_bytes(data)
    resets = [e for e in events if isinstance(e, h2.StreamReset)]
    assert [(e.stream_id, e.error_code, e.by_peer) for e in resets] == [(1, code, False)]
    sent = [(hd.type, hd.stream_id, struct.unpack(">I", p)[0]) for hd, p in frames(conn.data_to_send()) if hd.type == h2.RST_STREAM]
    assert sent == [(h2.RST_STREAM, 1, code)]
    assert conn.open_streams == 0 and still_alive(conn)


def test_a_stream_over_the_concurrent_limit_is_refused() -> None:
    conn = server(h2.Limits(max_concurrent_streams=2))
    events = conn.receive_bytes(request(1, end_stream=False) + request(3, end_stream=False) + request(5, end_stream=False))
    assert [type(e).__name__ for e in events] == ["HeadersReceived", "HeadersReceived", "StreamReset"]
    assert events[2] == h2.StreamReset(5, h2.REFUSED_STREAM, by_peer=False, reason="SETTINGS_MAX_CONCURRENT_STREAMS exceeded")
    conn.receive_bytes(h2.rst_stream_frame(1, h2.CANCEL))  # a stream closes: there is room again
    assert isinstance(conn.receive_bytes(request(7, end_stream=False))[0], h2.HeadersReceived)


# -- what is accepted -------------------------------------------------------------------------------
def test_a_request_in_headers_and_continuations_with_padded_data() -> None:
    conn = server()
    whole = block(REQUEST + [("x-long", "v" * 300)])
    data = (h2.headers_frame(1, whole[:10], end_headers=False, padding=7, depends_on=0)
            + h2.continuation_frame(1, whole[10:100], end_headers=False) + h2.continuation_frame(1, whole[100:])
            + h2.data_frame(1, b"hello", padding=20) + h2.data_frame(1, b"", end_stream=True))
    events = conn.receive_bytes(data)
    assert events[0] == h2.HeadersReceived(1, REQUEST + [("x-long", "v" * 300)], end_stream=False, trailers=False)
    assert events[1:] == [h2.DataReceived(1, b"hello", False), h2.DataReceived(1, b"", True)]


IGNORED = [
    ("priority-on-idle-stream", h2.priority_frame(9, 0)),
    ("unknown-frame-type", h2.encode_frame(0x20, 0xFF, 1, b"whatever")),
    ("unknown-setting", h2.settings_frame([(0x99, 7)])),
    ("window-update-on-closed-stream", request(1) + h2.rst_stream_frame(1, h2.CANCEL) + h2.window_update_frame(1, 5)),
    ("rst-stream-on-closed-stream", request(1) + h2.rst_stream_frame(1, h2.CANCEL) + h2.rst_stream_frame(1, h2.CANCEL)),
    ("priority-on-closed-stream", request(1) + h2.rst_stream_frame(1, h2.CANCEL) + h2.priority_frame(1, 0)),
    ("ping-ack", h2.ping_frame(bytes(8), ack=True)),
    ("reserved-bit-of-stream-id", h2.encode_frame(h2.PRIORITY, 0, 0x80000003, struct.pack(">IB", 0, 15))),
]


@pytest.mark.parametrize("data", [c[1] for c in IGNORED], ids=[c[0] for c in IGNORED])
def test_frames_that_change_nothing_are_accepted(data: bytes) -> None:
    conn = server()
    conn.receive_bytes(data)
    assert still_alive(conn)


def test_what_a_peer_had_in_flight_when_we_reset_its_stream_is_ignored() -> None:
    conn = server()
    conn.receive_bytes(request(1, end_stream=False))
    conn.reset_stream(1, h2.NO_ERROR)
    events = conn.receive_bytes(h2.data_frame(1, b"late") + h2.headers_frame(1, block([("x-a", "1")]), end_stream=True))
    assert events == [] and still_alive(conn)


def test_closed_streams_are_forgotten() -> None:
    """Any number of streams, each cancelled before its end: nothing piles up, new ones open."""
    conn = server(h2.Limits(max_concurrent_streams=4, max_resets=10_000))
    for sid in range(1, 2001, 2):
        conn.receive_bytes(request(sid, end_stream=False) + h2.rst_stream_frame(sid, h2.CANCEL))
    assert conn.open_streams == 0
    assert isinstance(conn.receive_bytes(request(2001))[0], h2.HeadersReceived)


def test_settings_are_acknowledged_and_applied() -> None:
    conn = server()
    conn.receive_bytes(request(1))
    events = conn.receive_bytes(h2.settings_frame([(h2.MAX_FRAME_SIZE, 20000), (h2.INITIAL_WINDOW_SIZE, 100)]))
    assert events == [h2.SettingsReceived({h2.MAX_FRAME_SIZE: 20000, h2.INITIAL_WINDOW_SIZE: 100})]
    assert [hd.type for hd, _ in frames(conn.data_to_send())] == [h2.SETTINGS]
    assert conn.peer_max_frame_size == 20000 and conn.send_window(1) == 100


def test_our_settings_are_advertised() -> None:
    limits = h2.Limits(max_frame_size=1 << 20, max_header_list_size=1000, max_concurrent_streams=7, stream_window=1 << 20)
    conn = h2.Connection(h2.Side.SERVER, limits)
    conn.initiate()
    (settings, payload), (update, increment) = frames(conn.data_to_send())
    advertised = dict(struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6))
    assert advertised == {h2.MAX_FRAME_SIZE: 1 << 20, h2.MAX_HEADER_LIST_SIZE: 1000, h2.MAX_CONCURRENT_STREAMS: 7,
                          h2.INITIAL_WINDOW_SIZE: 1 << 20}
    assert (update.type, struct.unpack(">I", increment)[0]) == (h2.WINDOW_UPDATE, limits.connection_window - h2.DEFAULT_WINDOW)


# -- flow control ------------------------------------------------------------------------------------
def test_sending_stays_within_the_peers_windows() -> None:
    conn = server()
    conn.receive_bytes(request(1) + h2.settings_frame([(h2.INITIAL_WINDOW_SIZE, 10)]))
    conn.send_headers(1, [(":status", "200")])
    assert conn.send_window(1) == 10
    with pytest.raises(ValueError):
        conn.send_data(1, 11)
    head = conn.send_data(1, 10)
    assert frames(head)[-1][0] == h2.FrameHeader(10, h2.DATA, 0, 1, 10)
    assert conn.send_window(1) == 0
    assert conn.receive_bytes(h2.window_update_frame(1, 5)) == [h2.WindowUpdated(1)]
    assert conn.send_window(1) == 5
    conn.receive_bytes(h2.settings_frame([(h2.INITIAL_WINDOW_SIZE, 0)]))  # a smaller window counts what was sent
    assert conn.send_window(1) == -5


def test_the_connection_window_is_shared_by_all_streams() -> None:
    conn = server()
    conn.receive_bytes(request(1) + request(3))
    for sid in (1, 3):
        conn.send_headers(sid, [(":status", "200")])
    conn.send_data(1, 16384)
    conn.send_data(1, 16384)
    conn.send_data(1, 16384)
    assert conn.send_window(3) == h2.DEFAULT_WINDOW - 3 * 16384
    assert conn.receive_bytes(h2.window_update_frame(0, 100)) == [h2.WindowUpdated(0)]
    assert conn.send_window(3) == h2.DEFAULT_WINDOW - 3 * 16384 + 100


def test_received_data_is_credited_back() -> None:
    limits = h2.Limits(stream_window=1 << 16, connection_window=1 << 17)
    conn = server(limits)
    conn.receive_bytes(request(1, end_stream=False))
    conn.receive_bytes(h2.data_frame(1, bytes(16384)))
    updates = [(hd.stream_id, struct.unpack(">I", p)[0]) for hd, p in frames(conn.data_to_send()) if hd.type == h2.WINDOW_UPDATE]
    assert updates == [(1, 16384)]  # a quarter of the stream's window
    for _ in range(3):
        conn.receive_bytes(h2.data_frame(1, bytes(16384)))
    updates = [(hd.stream_id, struct.unpack(">I", p)[0]) for hd, p in frames(conn.data_to_send()) if hd.type == h2.WINDOW_UPDATE]
    assert updates == [(1, 16384), (1, 16384), (0, 1 << 16), (1, 16384)]  # the connection's at half its window


def test_data_beyond_a_window_is_refused() -> None:
    conn = server(h2.Limits(stream_window=h2.DEFAULT_WINDOW))
    conn.receive_bytes(request(1, end_stream=False) + request(3, end_stream=False))
    events = conn.receive_bytes(h2.data_frame(1, bytes(h2.DEFAULT_WINDOW + 1)) + h2.data_frame(3, bytes(h2.DEFAULT_WINDOW)))
    assert [(type(e), e.stream_id) for e in events] == [(h2.StreamReset, 1), (h2.DataReceived, 3)]
    assert events[0].error_code == h2.FLOW_CONTROL_ERROR
    small = server(h2.Limits(connection_window=h2.DEFAULT_WINDOW, stream_window=1 << 20))
    small.receive_bytes(request(1, end_stream=False))
    assert connection_error(small, h2.data_frame(1, bytes(h2.DEFAULT_WINDOW + 1))) == h2.FLOW_CONTROL_ERROR


# -- the frame-by-frame API ---------------------------------------------------------------------------
def test_a_frame_header_is_checked_before_its_payload_is_read() -> None:
    conn = server()
    too_long = h2.frame_header(h2.Limits().max_frame_size + 1, h2.DATA, 0, 1)
    with pytest.raises(h2.H2ConnectionError) as info:
        conn.receive_header(too_long)
    assert info.value.code == h2.FRAME_SIZE_ERROR
    headers_too_long = h2.frame_header(h2.MAX_HEADER_FRAME_SIZE + 1, h2.HEADERS, h2.END_HEADERS, 1)
    with pytest.raises(h2.H2ConnectionError) as info:
        server().receive_header(headers_too_long)
    assert info.value.code == h2.FRAME_SIZE_ERROR
    conn = server()
    conn.receive_bytes(header_frames(1, bytes(h2.Limits().max_header_list_size - 1), end_headers=False))
    with pytest.raises(h2.H2ConnectionError) as info:
        conn.receive_header(h2.frame_header(2, h2.CONTINUATION, h2.END_HEADERS, 1))
    assert info.value.code == h2.ENHANCE_YOUR_CALM


def test_data_is_handed_to_the_caller_with_its_padding_accounted() -> None:
    conn = server()
    conn.receive_bytes(request(1, end_stream=False))
    frame = h2.data_frame(1, b"payload", padding=3, end_stream=True)
    header = conn.receive_header(frame[:9])
    assert header.keep == 0
    assert conn.receive_data(header, frame[9:10]) == h2.DataFrame(1, 7, 3, end_stream=True, accepted=True)


def test_goaway_debug_data_is_kept_up_to_a_frame_of_the_default_size() -> None:
    conn = server(h2.Limits(max_frame_size=1 << 20))
    header = conn.receive_header(h2.goaway_frame(1, h2.NO_ERROR, bytes(100_000))[:9])
    assert (header.length, header.keep) == (100_008, h2.BUFFERED_PAYLOAD_MAX)
    assert conn.receive_header(h2.encode_frame(0x33, 0, 0, bytes(50))[:9]).keep == 0  # unknown frames: dropped


# -- flood limits: ENHANCE_YOUR_CALM past the limit within a period, a fresh count after ---------------
FLOODS = [
    ("max_settings", lambda i: h2.settings_frame()),
    ("max_pings", lambda i: h2.ping_frame(bytes(8))),
    ("max_empty_frames", lambda i: h2.data_frame(1, b"")),
    ("max_continuations", lambda i: h2.continuation_frame(1, b"", end_headers=False)),
    ("max_resets", lambda i: request(2 * i + 3, end_stream=False) + h2.rst_stream_frame(2 * i + 3, h2.CANCEL)),
]


@pytest.mark.parametrize("limit_name,frame", [c for c in FLOODS], ids=[c[0] for c in FLOODS])
def test_floods_end_the_connection(limit_name: str, frame) -> None:
    clock = Clock()
    limits = h2.Limits(**{"max_empty_frames": 100_000, "max_continuations": 100_000, limit_name: 5})
    conn = server(limits, clock)
    # the handshake's SETTINGS counts; an open header block for CONTINUATIONs; an open stream for DATA
    conn.receive_bytes(request(1, end_stream=False, end_headers=limit_name != "max_continuations"))
    start = 1 if limit_name == "max_settings" else 0
    for i in range(start, 5):
        conn.receive_bytes(frame(i))
    clock.now += limits.flood_period  # a new period: counting starts over
    for i in range(5, 10):
        conn.receive_bytes(frame(i))
    assert connection_error(conn, frame(10)) == h2.ENHANCE_YOUR_CALM


def test_idle_time_counts_from_the_last_stream_activity_not_pings() -> None:
    clock = Clock()
    conn = server(clock=clock)
    clock.now += 50
    conn.receive_bytes(h2.ping_frame(bytes(8)) + h2.settings_frame() + h2.window_update_frame(0, 1))
    assert conn.idle_for == 50
    conn.receive_bytes(request(1))
    assert conn.idle_for == 0
    clock.now += 3
    conn.send_headers(1, [(":status", "200")], end_stream=True)
    assert conn.idle_for == 0


# -- header fields ---------------------------------------------------------------------------------------
VALID = [
    (h2.HeaderKind.REQUEST, [(":method", "GET"), (":scheme", "https"), (":path", "/a?b"), ("accept", "*/*")]),
    (h2.HeaderKind.REQUEST, [(":method", "CONNECT"), (":authority", "host:443")]),
    (h2.HeaderKind.REQUEST, [(":method", "POST"), (":scheme", "http"), (":path", "/"), ("te", "trailers")]),
    (h2.HeaderKind.RESPONSE, [(":status", "200"), ("grpc-message", "a%20b"), ("x-bin", "\x80\xff")]),
    (h2.HeaderKind.TRAILERS, [("grpc-status", "0"), ("x", "")]),
]
INVALID = [
    (h2.HeaderKind.REQUEST, [(":method", "CONNECT"), (":authority", "h"), (":path", "/")]),
    (h2.HeaderKind.REQUEST, [(":method", "GET"), (":scheme", "http"), (":path", "/"), ("", "empty name")]),
    (h2.HeaderKind.REQUEST, [(":method", "GET"), (":scheme", "http"), (":path", "/"), ("a b", "1")]),
    (h2.HeaderKind.REQUEST, [(":method", "GET"), (":scheme", "http"), (":path", "/"), ("upgrade", "h2c")]),
    (h2.HeaderKind.REQUEST, [(":method", "GET"), (":scheme", "http"), (":path", "/"), ("transfer-encoding", "chunked")]),
    (h2.HeaderKind.REQUEST, [(":method", "GET"), (":scheme", "http"), (":path", "/"), ("x", "a\x00b")]),
    (h2.HeaderKind.REQUEST, [(":method", "GET"), (":scheme", "http"), (":path", "/"), ("x", "trailing\t")]),
    (h2.HeaderKind.RESPONSE, [(":status", "20")]),
    (h2.HeaderKind.RESPONSE, [(":status", "２００")]),
    (h2.HeaderKind.RESPONSE, [("x", "no status")]),
    (h2.HeaderKind.RESPONSE, [(":status", "200"), (":path", "/")]),
    (h2.HeaderKind.TRAILERS, [(":status", "200")]),
]


@pytest.mark.parametrize("kind,fields", VALID)
def test_valid_header_lists(kind: h2.HeaderKind, fields: list[tuple[str, str]]) -> None:
    raw = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in fields]
    assert h2.validate_headers(raw, kind) == fields


@pytest.mark.parametrize("kind,fields", INVALID)
def test_invalid_header_lists(kind: h2.HeaderKind, fields: list[tuple[str, str]]) -> None:
    with pytest.raises(h2.MalformedHeaders):
        h2.validate_headers([(n.encode("utf-8"), v.encode("utf-8")) for n, v in fields], kind)


# -- the client side ----------------------------------------------------------------------------------------
def test_a_client_call_from_request_to_trailers() -> None:
    client = h2.Connection(h2.Side.CLIENT)
    client.initiate()
    opening = client.data_to_send()
    assert opening.startswith(h2.PREFACE)
    client.receive_bytes(h2.settings_frame([(h2.MAX_FRAME_SIZE, 1 << 20)]))  # large frames: for DATA only
    sid = client.new_stream_id()
    client.send_headers(sid, REQUEST + [("x-big", "v" * 40000)])  # larger than a header frame: HEADERS + CONTINUATIONs
    sent = frames(client.data_to_send())
    assert [hd.type for hd, _ in sent] == [h2.SETTINGS, h2.HEADERS, h2.CONTINUATION, h2.CONTINUATION]
    assert all(hd.length <= h2.MAX_HEADER_FRAME_SIZE for hd, _ in sent) and sent[-1][0].flags & h2.END_HEADERS
    head = client.send_data(sid, 3, end_stream=True)
    assert frames(head + b"abc") == [(h2.FrameHeader(3, h2.DATA, h2.END_STREAM, 1, 3), b"abc")]
    events = client.receive_bytes(h2.headers_frame(1, block([(":status", "200")])) + h2.data_frame(1, b"reply")
                                  + h2.headers_frame(1, block([("grpc-status", "0")]), end_stream=True))
    assert events == [h2.HeadersReceived(1, [(":status", "200")], False, False), h2.DataReceived(1, b"reply", False),
                      h2.HeadersReceived(1, [("grpc-status", "0")], True, True)]
    with pytest.raises(h2.StreamClosedError):
        client.send_data(1, 0)


@pytest.mark.parametrize("data,code", [
    (h2.settings_frame([(h2.ENABLE_PUSH, 1)]), h2.PROTOCOL_ERROR),  # a server may not enable push
    (h2.settings_frame() + h2.headers_frame(3, block([(":status", "200")])), h2.PROTOCOL_ERROR),  # an idle stream
    (h2.settings_frame() + h2.push_promise_frame(1, 2, b""), h2.PROTOCOL_ERROR),
], ids=["enable-push", "response-on-idle-stream", "push-promise"])
def test_client_side_connection_errors(data: bytes, code: int) -> None:
    client = h2.Connection(h2.Side.CLIENT)
    client.initiate()
    client.data_to_send()
    assert connection_error(client, data) == code


def test_frame_header_round_trip() -> None:
    for length, ftype, flags, sid in [(0, 0, 0, 0), ((1 << 24) - 1, 9, 0xFF, (1 << 31) - 1), (300, 4, 1, 7)]:
        assert h2.parse_frame_header(h2.frame_header(length, ftype, flags, sid)) == (length, ftype, flags, sid, length)


def test_limits_are_validated() -> None:
    for bad in ({"max_frame_size": 16383}, {"max_frame_size": 1 << 24}, {"stream_window": 0}, {"max_pings": 0},
                {"flood_period": 0}):
        with pytest.raises(ValueError):
            h2.Limits(**bad)
