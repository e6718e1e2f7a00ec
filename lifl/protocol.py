"""Typed messages between a node's processes: gateway ↔ agent, agent ↔ function instances.

Every message is a frozen dataclass registered under its ``op`` name; ``lifl.rpc`` frames
them as JSON (bytes fields travel as hex) and checks every field's type on the way in, so a
malformed message is refused with the field named instead of failing somewhere deeper.
A gateway's first message is ``Hello`` with the protocol version; the agent refuses another.

Requests name their reply type; pushes (``Invoke``, ``CancelTask``, ``ForwardPartial``,
``Forwarded``) have none.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from lifl.errors import BadRequest

PROTOCOL = 3
ENVELOPE = frozenset({"id", "ok", "op", "nfds", "error"})  # lifl.rpc's framing: no message field may be one

_REGISTRY: dict[str, type[Message]] = {}

LEAF, MIDDLE, TOP = "leaf", "middle", "top"  # the roles of a round's aggregation tasks (an Invoke's role)
ROLES = (LEAF, MIDDLE, TOP)


@dataclass(frozen=True)
class Message:
    op: ClassVar[str] = ""
    reply: ClassVar[type[Message] | None] = None

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op}
        for name in _field_names(type(self)):
            out[name] = _encode_value(getattr(self, name))
        return out


def message(op: str, reply: type[Message] | None = None) -> Any:
    """Register a message class under ``op`` (and the type of its reply, for requests)."""

    def register(cls: type[Message]) -> type[Message]:
        if op in _REGISTRY:
            raise ValueError(f"message op {op!r} registered twice")
        clash = {f.name for f in dataclasses.fields(cls)} & ENVELOPE
        if clash:
            raise ValueError(f"message {op!r} uses the envelope's field names {sorted(clash)}")
        cls.op, cls.reply = op, reply
        _REGISTRY[op] = cls
        return cls

    return register


def decode(data: dict[str, Any]) -> Message:
    """The message a decoded JSON object stands for; BadRequest naming what is wrong."""
    op = data.get("op")
    cls = _REGISTRY.get(op) if isinstance(op, str) else None
    if cls is None:
        raise BadRequest(f"unknown message {op!r}", code="bad_message")
    values: dict[str, Any] = {}
    for name, required, convert in _decoders(cls):
        if name not in data:
            if required:
                raise BadRequest(f"message {op!r} lacks field {name!r}", code="bad_message")
            continue
        values[name] = convert(data[name])
    return cls(**values)


Converter = Callable[[Any], Any]
R = TypeVar("R")
_FIELDS: dict[type, tuple[str, ...]] = {}
_DECODERS: dict[type, list[tuple[str, bool, Converter]]] = {}


def record_json(record: Any) -> dict[str, Any]:
    """A record (a dataclass that messages carry, e.g. ``NodeStatus``) as JSON-ready values."""
    return _encode_value(record)


def record_from_json(cls: type[R], data: Any) -> R:
    """The record ``cls`` that JSON ``data`` stands for; BadRequest naming what is wrong."""
    return _converter(cls, cls.__name__)(data)


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _decoders(cls: type) -> list[tuple[str, bool, Converter]]:
    """Each field's (name, required, checked conversion), built once per message type from its
    type hints: decoding a message does no introspection."""
    decoders = _DECODERS.get(cls)
    if decoders is None:
        hints = typing.get_type_hints(cls)
        where = getattr(cls, "op", "") or cls.__name__
        decoders = _DECODERS[cls] = [
            (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
             _converter(hints[f.name], f"{where}.{f.name}"))
            for f in dataclasses.fields(cls)]
    return decoders


def _encode_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a record inside a message
        return {name: _encode_value(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, dict):
        return {k: _encode_value(v) for k, v in value.items()}
    return value


def _converter(hint: Any, where: str) -> Converter:
    """A function that checks a decoded JSON value against ``hint`` and converts it (hex to
    bytes), raising BadRequest that names ``where``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        (inner,) = [o for o in options if o is not type(None)]
        convert_inner = _converter(inner, where)
        nullable = type(None) in options
        return lambda value: None if value is None and nullable else convert_inner(value)
    if origin is list:
        (inner,) = typing.get_args(hint)
        convert_item = _converter(inner, where)

        def convert_list(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise BadRequest(f"{where} must be a list", code="bad_message")
            return [convert_item(v) for v in value]

        return convert_list
    if origin is dict or hint is dict:
        args = typing.get_args(hint)
        if not args or args[1] is Any:
            return _checked(lambda v: isinstance(v, dict), f"{where} must be an object")
        convert_key, convert_value = _converter(args[0], where), _converter(args[1], where)

        def convert_dict(value: Any) -> dict[Any, Any]:
            if not isinstance(value, dict):
                raise BadRequest(f"{where} must be an object", code="bad_message")
            return {convert_key(k): convert_value(v) for k, v in value.items()}

        return convert_dict
    if dataclasses.is_dataclass(hint):  # a record inside a message, field by field as a message is
        def convert_record(value: Any) -> Any:
            if not isinstance(value, dict):
                raise BadRequest(f"{where} must be an object", code="bad_message")
            fields: dict[str, Any] = {}
            for name, required, convert in _decoders(hint):
                if name in value:
                    fields[name] = convert(value[name])
                elif required:
                    raise BadRequest(f"{where} lacks field {name!r}", code="bad_message")
            return hint(**fields)

        return convert_record
    if hint is bytes:
        def convert_hex(value: Any) -> bytes:
            if not isinstance(value, str):
                raise BadRequest(f"{where} must be hex", code="bad_message")
            try:
                return bytes.fromhex(value)
            except ValueError:
                raise BadRequest(f"{where} must be hex", code="bad_message") from None

        return convert_hex
    if hint is float:
        def convert_number(value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise BadRequest(f"{where} must be a number", code="bad_message")
            return float(value)

        return convert_number
    if hint is Any:
        return lambda value: value
    if hint is int:
        return _checked(lambda v: isinstance(v, int) and not isinstance(v, bool), f"{where} must be int")
    if hint in (str, bool):
        return _checked(lambda v: isinstance(v, hint), f"{where} must be {hint.__name__}")
    return lambda value: value


def _checked(valid: Callable[[Any], bool], problem: str) -> Converter:
    def check(value: Any) -> Any:
        if not valid(value):
            raise BadRequest(problem, code="bad_message")
        return value

    return check


# -- replies ---------------------------------------------------------------------------------------
@message("ok")
@dataclass(frozen=True)
class Ok(Message):
    pass


@message("hello_reply")
@dataclass(frozen=True)
class Welcome(Message):
    node: str
    protocol: int


@message("admitted")
@dataclass(frozen=True)
class Admitted(Message):
    """An object to receive a blob into (its descriptor comes with the reply)."""

    key: bytes
    version: int = -1
    round: int = -1


@message("submitted")
@dataclass(frozen=True)
class Submitted(Message):
    round: int
    queued: int


@message("installed")
@dataclass(frozen=True)
class Installed(Message):
    version: int


@message("model_opened")
@dataclass(frozen=True)
class ModelOpened(Message):
    """A read reference to a model (its descriptor comes with the reply)."""

    key: bytes
    version: int
    size: int


@message("text")
@dataclass(frozen=True)
class Text(Message):
    text: str


# -- records inside replies ---------------------------------------------------------------------
@dataclass(frozen=True)
class JobActivity:
    """A job on a node: what is queued and at work, and its shared memory."""

    tenant: str
    leaf_fan_in: int
    round: int | None  # the round this node's tree is working on, if any
    queued: int  # client updates admitted and not yet aggregated
    leaf: int = 0  # instances at work in each role
    middle: int = 0
    top: int = 0
    working: int = 0  # bytes of live objects of its rounds
    reserved: int = 0  # bytes reserved for aggregating its admitted updates

    def at_work(self, role: str) -> int:
        return {LEAF: self.leaf, MIDDLE: self.middle, TOP: self.top}[role]


@dataclass(frozen=True)
class InstanceCounts:
    total: int
    idle: int
    ready: int
    by_tenant: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannerCounts:
    """Cumulative since the agent started: the planner differences two snapshots (``lifl.control``)."""

    arrivals: int = 0  # client updates acknowledged here
    aggregated: int = 0  # client updates whose leaf aggregation finished here
    agg_seconds: float = 0.0  # seconds leaves spent aggregating them


@dataclass(frozen=True)
class SharedMemory:
    used: int
    pooled: int
    capacity: int
    pinned: int
    reserved: int
    objects: int
    created: int
    recycled: int


@dataclass(frozen=True)
class NodeStatus:
    """What a node's agent says of itself: answered to ``GetStatus`` and published in Redis (its
    presence there is the node's liveness), read by gateways, the controller and calibration."""

    node: str
    time: float  # when it was taken (s since the epoch)
    started: float
    instances: InstanceCounts
    jobs: dict[str, JobActivity]
    counters: dict[str, PlannerCounts]
    retention: dict[str, Any]  # lifl.node.retention's statistics by job
    shm: SharedMemory


@dataclass(frozen=True)
class TaskReport:
    """What a finished task reported (``GetRecent``): where it ran, and its function's statistics
    (``functions/aggregator``: steps' seconds, hand-off latencies, folds...)."""

    task: int
    job: str
    round: int
    instance: int
    role: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StrategyUpdate:
    """A client update a strategy reads, with the model it was trained from."""

    client: str
    key: bytes
    samples: int
    staleness: int
    base: bytes


@dataclass(frozen=True)
class QueryUpdate:
    client: str
    samples: int
    key: bytes


@dataclass(frozen=True)
class QueryRound:
    """A retained round a query reads: its updates, and the models before and after it (b"":
    not retained)."""

    round: int
    version: int
    base: bytes
    aggregate: bytes
    updates: list[QueryUpdate]


@dataclass(frozen=True)
class QueryData:
    """Where a query's objects came from."""

    objects: int
    memory: int
    store: int
    bytes_fetched: int


@dataclass(frozen=True)
class QuerySeconds:
    total: float
    fetch: float
    compute: float | None


# -- replies (continued) ----------------------------------------------------------------------------
@message("status_reply")
@dataclass(frozen=True)
class StatusReply(Message):
    status: NodeStatus


@message("recent_tasks")
@dataclass(frozen=True)
class RecentTasks(Message):
    tasks: list[TaskReport]


@message("strategy_work")
@dataclass(frozen=True)
class StrategyWork(Message):
    """What a top's strategy step reads (``StrategyInputs``): object keys held for its task."""

    seed: int  # the job's secret seed for the step's randomness
    current: bytes  # the model the round started from
    state: bytes  # the strategy's state after it; b"": none yet
    updates: list[StrategyUpdate]  # strategies that read every update of the round


@message("query_work")
@dataclass(frozen=True)
class QueryWork(Message):
    """What a query instance computes (``TakeQuery``): the workload over ``rounds``, or inference
    with ``model`` (an ``architecture``). ``mode``: "run", or "partial" (this node's part)."""

    workload: str
    params: dict[str, Any]
    job: str
    mode: str
    rounds: list[QueryRound] = field(default_factory=list)
    architecture: str = ""
    model: bytes = b""


@message("query_answer")
@dataclass(frozen=True)
class QueryAnswer(Message):
    """A query's answer on one node: its ``result``, or (split across nodes) this node's
    ``partial``, which the gateway combines with the ``peers``' own."""

    job: str
    workload: str
    node: str
    data: QueryData
    seconds: QuerySeconds
    round: int | None = None
    rounds: list[int] | None = None
    version: int | None = None
    result: dict[str, Any] | None = None
    partial: dict[str, Any] | None = None
    peers: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The answer as the gateway's API gives it (docs/api.md): what was read, the result (or
        this node's part, its peers and the parameters to combine it with), where the data came
        from and how long it took."""
        out: dict[str, Any] = {"job": self.job, "workload": self.workload}
        out.update({k: v for k, v in (("round", self.round), ("rounds", self.rounds), ("version", self.version))
                    if v is not None})
        if self.partial is not None:
            out.update(partial=self.partial, peers=self.peers, params=self.params)
        else:
            out["result"] = self.result
        return {**out, "data": record_json(self.data), "node": self.node, "seconds": record_json(self.seconds)}


@message("allocated")
@dataclass(frozen=True)
class Allocated(Message):
    key: bytes


# -- gateway -> agent ----------------------------------------------------------------------------
@message("hello", Welcome)
@dataclass(frozen=True)
class Hello(Message):
    role: str  # "gateway" (requests) or "forwarder" (the agent's forwarding requests go to it)
    protocol: int = PROTOCOL


@message("admit", Admitted)
@dataclass(frozen=True)
class Admit(Message):
    """Reserve a slot of the job's round for an update of ``size`` bytes trained from ``version``."""

    job: str
    version: int
    size: int
    lease: str = ""
    client: str = ""  # one update per client and round


@message("admit_model", Admitted)
@dataclass(frozen=True)
class AdmitModel(Message):
    job: str
    size: int


@message("admit_partial", Admitted)
@dataclass(frozen=True)
class AdmitPartial(Message):
    """Another node's result of a round, for the top hosted here."""

    job: str
    round: int
    epoch: int
    from_node: str
    size: int


@message("admit_replica", Admitted)
@dataclass(frozen=True)
class AdmitReplica(Message):
    """A copy of a job's model held by another node, to serve it from here."""

    job: str
    version: int
    size: int


@message("abort", Ok)
@dataclass(frozen=True)
class Abort(Message):
    key: bytes
    reason: str = "aborted"


@message("submit", Submitted)
@dataclass(frozen=True)
class Submit(Message):
    key: bytes
    samples: int
    client: str = ""


@message("submit_partial", Ok)
@dataclass(frozen=True)
class SubmitPartial(Message):
    key: bytes
    samples: int
    updates: int
    partial: bool  # a partial sum (accumulator dtypes), or one client's update passed on whole


@message("install_model", Installed)
@dataclass(frozen=True)
class InstallModel(Message):
    key: bytes


@message("install_replica", Ok)
@dataclass(frozen=True)
class InstallReplica(Message):
    key: bytes


@message("open_model", ModelOpened)
@dataclass(frozen=True)
class OpenModel(Message):
    job: str
    part: bool = False  # a job split across nodes: this node's part of the model (else the whole model)


@message("release", Ok)
@dataclass(frozen=True)
class Release(Message):
    key: bytes


@message("metrics", Text)
@dataclass(frozen=True)
class GetMetrics(Message):
    pass


@message("status", StatusReply)
@dataclass(frozen=True)
class GetStatus(Message):
    pass


@message("recent", RecentTasks)
@dataclass(frozen=True)
class GetRecent(Message):
    pass


@message("query", QueryAnswer)
@dataclass(frozen=True)
class Query(Message):
    """A non-training workload over the job's retained data (``lifl.flstore``). The gateway has
    checked that the caller may query the job."""

    job: str
    body: dict[str, Any]


# -- agent -> gateway (forwarder connection) ---------------------------------------------------
@message("forward_partial")
@dataclass(frozen=True)
class ForwardPartial(Message):
    """Stream this object (its descriptor comes along) to ``node``'s gateway, for the top of
    round ``round`` (epoch ``epoch``) of ``job``; ``Forwarded`` answers with the same ``ref``."""

    ref: int
    job: str
    round: int
    epoch: int
    node: str
    samples: int
    updates: int
    partial: bool
    size: int


@message("forwarded")
@dataclass(frozen=True)
class Forwarded(Message):
    ref: int
    delivered: bool
    problem: str = ""
    retry: bool = True  # False: the receiver refused it for good (the round moved on)


# -- agent <-> function instances ---------------------------------------------------------------
@message("attached")
@dataclass(frozen=True)
class Attached(Message):
    """The instance's id on the node and its key endpoint's spec; the endpoint's socket comes
    with this reply. From here on the connection is the instance's control connection."""

    instance: int
    node: str
    channel: str


@message("attach", Attached)
@dataclass(frozen=True)
class Attach(Message):
    """An instance the cluster started (a function pod on the node) asks to work as one of
    ``tenant``'s instances; the agent checks the kernel's peer credentials against the tenant."""

    tenant: str
    protocol: int = PROTOCOL


QUERY_ROLE = "query"  # an Invoke of this role runs a query (TakeQuery says which), not an aggregation task


@message("invoke")
@dataclass(frozen=True)
class Invoke(Message):
    task: int
    job: str
    version: int
    role: str
    fan_in: int  # 0: open, a close message will tell
    lazy: bool = False  # fold only once every input has arrived (a baseline, not lifl's way)
    spec: list[Any] | None = None  # the job's model spec, the first time an instance works for the job
    options: dict[str, Any] | None = None  # ...with how it aggregates: {"strategy": ..., "fixed_point": ...}
    parent_instance: int = 0  # where the parent task ran when this one started (0: not placed yet)...
    parent_task: int = 0  # ...so the result's key goes there first, before the agent hears of it
    inputs: list[list[Any]] = field(default_factory=list)  # inputs known at the start (``input_record``): no key messages
    scratch: bytes = b""  # an accumulator allocated for its first fold (its descriptor comes along), b"": none
    shard: int = 0  # the tensor shard it aggregates (options["shards"]: how the job's model is cut)


def input_record(key: bytes, samples: int, updates: int, partial: bool, sent_ns: int) -> list[Any]:
    """An input given in an ``Invoke`` (what a key message would have said of it)."""
    return [key.hex(), samples, updates, partial, sent_ns]


def input_fields(record: list[Any]) -> tuple[bytes, int, int, bool, int]:
    """(key, samples, updates, partial, sent_ns) of an ``input_record``; BadRequest if it is not one."""
    try:
        key, samples, updates, partial, sent_ns = record
        fields = (bytes.fromhex(key), int(samples), int(updates), bool(partial), int(sent_ns))
    except (TypeError, ValueError):
        raise BadRequest(f"malformed input record {str(record)[:80]}", code="bad_message") from None
    if len(fields[0]) != 16:
        raise BadRequest("an input's key is 16 bytes", code="bad_message")
    return fields


@message("cancel")
@dataclass(frozen=True)
class CancelTask(Message):
    task: int
    reason: str


@message("ready", Ok)
@dataclass(frozen=True)
class Ready(Message):
    """The instance has loaded its function and waits for invocations (it is warm)."""


@message("alloc", Allocated)
@dataclass(frozen=True)
class Alloc(Message):
    task: int
    size: int


@message("next_model", Allocated)
@dataclass(frozen=True)
class NextModel(Message):
    """The top of a sharded round asks for the object its round's next model is written into:
    one for all the round's tops, the model's header written, each writing its slice
    (``state``: the object of the strategy's next state, shared the same way)."""

    task: int
    state: bool = False


@message("step_sums")
@dataclass(frozen=True)
class StepSums(Message):
    """The answer to ``StepPartials``: b"" while other shards' tops have not sent theirs; once
    every shard's are in, to the top that completed them, their sum (float64, the shape sent),
    and that top steps every shard."""

    sums: bytes


@message("step_partials", StepSums)
@dataclass(frozen=True)
class StepPartials(Message):
    """The top of a sharded round of a strategy that reads whole updates (Krum, dp_fedavg) sends
    what its step reads of its slice (``lifl.strategy.partials``: float64, C order) and moves
    on: it never waits for the other shards' tops, which may not have an instance yet."""

    task: int
    partials: bytes


@message("secure_streams")
@dataclass(frozen=True)
class SecureStreams(Message):
    """The answer to ``SecureSeeds``: the (sign, seed hex) streams whose sum takes the task's
    clients' masks off its sum (``lifl.secagg_round.streams_of``)."""

    streams: list[list[Any]]


@message("secure_seeds", SecureStreams)
@dataclass(frozen=True)
class SecureSeeds(Message):
    """A task of a secure round has summed up its inputs: it asks what takes off the masks of
    the clients whose inputs it folded (and of ``held``, masked inputs it holds unfolded),
    answered once the round's secrets are rebuilt (an error if the round is abandoned)."""

    task: int
    held: list[bytes]


@message("folded", Allocated)
@dataclass(frozen=True)
class Folded(Message):
    """``keys`` (inputs, and the previous accumulator) are summed up in ``state``, a new object.
    With ``next_size``, the reply brings an accumulator of that size for the next fold (its
    descriptor comes along; key b"" when none was asked for)."""

    task: int
    keys: list[bytes]
    updates: int
    seconds: float
    state: bytes
    next_size: int = 0


@message("finished")
@dataclass(frozen=True)
class Finished(Message):
    """A leaf's or middle's end, in one push: its last fold (``folded`` summed up in
    ``fold_state``, in ``fold_seconds``), its result (``key``) for the parent, and its statistics.
    ``sent_to``: [instance, task] the instance sent the result's key to itself (the parent that
    ran when it started), so the agent sends it only elsewhere. The instance is free from then."""

    task: int
    key: bytes
    samples: int
    updates: int
    partial: bool
    folded: list[bytes] = field(default_factory=list)
    fold_state: bytes = b""
    fold_seconds: float = 0.0
    sent_to: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


@message("install", Installed)
@dataclass(frozen=True)
class InstallResult(Message):
    task: int
    key: bytes
    samples: int
    updates: int
    state: bytes = b""  # the strategy's state after this step (lifl.strategy), kept and checkpointed with the model
    report: dict[str, Any] = field(default_factory=dict)  # what the strategy says of the step (the rounds history shows it)


@message("strategy_inputs", StrategyWork)
@dataclass(frozen=True)
class StrategyInputs(Message):
    """The top of a round whose strategy is not plain FedAvg asks what else it reads: the model
    the round started from, the strategy's state, and (strategies that are not eager) every
    client update of the round, with the model each was trained from. The objects are held
    for the task until it ends."""

    task: int
    updates: int  # client updates the round's sum stands for: the updates to wait for


@message("take_query", QueryWork)
@dataclass(frozen=True)
class TakeQuery(Message):
    """An instance invoked with role ``query`` asks what to compute: the workload, its parameters
    and the keys of the objects it reads."""

    task: int


@message("done", Ok)
@dataclass(frozen=True)
class Done(Message):
    task: int
    stats: dict[str, Any] = field(default_factory=dict)


@message("failed", Ok)
@dataclass(frozen=True)
class Failed(Message):
    task: int
    problem: str
