"""The function runtime: the process that hosts one stateless function instance.

The node agent starts it with two inherited descriptors, its control connection and its
key-channel endpoint, and then invokes it any number of times. Each invocation names the
task, its role and fan-in; the handler (by default the aggregator in ``functions/aggregator``)
does the work through a ``Context`` (inputs, accumulators, forward, install) and returns
statistics, and knows nothing of where its inputs come from or its result goes. The
instance keeps nothing between invocations except caches (mappings, parsed layouts), which
is what makes a warm instance reusable for any role of any job of its tenant.

An instance the node starts (``lifl up``) is handed two inherited descriptors and exits when
the agent goes away (its control connection closes). An instance the cluster starts (a function
pod, see ``templates/lifl-aggregator``) attaches instead: it connects to the agent's function
socket, is given its id and endpoint there, and attaches again whenever the agent goes away or
lets it go, until it is told to stop.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import mmap
import os
import socket
import struct
import sys
import threading
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lifl import format as fmt
from lifl.keys.factory import attach as attach_channel
from lifl.keys.record import KIND_KEY, KIND_PREPARE, KeyMessage, now_ns
from lifl.keys.transport import KeyEndpoint
from lifl.errors import LiflError
from lifl.fixedpoint import FixedPoint
from lifl.protocol import (
    QUERY_ROLE, Alloc, Attach, CancelTask, Done, Failed, Finished, Folded, InstallResult, Invoke, NextModel, Ready,
    SecureSeeds, StepPartials, StrategyInputs, StrategyWork, input_fields,
)
from lifl.shards import ShardPlan, TensorShard, part_of, plan as shard_plan
from lifl.net.io import ready
from lifl.rpc import Client, Connection
from lifl.store import MappingCache, object_name
from lifl.strategy import StrategySpec


class TaskCancelled(Exception):
    """The agent called the task off (its round was abandoned)."""


@dataclass(frozen=True)
class Invocation:
    task: int
    job: str
    version: int  # the global version whose updates this round aggregates
    role: str
    fan_in: int  # 0: open until a close message says how many inputs there are
    lazy: bool  # fold only once every input has arrived
    spec: fmt.ModelSpec
    parent: tuple[int, int] = (0, 0)  # (instance, task) of the parent when this task started; (0, 0): unknown
    strategy: StrategySpec = StrategySpec()  # how the top turns the round into the next model
    fixed_point: FixedPoint | None = None  # sum quantised updates in integers (deterministic)
    shard: TensorShard | None = None  # the slice of the model it aggregates (lifl.shards); None: all of it
    accumulator: fmt.DType = fmt.F64  # what partial sums of float tensors are kept in (without fixed point)
    shards: ShardPlan | None = None  # every slice of the round (a top may step them all)
    secure: bool = False  # inputs are masked (lifl.secagg): summed as partial sums, unmasked by the top


class Context:
    """What a handler may do: take its inputs, map them, get accumulators, and pass its result
    on. Where the result goes (a task on this instance, another instance, another node) is
    the agent's business: ``forward`` hands it over and sends the key where it is told to."""

    def __init__(self, instance_id: int, tenant: str, node: str, client: Client, channel: KeyEndpoint) -> None:
        self.instance_id = instance_id
        self.tenant = tenant
        self.node = node
        self.client = client
        self.channel = channel
        self.mappings = MappingCache()
        self._stash: dict[int, deque[KeyMessage]] = defaultdict(deque)  # messages for later tasks
        self._seen: dict[int, set[bytes]] = defaultdict(set)  # keys a task's run was given
        self._layouts: dict[bytes, fmt.Layout] = {}
        self._scratch: dict[int, list[tuple[bytes, mmap.mmap]]] = defaultdict(list)  # accumulators given ahead, by task
        self._finish: dict[int, Finished] = {}  # a task's hand-off, sent with its statistics when it returns

    def invoked(self, push: Invoke, fds: list[int]) -> None:
        """Take what an invocation brings along: the inputs known at its start (as if their key
        messages had come) and an accumulator for its first fold."""
        for record in push.inputs:
            key, samples, updates, partial, sent_ns = input_fields(record)
            self._stash[push.task].append(KeyMessage(dest=self.instance_id, task=push.task, key=key, samples=samples,
                                                     count=updates, partial=partial, sent_ns=sent_ns))
        if push.scratch and fds:
            self._scratch[push.task].append((push.scratch, self.mappings.map_fd(fds[0], writable=True)))

    # -- inputs ------------------------------------------------------------------------------
    def receive(self, inv: Invocation) -> list[KeyMessage]:
        """The task's next messages: blocks for one, then takes every other already waiting. A
        key the run was given already is dropped: a task run again on this instance is sent its
        inputs anew, and copies sent to the run that failed may still arrive."""
        while True:
            first = self._next(inv.task)
            while True:
                msg = self.channel.recv(timeout=0)
                if msg is None:
                    break
                self._stash[msg.task].append(msg)
            messages = [first, *self._stash[inv.task]]
            self._stash[inv.task].clear()
            seen = self._seen[inv.task]
            fresh = []
            for m in messages:
                if m.kind == KIND_KEY:
                    if m.key in seen:
                        continue
                    seen.add(m.key)
                fresh.append(m)
            if fresh:
                return fresh

    def run_ended(self, task: int) -> None:
        """A run of the task ended: if the task runs again here, it is sent its inputs anew."""
        self._seen.pop(task, None)
        self._scratch.pop(task, None)  # the agent lets go of what it did not use
        self._finish.pop(task, None)

    def _next(self, task: int) -> KeyMessage:
        while True:
            if self._stash[task]:
                return self._stash[task].popleft()
            self._handle_pushes()
            if self.channel in ready([self.channel, self.client.conn]):
                msg = self.channel.recv()
                if msg is not None:
                    self._stash[msg.task].append(msg)

    def _handle_pushes(self) -> None:
        """Apply control pushes (cancellations) that arrived while the task ran."""
        while self.client.pushes or ready([self.client.conn], 0):
            push, _ = self.client.next_push()
            if isinstance(push, CancelTask):
                raise TaskCancelled(push.reason)

    # -- objects -----------------------------------------------------------------------------
    def open(self, key: bytes) -> mmap.mmap:
        return self.mappings.open(object_name(self.node, self.tenant, key))

    def layout(self, mm: mmap.mmap) -> fmt.Layout:
        """The layout of a mapped object, parsed once per distinct header."""
        (n,) = struct.unpack_from("<Q", mm, 0)
        header = mm[: fmt.PREFIX_BYTES + n]
        layout = self._layouts.get(header)
        if layout is None:
            layout = fmt.parse_header(header[fmt.PREFIX_BYTES :], allow_partial=True)
            if len(self._layouts) > 64:
                self._layouts.clear()
            self._layouts[header] = layout
        return layout

    def accumulator(self, inv: Invocation, header: bytes, data_bytes: int) -> tuple[bytes, mmap.mmap]:
        """A new writable object holding ``header`` followed by ``data_bytes`` of tensor data: one
        the agent gave ahead if it is of that size, else one asked for now."""
        size = len(header) + data_bytes
        given = self._scratch[inv.task]
        for i, (key, mm) in enumerate(given):
            if len(mm) == size:
                del given[i]
                break
        else:
            reply, fds = self.client.call(Alloc(task=inv.task, size=size))
            key, mm = reply.key, self._mapped(fds)
        mm[: len(header)] = header
        return key, mm

    def next_model(self, inv: Invocation, *, state: bool = False) -> tuple[bytes, mmap.mmap]:
        """The object the round's next model (``state``: the strategy's next state) is written
        into, each top of a sharded round its slice."""
        reply, fds = self.client.call(NextModel(task=inv.task, state=state))
        return reply.key, self._mapped(fds)

    def step_partials(self, inv: Invocation, partials: np.ndarray) -> np.ndarray | None:
        """Send the partials of this top's shard (``StepPartials``); the sum over every shard if
        they are now all in and this top is to step them all, else None."""
        values = np.ascontiguousarray(partials, np.float64)
        reply, _ = self.client.call(StepPartials(task=inv.task, partials=values.tobytes()))
        return np.frombuffer(reply.sums, np.float64).reshape(values.shape) if reply.sums else None

    def unmasking_seeds(self, inv: Invocation, held: list[bytes]) -> list[tuple[int, bytes]]:
        """A task of a secure round: the streams that take off the masks of the clients whose
        inputs it folded, and of ``held`` (``SecureSeeds``), once the round's secrets are rebuilt."""
        reply, _ = self.client.call(SecureSeeds(task=inv.task, held=held))
        return [(int(sign), bytes.fromhex(seed)) for sign, seed in reply.streams]

    def _mapped(self, fds: list[int]) -> mmap.mmap:
        try:
            return self.mappings.map_fd(fds[0], writable=True)
        finally:
            for fd in fds:
                os.close(fd)

    # -- progress and results ------------------------------------------------------------------
    def folded(self, inv: Invocation, keys: list[bytes], updates: int, seconds: float, state: bytes,
               next_size: int = 0) -> None:
        """These inputs (and the previous accumulator) are summed up in the accumulator ``state``:
        their objects may go, and if this instance dies the task runs again from ``state``.
        ``next_size``: the size of the accumulator the next fold will want, given with the answer."""
        reply, fds = self.client.call(Folded(task=inv.task, keys=keys, updates=updates, seconds=seconds, state=state,
                                             next_size=next_size))
        if reply.key and fds:
            self._scratch[inv.task].append((reply.key, self._mapped(fds)))
        else:
            for fd in fds:
                os.close(fd)

    def announce(self, inv: Invocation, key: bytes) -> None:
        """Tell the parent, if this task knows it, that its input will be ``key`` (a
        KIND_PREPARE hint): it maps the object while this task still writes it, so the hand-off
        that follows costs only the delivery. A hint never blocks nor fails the task."""
        if inv.parent[0]:
            with contextlib.suppress(OSError):
                self.channel.try_send(KeyMessage(dest=inv.parent[0], task=inv.parent[1], kind=KIND_PREPARE, key=key,
                                                 src=self.instance_id))

    def forward(self, inv: Invocation, key: bytes, samples: int, updates: int, partial: bool, agg_seconds: float = 0.0,
                folded: tuple[list[bytes], bytes, float] | None = None) -> None:
        """Pass the task's result on to its parent, wherever that is: to where it ran when this
        task started, at once (the parent may read the object before the agent seals it); the
        agent hears of it, and sends it elsewhere if the parent moved, with the task's statistics
        once the handler returns. ``folded``: the last fold, reported with it (the keys it summed
        up, its accumulator, its seconds). ``agg_seconds``, the time the task spent folding,
        travels in the message (the key channel's metrics count it)."""
        sent_to: list[int] = []
        if inv.parent[0]:
            with contextlib.suppress(OSError):  # it has gone: the agent routes the key
                self.channel.send(KeyMessage(dest=inv.parent[0], task=inv.parent[1], key=key, samples=samples, count=updates,
                                             partial=partial, src=self.instance_id, sent_ns=now_ns(),
                                             agg_us=round(agg_seconds * 1e6)))
                sent_to = list(inv.parent)
        keys, state, seconds = folded or ([], b"", 0.0)
        self._finish[inv.task] = Finished(task=inv.task, key=key, samples=samples, updates=updates, partial=partial,
                                          folded=keys, fold_state=state, fold_seconds=seconds, sent_to=sent_to)

    def finish(self, inv: Invocation, stats: dict[str, Any]) -> None:
        """The task returned: its hand-off and statistics in one push, or Done (the top, a query)."""
        handoff = self._finish.pop(inv.task, None)
        if handoff is None:
            self.client.call(Done(task=inv.task, stats=stats))
        else:
            self.client.push(dataclasses.replace(handoff, stats=stats))

    def install(self, inv: Invocation, key: bytes, samples: int, updates: int, *, state: bytes = b"",
                report: dict[str, Any] | None = None) -> int:
        """The top's result, averaged: it becomes the next global version (returned). ``state``: the
        strategy's new state (an accumulator of this task), kept and checkpointed with the model."""
        reply, _ = self.client.call(InstallResult(task=inv.task, key=key, samples=samples, updates=updates, state=state,
                                                  report=report or {}))
        return reply.version

    def strategy_inputs(self, inv: Invocation, updates: int) -> StrategyWork:
        """What the top's strategy reads besides the round's sum (``lifl.protocol.StrategyInputs``):
        object keys of the current model, the strategy's state and the round's updates."""
        reply, _ = self.client.call(StrategyInputs(task=inv.task, updates=updates))
        return reply


Handler = Callable[[Invocation, Context], dict[str, Any]]
QueryHandler = Callable[[int, Context], dict[str, Any]]
QUERY_HANDLER = "lifl.functions.queries.handler:handle"  # the non-training workloads (lifl.flstore)


def load_handler(spec: str) -> Handler:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name or "handle")


def serve(ctx: Context, handler: Handler, finished: Callable[[Invocation, dict[str, Any]], None] | None = None) -> None:
    """Run invocations until the agent goes; ``finished`` hears of each task's statistics."""
    specs: dict[str, tuple[fmt.ModelSpec, StrategySpec, FixedPoint | None, ShardPlan | None, fmt.DType]] = {}
    while True:
        try:
            push, fds = ctx.client.next_push()
        except (EOFError, ConnectionError):
            return
        if not isinstance(push, Invoke):
            for fd in fds:
                os.close(fd)
            continue  # a cancellation for a task that already finished
        try:
            ctx.invoked(push, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if push.role == QUERY_ROLE:
            if not _serve_query(ctx, push.task):
                return
            continue
        if push.spec is not None:
            options = push.options or {}
            strategy = options.get("strategy")
            model_spec = fmt.ModelSpec.from_json(push.spec)
            shards = options.get("shards")  # [count, alignment] when the job's model is cut
            plan = shard_plan(model_spec, *shards) if shards else None
            if plan is not None and options.get("part"):  # split across nodes: this node's run of shards
                part = part_of(plan, *options["part"])
                model_spec, plan = part.spec, part.plan
            specs[push.job] = (model_spec, StrategySpec.from_json(strategy) if strategy else StrategySpec(),
                               FixedPoint.from_request(options.get("fixed_point")), plan,
                               fmt.ACCUMULATORS[options.get("accumulator", "float64")], bool(options.get("secure")))
        model_spec, strategy_spec, fixed_point, plan, accumulator, secure = specs[push.job]
        inv = Invocation(push.task, push.job, push.version, push.role, push.fan_in, push.lazy, model_spec,
                         (push.parent_instance, push.parent_task), strategy_spec, fixed_point,
                         plan[push.shard] if plan is not None else None, accumulator, plan, secure)
        try:
            stats = handler(inv, ctx)
            ctx.finish(inv, stats)
            if finished is not None:
                finished(inv, stats)
        except TaskCancelled:
            ctx.client.call(Done(task=inv.task, stats={"cancelled": True}))
        except (EOFError, ConnectionError):
            return
        except Exception as e:  # the agent decides what a failed task means for its round
            traceback.print_exc()
            ctx.client.call(Failed(task=inv.task, problem=f"{type(e).__name__}: {e}"))
        finally:
            ctx.run_ended(inv.task)


def _serve_query(ctx: Context, task: int) -> bool:
    """Run one query on this warm instance; False once the agent is gone."""
    try:
        handler: QueryHandler = load_handler(QUERY_HANDLER)  # type: ignore[assignment]
        stats = handler(task, ctx)
        ctx.client.call(Done(task=task, stats=stats))
    except (EOFError, ConnectionError):
        return False
    except Exception as e:
        traceback.print_exc()
        try:
            ctx.client.call(Failed(task=task, problem=f"{type(e).__name__}: {e}"))
        except (EOFError, ConnectionError):
            return False
    return True


ATTACH_BACKOFF_S = (0.05, 2.0)  # first and longest wait between attempts while the agent is not there


@dataclass
class AttachedStatus:
    """What an attached instance reports about itself (the function shim's health and status)."""

    socket: str
    tenant: str
    node: str = ""
    instance: int = 0  # 0: not attached
    attaches: int = 0
    tasks: int = 0
    waiting_since: float | None = None  # monotonic time the agent was first found missing
    problem: str = ""

    @property
    def ready(self) -> bool:
        return self.instance != 0


class AttachRefused(Exception):
    """The agent refused this instance (a wrong identity or tenant): trying again cannot help."""


def attach(socket_path: str, tenant: str) -> tuple[int, str, Client, KeyEndpoint]:
    """Attach to the agent at ``socket_path`` as one of ``tenant``'s instances: (instance id, node,
    control client, key endpoint). OSError if no agent listens there; AttachRefused with the
    agent's reason if it will not take this process."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        client = Client(Connection(sock))
        try:
            reply, fds = client.call(Attach(tenant))
        except LiflError as e:
            raise AttachRefused(e.message) from None
        except EOFError as e:
            raise ConnectionResetError(f"the agent at {socket_path} closed the connection") from e
    except BaseException:
        sock.close()
        raise
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise AttachRefused(f"the agent sent {len(fds)} descriptors with its reply, not the endpoint's one")
    return reply.instance, reply.node, client, attach_channel(reply.channel, socket.socket(fileno=fds[0]))


class AttachedInstance:
    """An instance the cluster started: ``run`` attaches, serves until the agent goes or lets it
    go, and attaches again, until ``stop`` (from a signal handler or another thread). While no
    agent listens (the node's pod starts after this one, or restarts) it waits, backing off; a
    refusal raises AttachRefused."""

    def __init__(self, socket_path: str, tenant: str, handler: Handler) -> None:
        self.status = AttachedStatus(socket_path, tenant)
        self.handler = handler
        self._stop = threading.Event()
        self._client: Client | None = None

    def run(self) -> None:
        status, wait = self.status, ATTACH_BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                iid, node, client, channel = attach(status.socket, status.tenant)
            except OSError as e:
                status.problem = f"waiting for the node agent at {status.socket}: {e.strerror or e}"
                status.waiting_since = status.waiting_since or time.monotonic()
                self._stop.wait(wait)
                wait = min(wait * 2, ATTACH_BACKOFF_S[1])
                continue
            wait = ATTACH_BACKOFF_S[0]
            status.node, status.problem, status.waiting_since = node, "", None
            status.attaches += 1
            self._client = client
            try:
                if not self._stop.is_set():
                    client.call(Ready())
                    status.instance = iid
                    serve(Context(iid, status.tenant, node, client, channel), self.handler, self._finished)
            except (EOFError, ConnectionError, OSError):
                pass
            finally:
                status.instance = 0
                self._client = None
                client.close()
                channel.close()

    def _finished(self, inv: Invocation, stats: dict[str, Any]) -> None:
        self.status.tasks += 1

    def stop(self) -> None:
        self._stop.set()
        client = self._client
        if client is not None:
            with contextlib.suppress(OSError):
                client.conn.sock.shutdown(socket.SHUT_RDWR)


def drop_privileges(uid: int) -> None:
    """Become the tenant (uid = gid, no other groups). Everything the instance runs is imported
    before this, so the code may live where the tenant cannot read; from here on the kernel
    checks every shared-memory open against the tenant's identity."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit(f"could not drop privileges to uid {uid}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="lifl-runtime", description=__doc__)
    p.add_argument("--instance", type=int, required=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--channel", required=True, metavar="SPEC", help="the key endpoint's spec, from the agent")
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--handler", default="lifl.functions.aggregator.handler:handle")
    p.add_argument("--user", type=int, help="drop to this uid (and gid) once the code is loaded")
    p.add_argument("--preload", action="append", default=[], metavar="MODULE",
                   help="import this module too before dropping privileges (torch, for inference queries)")
    args = p.parse_args(argv)
    handler = load_handler(args.handler)
    load_handler(QUERY_HANDLER)  # imported before the drop, as the aggregator is
    for module in args.preload:
        importlib.import_module(module)
    channel = attach_channel(args.channel, socket.socket(fileno=args.channel_fd))  # imports its transport: before the drop
    if args.user is not None:
        drop_privileges(args.user)
    client = Client(Connection(socket.socket(fileno=args.control_fd)))
    ctx = Context(args.instance, args.tenant, args.node, client, channel)
    try:
        client.call(Ready())
    except (EOFError, ConnectionError):  # the agent went while this instance started: nothing to serve
        sys.exit(0)
    serve(ctx, handler)
    sys.exit(0)


if __name__ == "__main__":
    main()
