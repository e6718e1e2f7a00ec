"""An aggregator that breaks the first run of every task right after its first fold, the
moment a task that let its inputs go would lose them: ``handle_exit`` dies like a killed
process, ``handle_raise`` fails the task. A fold is reported on its own (``Context.folded``), or,
when it is a leaf's or middle's last, with the task's result (``Context.forward``): the run breaks
right after the first, and right before the second (its fold done, not yet reported). Marker files under ``FAULTS/<job>`` remember which
tasks already broke, across instances (which see only a few environment variables)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from lifl.functions.aggregator import handler as aggregator
from lifl.runtime import Context, Invocation

FAULTS = Path(tempfile.gettempdir()) / "lifl-test-faults"  # made world-writable by the test: instances run as tenants


class Fault(Exception):
    pass


def _broken_once(inv: Invocation, ctx: Context, exit: bool) -> dict[str, Any]:
    marker = FAULTS / inv.job / str(inv.task)
    if marker.exists():
        return aggregator.handle(inv, ctx)
    fold, forward = ctx.folded, ctx.forward

    def break_now() -> None:
        marker.touch()
        if exit:
            os._exit(9)
        raise Fault(f"task {inv.task} breaks after its first fold")

    def folded_then_break(*args: Any, **kwargs: Any) -> None:
        fold(*args, **kwargs)
        break_now()

    def break_before_forward(*args: Any, folded: Any = None, **kwargs: Any) -> None:
        if folded:
            break_now()
        forward(*args, folded=folded, **kwargs)

    ctx.folded, ctx.forward = folded_then_break, break_before_forward  # type: ignore[method-assign]
    try:
        return aggregator.handle(inv, ctx)
    finally:
        ctx.folded, ctx.forward = fold, forward  # type: ignore[method-assign]  # the context outlives the task


def handle_exit(inv: Invocation, ctx: Context) -> dict[str, Any]:
    return _broken_once(inv, ctx, exit=True)


def handle_raise(inv: Invocation, ctx: Context) -> dict[str, Any]:
    return _broken_once(inv, ctx, exit=False)
