"""The physical reference for ingest: receive N bytes from a loopback socket into a preallocated,
pre-faulted buffer and acknowledge with one byte. Run as a separate process, like the gateway.
With a certificate and key (``rawsink N CERT KEY``) the socket is TLS: the reference for what
user-space TLS costs by itself, records decrypted straight into the buffer.

The reference must be the fastest transfer a plain socket makes on this machine with lifl's
socket options, or lifl's ingest can beat it (it did: 0.72-0.94x the reference this replaced).
Each choice was measured against its alternatives, interleaved, at 83 and 230 MB (medians of
9-41 transfers on 2 shared cores; a connection's two processes land on one CPU or on two and
stay there, so a median moves by 10-30 % between runs, and only repeated effects count):

- the sender (``Bench.raw_sink`` in lifl.bench.dataplane) has a socket timeout, as lifl's
  http.client connection has: sendall() writes what fits in the socket buffer and waits in
  poll(). This is what made lifl's ingest faster than the old reference, whose sender blocked in
  one send() of the whole update (still measured: raw_tcp_naive_ms). Alone on the machine the
  blocking sender takes 1.3x as long (230 MB: 64 vs 48 ms, 83 MB: 22 vs 17 ms) with more CPU on
  both ends, and the receiver wakes 2-2.5x as often for smaller reads (200-235 KiB per
  recv_into, against 370-415 KiB); beside a node, 1.1-1.5x at 230 MB and 0.9-1.3x at 83 MB;
- lifl's socket options, no others: TCP_NODELAY on both ends, kernel-default buffer sizes
  (neither the client nor the gateway sets SO_SNDBUF or SO_RCVBUF). SO_RCVLOWAT of 1 MiB was
  faster still (230 MB: 53 vs 65 ms, 83 MB: 23 vs 31 ms) but is excluded: the kernel grows the
  receive buffer with it (2 MiB at once; autotuned to 32 MiB, against 9 MiB without);
- the receiver blocks in recv_into() for the whole rest of the buffer, as the gateway reads
  (its float checks run every 256 KiB received, but its reads are not bounded). Neither a socket
  timeout on this side (as the gateway's), nor reads bounded to 256 KiB or 1 MiB, nor one
  MSG_WAITALL recv for the whole update was faster in repeated runs (each won one run by
  5-15 % and lost another by as much);
- the buffer is a pre-faulted posix shared-memory mapping, the memory the gateway receives
  into: its medians beat a pre-faulted bytearray's in 6 of 8 runs (230 MB: 46-67 vs 50-78 ms;
  83 MB: 14-27 vs 18-26 ms), not by more than placement moves them. Alignment was not why (a
  bytearray's data starts 16 bytes into a page; a mapping read 16 bytes in was as fast);
- no CPU pinning: sender and receiver on CPUs of their own were 10-30 % faster on a quiet
  machine, and 1.5-2x slower as soon as anything else ran (neither can leave a busy CPU);
  lifl's processes are not pinned either.
"""

from __future__ import annotations

import mmap
import socket
import sys

import posix_ipc

from lifl.net.tls import ALPN_HTTP, ServerTls

PAGE = mmap.PAGESIZE


def receive_buffer(size: int) -> mmap.mmap:
    """An unlinked posix shared-memory mapping of ``size`` bytes with every page faulted in: the
    kind of memory the gateway receives into (its recycled shared-memory objects)."""
    shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, size=size)
    try:
        mm = mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()
        shm.unlink()
    for i in range(0, size, PAGE):
        mm[i] = 1
    return mm


def main() -> None:
    size = int(sys.argv[1])
    buf = receive_buffer(size)
    view = memoryview(buf)
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
