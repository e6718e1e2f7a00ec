"""The reference of `lifl bench throughput`: the smallest server that answers the clients'
updates, to show how far each system is from what answering a request costs at all.

One thread, one selectors loop, keep-alive connections. Over HTTP/1.1 it reads a request's
head into a buffer, its body (by Content-Length) with ``recv_into`` into one preallocated
buffer, and answers 202 with a short JSON body. Over gRPC it speaks just enough HTTP/2 for the
clients of ``lifl.bench.loadgen``: it acknowledges SETTINGS, opens the connection's window at
once and keeps it open, drops each DATA payload as it reads it, and answers each stream that
ends with response headers, a ``PushUpdateReply`` and OK trailers (header blocks encoded once,
as literals, so they need no HPACK state). Nothing is validated: that is the systems' work.

``python -m lifl.bench.requestsink http|grpc`` prints its port and serves until killed.
"""

from __future__ import annotations

import re
import selectors
import socket
import struct
import sys

import hpack

from lifl.net import lifl_pb2 as pb
from lifl.net import h2
from lifl.net.grpc import message_prefix

BODY_BUFFER = 8 << 20  # the largest body the reference reads (bench updates are at most 400 KB)
RECEIVE_BYTES = 1 << 18
HTTP_REPLY = b'HTTP/1.1 202 Accepted\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{"version": 0}\n'
WINDOW = h2.MAX_WINDOW
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *([0-9]+)\r\n", re.IGNORECASE)


def _literal_block(headers: list[tuple[str, str]]) -> bytes:
    """A header block of literals that are never indexed: valid whatever the peer's HPACK state."""
    return hpack.Encoder().encode([(k, v, True) for k, v in headers], huffman=False)


_REPLY = pb.PushUpdateReply(version=0).SerializeToString()
_RESPONSE_HEADERS = _literal_block([(":status", "200"), ("content-type", "application/grpc")])
_TRAILERS = _literal_block([("grpc-status", "0")])


class HttpSink:
    def __init__(self, sock: socket.socket, body: memoryview) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.body = body
        self.left = 0  # body bytes still to read

    def readable(self) -> bool:
        if self.left:
            n = self.sock.recv_into(self.body[: self.left])
            if not n:
                return False
            self.left -= n
            if not self.left:
                self.sock.send(HTTP_REPLY)
            return True
        data = self.sock.recv(RECEIVE_BYTES)
        if not data:
            return False
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            field = _CONTENT_LENGTH.search(self.buf, 0, end + 2)
            length = int(field.group(1)) if field else 0
            rest = self.buf[end + 4 :]
            here = min(len(rest), length)
            self.body[:here] = rest[:here]
            self.buf = bytearray(rest[here:])
            self.left = length - here
            if self.left:
                return True
            self.sock.send(HTTP_REPLY)
        return True


class GrpcSink:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.preface = False
        self.skip = 0  # DATA payload bytes still to drop
        self.skip_stream = 0
        self.skip_end = False
        self.received = 0  # DATA bytes since the last connection WINDOW_UPDATE
        sock.send(h2.settings_frame([(h2.INITIAL_WINDOW_SIZE, WINDOW), (h2.MAX_FRAME_SIZE, h2.LARGEST_FRAME_SIZE)])
                  + h2.window_update_frame(0, WINDOW - h2.DEFAULT_WINDOW))

    def readable(self) -> bool:
        data = self.sock.recv(RECEIVE_BYTES)
        if not data:
            return False
        self.buf += data
        out = bytearray()
        while True:
            if self.skip:
                n = min(self.skip, len(self.buf))
                del self.buf[:n]
                self.skip -= n
                self.received += n
                if self.skip:
                    break
                if self.skip_end:
                    self._answer(out, self.skip_stream)
                continue
            if not self.preface:
                if len(self.buf) < len(h2.PREFACE):
                    break
                del self.buf[: len(h2.PREFACE)]
                self.preface = True
            if len(self.buf) < h2.FRAME_HEADER_SIZE:
                break
            length = int.from_bytes(self.buf[:3], "big")
            ftype, flags = self.buf[3], self.buf[4]
            (stream,) = struct.unpack_from(">I", self.buf, 5)
            stream &= 0x7FFFFFFF
            if ftype == h2.DATA:
                del self.buf[: h2.FRAME_HEADER_SIZE]
                self.skip, self.skip_stream, self.skip_end = length, stream, bool(flags & h2.END_STREAM)
                if not length and self.skip_end:
                    self._answer(out, stream)
                continue
            if len(self.buf) < h2.FRAME_HEADER_SIZE + length:
                break
            del self.buf[: h2.FRAME_HEADER_SIZE + length]
            if ftype == h2.SETTINGS and not flags & h2.ACK:
                out += h2.settings_frame(ack=True)
            elif ftype == h2.PING and not flags & h2.ACK:
                out += h2.encode_frame(h2.PING, h2.ACK, 0, bytes(8))
            elif ftype == h2.HEADERS and flags & h2.END_STREAM:
                self._answer(out, stream)
        if self.received > WINDOW // 2:
            out += h2.window_update_frame(0, self.received)
            self.received = 0
        if out:
            self.sock.sendall(out)
        return True

    @staticmethod
    def _answer(out: bytearray, stream: int) -> None:
        out += h2.headers_frame(stream, _RESPONSE_HEADERS)
        out += h2.data_frame(stream, message_prefix(len(_REPLY)) + _REPLY)
        out += h2.headers_frame(stream, _TRAILERS, end_stream=True)


def serve(protocol: str) -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    listener.setblocking(False)
    print(listener.getsockname()[1], flush=True)
    body = memoryview(bytearray(BODY_BUFFER))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _ in selector.select():
            if key.data is None:
                sock, _ = listener.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                selector.register(sock, selectors.EVENT_READ, HttpSink(sock, body) if protocol == "http" else GrpcSink(sock))
                continue
            try:
                alive = key.data.readable()
            except OSError:
                alive = False
            if not alive:
                selector.unregister(key.fileobj)
                key.fileobj.close()


if __name__ == "__main__":
    serve(sys.argv[1])
