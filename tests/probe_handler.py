"""A function for the isolation test: before aggregating, try to open every object on the node."""

from __future__ import annotations

import os
from typing import Any

from lifl.errors import NotFound
from lifl.functions.aggregator import handler as aggregator
from lifl.runtime import Context, Invocation
from lifl.store import SHM_DIR


def handle(inv: Invocation, ctx: Context) -> dict[str, Any]:
    seen: dict[str, str] = {}
    for path in SHM_DIR.glob(f"lifl-{ctx.node}-*"):
        try:
            ctx.mappings.open("/" + path.name)
            seen[path.name] = "opened"
        except PermissionError:
            seen[path.name] = "denied"
        except NotFound:
            pass  # recycled meanwhile
    stats = aggregator.handle(inv, ctx)
    stats["probe"] = seen
    stats["uid"] = os.getuid()
    return stats
