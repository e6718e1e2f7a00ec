"""Serving one control connection: decode each typed message, run its handler, send the reply.

Handlers run without the agent's lock (each takes it around its own critical parts, so that
no Redis call happens under it) and return ``(reply, descriptors)``; pushes (frames without
an id) get no reply. Any descriptor that came with a message is closed once its handler
returns: a handler that keeps one duplicates it.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lifl.errors import BadRequest, Internal, LiflError
from lifl.protocol import Message, Ok, decode
from lifl.rpc import Connection, error_reply, reply_frame

Handler = Callable[[Any, Sequence[int]], tuple[Message | None, list[int]]]


def serve(conn: Connection, handlers: Mapping[type[Message], Handler], on_close: Callable[[], None], who: str) -> None:
    """Serve ``conn`` until the peer goes (or sends something that is not a message), then ``on_close``."""
    try:
        while True:
            frame, fds = conn.recv()
            request_id = frame.pop("id", None)
            reply_fds: list[int] = []
            try:
                message = decode(frame)
                handler = handlers.get(type(message))
                if handler is None:
                    raise BadRequest(f"{message.op} is not served to a {who}", code="bad_message")
                reply, reply_fds = handler(message, fds)
                response = reply_frame(request_id, reply or Ok())
            except LiflError as e:
                response = error_reply(request_id, e)
            except Exception as e:  # report, keep serving: one bad request must not kill the node
                traceback.print_exc()
                response = error_reply(request_id, Internal(f"{type(e).__name__}: {e}"))
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                if request_id is not None:
                    conn.send(response, reply_fds)
            finally:
                for fd in reply_fds:
                    os.close(fd)
    except (EOFError, ConnectionError, OSError):
        pass
    except LiflError as e:  # a frame that is not a message at all: this peer cannot be trusted further
        print(f"lifl agent: closing a {who} connection: {e.message}", file=sys.stderr)
    finally:
        conn.close()
        on_close()
