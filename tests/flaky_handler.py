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

from lifl.errors import LiflError
from lifl.functions.aggregator import handler as aggregator
from lifl.protocol import TOP, StepPartials
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


def handle_exit_after_partials(inv: Invocation, ctx: Context) -> dict[str, Any]:
    """Every top of a sharded round of a strategy that reads whole updates dies once right after
    it sent its shard's partials: before it installs, or, the one told to step every shard,
    before it steps."""
    marker = FAULTS / inv.job / str(inv.task)
    if marker.exists():
        return aggregator.handle(inv, ctx)
    send = ctx.step_partials

    def send_then_die(*args: Any, **kwargs: Any) -> Any:
        send(*args, **kwargs)
        marker.touch()
        os._exit(9)

    ctx.step_partials = send_then_die  # type: ignore[method-assign]
    try:
        return aggregator.handle(inv, ctx)
    finally:
        ctx.step_partials = send  # type: ignore[method-assign]


def handle_bad_partials(inv: Invocation, ctx: Context) -> dict[str, Any]:
    """Each task first sends the agent step partials it should not (a leaf's or middle's, a
    top's of 3 bytes) and writes down the agent's answer under ``FAULTS/<job>``, then
    aggregates as usual."""
    try:
        ctx.client.call(StepPartials(task=inv.task, partials=b"\0" * (3 if inv.role == TOP else 8)))
        answer = "accepted"
    except LiflError as e:
        answer = f"{e.code}: {e.message}"
    (FAULTS / inv.job / f"{inv.role}-{inv.task}").write_text(answer)
    return aggregator.handle(inv, ctx)
