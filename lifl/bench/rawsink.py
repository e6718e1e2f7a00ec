"""The physical reference for ingest: receive N bytes from a loopback socket into a preallocated,
pre-faulted buffer and acknowledge with one byte. Run as a separate process, like the gateway."""

from __future__ import annotations

import socket
import sys


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
