"""The physical reference for ingest: receive N bytes from a loopback socket into a preallocated,
pre-faulted buffer and acknowledge with one byte. Run as a separate process, like the gateway.
With a certificate and key (``rawsink N CERT KEY``) the socket is TLS: the reference for what
user-space TLS costs by itself, records decrypted straight into the buffer."""

from __future__ import annotations

import socket
import sys

from lifl.net.tls import ALPN_HTTP, ServerTls


def main() -> None:
    size = int(sys.argv[1])
    buf = bytearray(size)
    view = memoryview(buf)
    for i in range(0, size, 4096):  # fault every page in, as the gateway's recycled buffers are
        buf[i] = 1
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if len(sys.argv) > 2:
        conn = ServerTls(sys.argv[2], sys.argv[3]).context(ALPN_HTTP).wrap_socket(conn, server_side=True)
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(view[got:])
            if not n:
                return
            got += n
        conn.sendall(b"k")


if __name__ == "__main__":
    main()
