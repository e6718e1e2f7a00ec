"""The gRPC API (our HTTP/2 server) against the stock grpcio client."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from conftest import OPERATOR_TOKEN, RunningNode, wait_for
from lifl import format as fmt
from lifl import kernels
from lifl.net import lifl_pb2 as pb
from lifl.net import h2

MODEL = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float32)}
UPDATE = bytes(fmt.encode({"w": np.ones((3, 4), np.float32), "b": np.ones(4, np.float32)}))


@pytest.fixture
def stub(node: RunningNode):
    s = node.grpc_stub()
    s.CreateJob(pb.CreateJobRequest(job="j", goal=4))
    s.SetModel(iter([pb.ModelChunk(meta=pb.ModelMeta(job="j")), pb.ModelChunk(data=bytes(fmt.encode(MODEL)))]))
    return s


def meta(**kw) -> pb.UpdateMeta:
    return pb.UpdateMeta(**{"job": "j", "client": "c", "samples": 3, "base_version": 0, **kw})


def chunks(m: pb.UpdateMeta, blob: bytes = UPDATE, size: int = 50):
    yield pb.UpdateChunk(meta=m)
    for i in range(0, len(blob), size):
        yield pb.UpdateChunk(data=bytes(blob[i : i + size]))


def error_of(call) -> tuple[grpc.StatusCode, str, dict]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    e = info.value
    return e.code(), e.details(), dict(e.trailing_metadata() or ())


@pytest.mark.slow
def test_push_update_meta_in_first_message_and_data_in_any_pieces(node: RunningNode, stub) -> None:
    # meta and the first data in one message, then pieces of odd sizes
    first = pb.UpdateChunk(meta=meta(size=len(UPDATE)), data=bytes(UPDATE[:33]))
    rest = [pb.UpdateChunk(data=bytes(UPDATE[i : i + 7])) for i in range(33, len(UPDATE), 7)]
    reply = stub.PushUpdate(iter([first, *rest]))
    assert reply.version == 0 and reply.ListFields() == []  # version 0 is the default: nothing else in the reply
    status = stub.GetJob(pb.GetJobRequest(job="j"))
    assert status.round.received == 1 and status.version == 0


BAD_STREAMS = [
    ("no-meta", lambda: iter([pb.UpdateChunk(data=bytes(UPDATE))]), grpc.StatusCode.INVALID_ARGUMENT, "missing_meta"),
    ("empty-stream", lambda: iter([]), grpc.StatusCode.INVALID_ARGUMENT, "missing_meta"),
    ("duplicate-meta", lambda: iter([pb.UpdateChunk(meta=meta()), pb.UpdateChunk(meta=meta())]), grpc.StatusCode.INVALID_ARGUMENT, "duplicate_meta"),
    ("bad-samples", lambda: chunks(meta(samples=0)), grpc.StatusCode.INVALID_ARGUMENT, "bad_header"),
    ("bad-client", lambda: chunks(meta(client="")), grpc.StatusCode.INVALID_ARGUMENT, "bad_client"),
    ("unknown-job", lambda: chunks(meta(job="nope")), grpc.StatusCode.NOT_FOUND, "no_such_job"),
    ("stale", lambda: chunks(meta(base_version=3)), grpc.StatusCode.ABORTED, "version_conflict"),
    ("truncated", lambda: chunks(meta(), UPDATE[:-1]), grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
    ("trailing", lambda: chunks(meta(), UPDATE + b"x"), grpc.StatusCode.INVALID_ARGUMENT, "trailing_bytes"),
    ("size-mismatch", lambda: chunks(meta(size=len(UPDATE) + 1)), grpc.StatusCode.INVALID_ARGUMENT, "length_mismatch"),
    ("nan", lambda: chunks(meta(), fmt.encode({"w": np.full((3, 4), np.nan, np.float32), "b": np.ones(4, np.float32)})),
     grpc.StatusCode.INVALID_ARGUMENT, "non_finite"),
    ("wrong-tensors", lambda: chunks(meta(), fmt.encode({"w": np.ones((3, 4), np.float32)})), grpc.StatusCode.INVALID_ARGUMENT, "missing_tensor"),
]


@pytest.mark.slow
@pytest.mark.parametrize("make,code,lifl_code", [c[1:] for c in BAD_STREAMS], ids=[c[0] for c in BAD_STREAMS])
def test_bad_update_streams(node: RunningNode, stub, make, code, lifl_code) -> None:
    got, details, trailers = error_of(lambda: stub.PushUpdate(make()))
    assert (got, trailers.get("lifl-error-code")) == (code, lifl_code), details
    if lifl_code == "version_conflict":
        assert trailers["lifl-version"] == "0"
    status = stub.GetJob(pb.GetJobRequest(job="j"))
    assert status.round.received == 0 and status.round.in_progress == 0


def raw_push(node: RunningNode, messages: list[bytes], **kw):
    """PushUpdate with hand-made message bytes (grpcio only frames them)."""
    call = grpc.insecure_channel(node.grpc).stream_unary(
        "/lifl.v1.Gateway/PushUpdate", request_serializer=lambda b: b, response_deserializer=pb.PushUpdateReply.FromString)
    return call(iter(messages), metadata=[("authorization", f"Bearer {OPERATOR_TOKEN}")], **kw)


def field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2]) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


RAW_STREAMS = [
    ("truncated-field", [field(1, meta().SerializeToString())[:-2]], "bad_request"),
    ("bad-varint", [b"\x0a" + b"\xff" * 11], "bad_request"),
    ("group-wire-type", [b"\x0b"], "bad_request"),
    ("garbage-meta", [field(1, b"\xff\xff\xff")], "bad_request"),
]


@pytest.mark.slow
@pytest.mark.parametrize("messages,lifl_code", [c[1:] for c in RAW_STREAMS], ids=[c[0] for c in RAW_STREAMS])
def test_malformed_protobuf_in_update_stream(node: RunningNode, stub, messages, lifl_code) -> None:
    got, details, trailers = error_of(lambda: raw_push(node, messages))
    assert (got, trailers.get("lifl-error-code")) == (grpc.StatusCode.INVALID_ARGUMENT, lifl_code), details


@pytest.mark.slow
def test_unknown_fields_are_skipped_and_compression_is_refused(node: RunningNode, stub) -> None:
    extra = b"\x18\x05" + b"\x21" + bytes(8) + b"\x2d" + bytes(4) + field(7, b"ignored")  # varint, fixed64, fixed32, bytes
    reply = raw_push(node, [field(1, meta().SerializeToString()) + extra, field(2, bytes(UPDATE)) + extra])
    assert reply.version == 0
    got, _, _ = error_of(lambda: stub.PushUpdate(chunks(meta()), compression=grpc.Compression.Gzip))
    assert got == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.slow
def test_back_pressure_is_resource_exhausted_with_pushback(node: RunningNode) -> None:
    s = node.grpc_stub()
    s.CreateJob(pb.CreateJobRequest(job="bp", goal=3, max_inflight=1))
    s.SetModel(iter([pb.ModelChunk(meta=pb.ModelMeta(job="bp"), data=bytes(fmt.encode(MODEL)))]))
    s.PushUpdate(chunks(meta(job="bp")))
    got, _, trailers = error_of(lambda: s.PushUpdate(chunks(meta(job="bp", client="d"))))
    assert got == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailers["lifl-error-code"] == "inflight_budget" and int(trailers["grpc-retry-pushback-ms"]) >= 1000


@pytest.mark.slow
def test_jobs_over_grpc(node: RunningNode) -> None:
    s = node.grpc_stub()
    status = s.CreateJob(pb.CreateJobRequest(job="g", goal=2, tenant="acme", leaf_fan_in=3))
    assert (status.tenant, status.leaf_fan_in, status.version) == ("acme", 3, -1)
    got, _, trailers = error_of(lambda: s.CreateJob(pb.CreateJobRequest(job="g", goal=2)))
    assert got == grpc.StatusCode.ALREADY_EXISTS and trailers["lifl-error-code"] == "job_exists"
    got, _, _ = error_of(lambda: s.CreateJob(pb.CreateJobRequest(job="Bad Name", goal=2)))
    assert got == grpc.StatusCode.INVALID_ARGUMENT
    assert error_of(lambda: s.GetJob(pb.GetJobRequest(job="none")))[0] == grpc.StatusCode.NOT_FOUND
    got, _, trailers = error_of(lambda: list(s.GetModel(pb.GetModelRequest(job="g"))))
    assert trailers["lifl-error-code"] == "no_model"
    call = grpc.insecure_channel(node.grpc).unary_unary("/lifl.v1.Gateway/Nope")
    assert error_of(lambda: call(b""))[0] == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.slow
def test_large_model_streams_back_within_flow_control_and_concurrent_uploads_share_a_connection(node: RunningNode) -> None:
    rng = np.random.default_rng(0)
    big = {"w": rng.standard_normal((4 << 20) // 4).astype(np.float32), "b": np.ones(3, np.float32)}  # 16 MiB
    blob = fmt.encode(big)
    s = node.grpc_stub()
    s.CreateJob(pb.CreateJobRequest(job="big", goal=6, max_inflight=6))
    s.SetModel(chunks_model("big", blob))
    out = list(s.GetModel(pb.GetModelRequest(job="big")))
    assert b"".join(c.data for c in out) == blob and out[0].meta.size == len(blob)
    # six concurrent uploads multiplexed on one channel (one HTTP/2 connection)
    updates = [{"w": rng.standard_normal(big["w"].shape).astype(np.float32), "b": np.ones(3, np.float32)} for _ in range(6)]
    errors = []

    def push(i: int) -> None:
        try:
            s.PushUpdate(chunks(meta(job="big", client=str(i)), fmt.encode(updates[i]), size=1 << 20))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    wait_for(lambda: s.GetJob(pb.GetJobRequest(job="big")).version == 1, what="version 1")
    data = b"".join(c.data for c in s.GetModel(pb.GetModelRequest(job="big")))
    got = fmt.views(data, kernels.validate(data))["w"]
    ref = sum(u["w"].astype(np.float64) for u in updates) / 6
    assert np.all(np.abs(got - ref) <= 1e-5 * (np.abs(ref) + 1e-3))


def chunks_model(job: str, blob: bytes):
    yield pb.ModelChunk(meta=pb.ModelMeta(job=job, size=len(blob)))
    for i in range(0, len(blob), 1 << 20):
        yield pb.ModelChunk(data=bytes(blob[i : i + (1 << 20)]))


OPENING = h2.PREFACE + h2.settings_frame()


def goaway_code(node: RunningNode, data: bytes) -> int | None:
    host, port = node.grpc.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        while buf:  # find GOAWAY among the server's frames
            length, ftype = int.from_bytes(buf[:3], "big"), buf[3]
            if ftype == 7:
                return struct.unpack(">I", buf[13:17])[0]
            buf = buf[9 + length :]
    return None


@pytest.mark.slow
@pytest.mark.parametrize("data,code", [
    (h2.PREFACE + h2.encode_frame(h2.SETTINGS, 0, 0, bytes(5)), h2.FRAME_SIZE_ERROR),
    (h2.PREFACE + h2.ping_frame(bytes(8)), h2.PROTOCOL_ERROR),  # the first frame must be SETTINGS
    (OPENING + h2.continuation_frame(1, b""), h2.PROTOCOL_ERROR),
    (OPENING + h2.headers_frame(2, b"\x82"), h2.PROTOCOL_ERROR),  # an even (server) stream id
    (OPENING + h2.headers_frame(1, b"\xff\xff\xff\xff"), h2.COMPRESSION_ERROR),  # an undecodable header block
], ids=["settings-size", "first-not-settings", "stray-continuation", "even-stream", "bad-hpack"])
def test_http2_protocol_errors_end_in_goaway(node: RunningNode, data: bytes, code: int) -> None:
    assert goaway_code(node, data) == code


@pytest.mark.slow
def test_a_request_that_is_not_grpc_is_answered_415(node: RunningNode) -> None:
    client = h2.Connection(h2.Side.CLIENT)
    client.initiate()
    client.send_headers(1, [(":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "x")], end_stream=True)
    host, port = node.grpc.rsplit(":", 1)
    events: list[h2.Event] = []
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(client.data_to_send())
        while not any(isinstance(e, h2.DataReceived) and e.end_stream for e in events):
            events += client.receive_bytes(s.recv(65536))
            s.sendall(client.data_to_send())
    response = next(e for e in events if isinstance(e, h2.HeadersReceived))
    assert dict(response.headers)[":status"] == "415"
    assert b"gRPC" in b"".join(e.data for e in events if isinstance(e, h2.DataReceived))


@pytest.mark.slow
def test_not_http2_is_closed(node: RunningNode) -> None:
    assert goaway_code(node, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") is None


@pytest.mark.slow
def test_replies_respect_flow_control_while_a_model_streams_on_the_same_connection(node: RunningNode) -> None:
    """A model download spends the client's windows; small replies on the same connection must
    wait for them rather than overflow them (which makes grpcio drop the stream)."""
    s = node.grpc_stub()
    blob = fmt.encode({"w": np.ones((8 << 20) // 4, np.float32)})
    s.CreateJob(pb.CreateJobRequest(job="fc", goal=20, max_inflight=20))  # more than the pushes, so the round stays open
    s.SetModel(chunks_model("fc", blob))
    errors: list[Exception] = []
    stop = threading.Event()

    def download() -> None:
        while not stop.is_set():
            try:
                for _ in s.GetModel(pb.GetModelRequest(job="fc")):
                    time.sleep(0.002)  # a slow reader keeps the windows spent
            except Exception as e:
                errors.append(e)
                return

    readers = [threading.Thread(target=download) for _ in range(2)]
    for t in readers:
        t.start()
    small = fmt.encode({"w": np.ones((8 << 20) // 4, np.float32)})
    for i in range(6):
        s.GetJob(pb.GetJobRequest(job="fc"))
        s.PushUpdate(chunks(meta(job="fc", client=str(i)), small, size=1 << 20))
    stop.set()
    for t in readers:
        t.join()
    assert not errors
