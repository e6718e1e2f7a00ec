"""lifl's own gRPC upload client against grpcio's server: standard gRPC on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from lifl.errors import BadRequest, Conflict, Overloaded, Unavailable
from lifl.net import lifl_pb2 as pb
from lifl.client.grpcwire import GRPC_STATUS, GrpcStatusError, UploadConnection, chunk_messages
from lifl.net.grpc import call_result, message_prefix, status_trailers


RECEIVED: dict[str, tuple[int, int, str]] = {}  # by client: bytes, their sum, the authorization metadata


@pytest.fixture
def grpcio_server() -> Iterator[str]:
    def push(requests, context):
        meta, data = None, bytearray()
        for chunk in requests:
            if chunk.HasField("meta"):
                meta = chunk.meta
            data += chunk.data
        if meta.client == "refuse":
            context.set_trailing_metadata((("lifl-error-code", "non_finite"),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tensor 'w' element 3 is NaN")
        RECEIVED[meta.client] = (len(data), int(np.frombuffer(data, np.uint8).sum()),
                                 dict(context.invocation_metadata()).get("authorization", ""))
        return pb.PushUpdateReply(version=meta.base_version)

    handler = grpc.method_handlers_generic_handler("lifl.v1.Gateway", {
        "PushUpdate": grpc.stream_unary_rpc_method_handler(
            push, request_deserializer=pb.UpdateChunk.FromString, response_serializer=pb.PushUpdateReply.SerializeToString),
    })
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler],
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_client_streams_to_a_grpcio_server(grpcio_server: str) -> None:
    blob = np.random.default_rng(0).integers(0, 256, 5_000_000, dtype=np.uint8).tobytes()  # many frames, past the windows
    conn = UploadConnection(grpcio_server)
    try:
        for i, chunk in enumerate((1 << 20, 4096, len(blob))):  # several calls on one connection
            meta = pb.UpdateMeta(client=f"c{i}", base_version=7).SerializeToString()
            reply = pb.PushUpdateReply.FromString(conn.call("/lifl.v1.Gateway/PushUpdate", chunk_messages(meta, blob, chunk),
                                                            [("authorization", f"Bearer t{i}")]))
            assert reply.version == 7
            assert RECEIVED[f"c{i}"] == (len(blob), int(np.frombuffer(blob, np.uint8).sum()), f"Bearer t{i}")
        meta = pb.UpdateMeta(client="refuse").SerializeToString()
        with pytest.raises(GrpcStatusError) as info:
            conn.call("/lifl.v1.Gateway/PushUpdate", chunk_messages(meta, b"abc", 1024))
        e = info.value
        assert (e.status, e.message, e.trailers["lifl-error-code"]) == (GRPC_STATUS["INVALID_ARGUMENT"], "tensor 'w' element 3 is NaN", "non_finite")
        meta = pb.UpdateMeta(client="after").SerializeToString()
        conn.call("/lifl.v1.Gateway/PushUpdate", chunk_messages(meta, b"xy", 1024))
        assert RECEIVED["after"] == (2, ord("x") + ord("y"), "")
    finally:
        conn.close()


def test_unknown_method_is_reported(grpcio_server: str) -> None:
    conn = UploadConnection(grpcio_server)
    with pytest.raises(GrpcStatusError) as info:
        conn.call("/lifl.v1.Gateway/Nope", chunk_messages(b"", b"", 16))
    assert info.value.status == GRPC_STATUS["UNIMPLEMENTED"]
    conn.close()


# -- gRPC's framing as server and client share it (lifl.net.grpc) --------------------------------------------
@pytest.mark.parametrize("error,expected", [
    (Unavailable("redis is down", retry_after=2.5),
     {"grpc-status": "14", "grpc-message": "redis is down", "lifl-error-code": "unavailable", "grpc-retry-pushback-ms": "2500"}),
    (Overloaded("no memory", code="shm_full"), {"grpc-status": "8", "lifl-error-code": "shm_full", "grpc-retry-pushback-ms": "1000"}),
    (Conflict("stale", code="version_conflict", extra={"version": 4}), {"grpc-status": "10", "lifl-version": "4"}),
    (BadRequest("bad\nline ü%"), {"grpc-status": "3", "grpc-message": "bad%0Aline %C3%BC%25"}),
], ids=["unavailable", "overloaded", "conflict", "message-escaped"])
def test_lifl_errors_travel_in_trailers(error, expected: dict[str, str]) -> None:
    trailers = dict(status_trailers(error))
    assert trailers.items() >= expected.items()
    assert ("grpc-retry-pushback-ms" in trailers) == (error.retry_after is not None)
    with pytest.raises(GrpcStatusError) as info:
        call_result(trailers, b"")
    assert (info.value.status, info.value.message) == (int(expected["grpc-status"]), error.message)


@pytest.mark.parametrize("trailers,body,status", [
    ({"grpc-status": "0"}, message_prefix(3) + b"abc", None),
    ({"grpc-status": "0"}, b"", GRPC_STATUS["INTERNAL"]),  # no message
    ({"grpc-status": "0"}, message_prefix(4) + b"abc", GRPC_STATUS["INTERNAL"]),  # truncated
    ({"grpc-status": "0"}, b"\x01" + message_prefix(3)[1:] + b"abc", GRPC_STATUS["INTERNAL"]),  # compressed
    ({}, message_prefix(3) + b"abc", GRPC_STATUS["UNKNOWN"]),  # no status at all
    ({"grpc-status": "x"}, b"", GRPC_STATUS["UNKNOWN"]),
])
def test_a_reply_is_one_message_and_an_ok_status(trailers: dict[str, str], body: bytes, status: int | None) -> None:
    if status is None:
        assert call_result(trailers, body) == b"abc"
        return
    with pytest.raises(GrpcStatusError) as info:
        call_result(trailers, body)
    assert info.value.status == status


def test_blob_messages_carry_the_blob_in_views() -> None:
    blob = bytes(range(256)) * 10
    messages = list(chunk_messages(b"meta", blob, 1000))
    assert [bytes(m[0]) for m in messages[:1]] == [message_prefix(6) + b"\x0a\x04meta"]
    assert all(isinstance(m[1], memoryview) for m in messages[1:])  # no copy of the blob
    data = [pb.UpdateChunk.FromString(b"".join(bytes(p) for p in m)[5:]).data for m in messages[1:]]
    assert b"".join(data) == blob and [len(d) for d in data] == [1000, 1000, 560]
