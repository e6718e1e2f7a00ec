"""lifl's own gRPC upload client against grpcio's server: standard gRPC on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from lifl.gateway import lifl_pb2 as pb
from lifl.grpcwire import GRPC_STATUS, GrpcStatusError, UploadConnection, chunk_messages


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
        return pb.PushUpdateReply(key=f"{len(data)}:{meta.client}:{int(np.frombuffer(data, np.uint8).sum())}", version=meta.base_version)

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
            reply = pb.PushUpdateReply.FromString(conn.call("/lifl.v1.Gateway/PushUpdate", chunk_messages(meta, blob, chunk)))
            assert reply.key == f"{len(blob)}:c{i}:{int(np.frombuffer(blob, np.uint8).sum())}" and reply.version == 7
        meta = pb.UpdateMeta(client="refuse").SerializeToString()
        with pytest.raises(GrpcStatusError) as info:
            conn.call("/lifl.v1.Gateway/PushUpdate", chunk_messages(meta, b"abc", 1024))
        e = info.value
        assert (e.status, e.message, e.trailers["lifl-error-code"]) == (GRPC_STATUS["INVALID_ARGUMENT"], "tensor 'w' element 3 is NaN", "non_finite")
        meta = pb.UpdateMeta(client="after").SerializeToString()
        assert pb.PushUpdateReply.FromString(conn.call("/lifl.v1.Gateway/PushUpdate", chunk_messages(meta, b"xy", 1024))).key.startswith("2:after")
    finally:
        conn.close()


def test_unknown_method_is_reported(grpcio_server: str) -> None:
    conn = UploadConnection(grpcio_server)
    with pytest.raises(GrpcStatusError) as info:
        conn.call("/lifl.v1.Gateway/Nope", chunk_messages(b"", b"", 16))
    assert info.value.status == GRPC_STATUS["UNIMPLEMENTED"]
    conn.close()
