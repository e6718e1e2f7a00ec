"""A Flower strategy that aggregates in lifl: ``LiflFedAvg`` replaces Flower's ``FedAvg`` in a
ServerApp (docs/flower.md). Clients still reply through Flower; each reply's arrays go to a lifl
node as soon as the ServerApp has pulled it, the node aggregates them eagerly in its hierarchy
(any lifl strategy: ``lifl_strategy``), and the new global arrays come back to Flower.

It runs in Flower's environment, so it imports only numpy, flwr and lifl's client SDK.

Design:
- As they arrive. Flower 1.41's ``Strategy.start`` collects a round's replies with
  ``grid.send_and_receive`` and only then calls ``aggregate_train``: the ServerApp holds every
  reply at once. ``start`` here hands Flower's loop a grid (``streaming(grid)``) whose
  ``send_and_receive`` of *training* messages pushes them as Flower does, then pulls the replies
  one message id at a time (``pull_messages([id])``, polled every ``poll_interval_s`` like
  Flower's 3 s): each reply is converted, pushed to lifl, and its ArrayRecord dropped before the
  next is pulled, so the ServerApp holds one reply (plus its update blob) at a time. What goes
  back to Flower are the replies without their arrays: metrics and errors are Flower's to log
  and aggregate. Evaluation, sampling and every other message go through Flower unchanged. A
  ServerApp with a loop of its own sends its training messages through ``streaming(grid)`` and
  calls ``aggregate_train`` as usual (lifl/bench/flowerapp/server_app.py does).
- Rounds. lifl closes a round when it has its goal, so the goal of the lifl job is the number of
  training messages a round sends; the job is created on the first training round from the
  arrays those messages carry (its layout and initial model), and a new job (the current arrays
  as its model) is created whenever that number changes. A round short of replies (errors,
  Flower's timeout) closes at the job's ``round_deadline_s`` (lifl offers no call to close a
  round early), with what arrived if at least ``min_updates``; fewer and lifl abandons the
  round, ``aggregate_train`` returns no arrays and Flower keeps the current ones, as FedAvg does
  with no replies. The deadline runs from when the lifl round opens (the previous model's
  installation), so it must cover Flower's evaluation plus the slowest training reply; its
  default is Flower's own round timeout (3600 s). The global arrays a round sends are taken to
  be the lifl job's current model: a loop that changes them between rounds must use a new bridge.
- Arrays. A reply's numpy Arrays are read in place from Flower's serialized bytes (the .npy
  payload, no copy) and copied once into the update blob (``to_blob``); the new global model is
  fetched with ``Gateway.model`` and its views (``from_blob``) become Flower Arrays with the
  initial model's keys, order and dtypes (lifl keeps dtypes: an int64 buffer stays int64 where
  Flower's FedAvg returns float64). lifl takes bfloat16, float16/32/64 and int32/64 arrays; others
  are refused before anything is sent. numpy has no bfloat16: a Flower Array of ml_dtypes'
  bfloat16 (what LLM clients send) says "bfloat16" in its dtype field and holds 2-byte voids in
  its .npy payload; the bridge reads those as the bits they are (BF16 in lifl) and sends bfloat16
  Arrays back the same way, so the ServerApp needs no ml_dtypes.
- Weights. ``weighted_by_key`` ("num-examples") of each reply's MetricRecord is the update's
  sample count, FedAvg's weight: a positive integer (an integral float is taken).
"""

from __future__ import annotations

import io
import logging
import math
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

from lifl import errors
from lifl import format as fmt
from lifl.client import Gateway, RetryPolicy, from_blob, to_blob

log = logging.getLogger("lifl.flower")

LIFL_DTYPES = frozenset(d.storage for d in fmt.WIRE_DTYPES.values() if d is not fmt.BF16)  # numpy has no bfloat16
BFLOAT16 = "bfloat16"  # a Flower Array's dtype field for ml_dtypes' bfloat16 (its .npy payload: 2-byte voids)
MAX_SAMPLES = 1 << 53
DEFAULT_ROUND_DEADLINE_S = 3600.0  # Flower's Strategy.start timeout
PROBE_RETRY = RetryPolicy(max_attempts=3, max_elapsed_s=5.0)  # a wrong address fails within seconds, not a minute
_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_ROUND_OVER = ("abandoned", "interrupted")  # closed with no new version


# -- conversions (pure) --------------------------------------------------------------------------------


def npy_view(data: bytes) -> np.ndarray:
    """The array a .npy payload holds, viewing its bytes (read-only, no copy)."""
    stream = io.BytesIO(data)  # shares the bytes until written to
    version = np.lib.format.read_magic(stream)
    if version not in _NPY_HEADERS:
        return np.load(io.BytesIO(data), allow_pickle=False)  # a format numpy.save seldom writes: one copy
    shape, fortran, dtype = _NPY_HEADERS[version](stream)
    return np.frombuffer(data, dtype, math.prod(shape), stream.tell()).reshape(shape, order="F" if fortran else "C")


def record_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The numpy arrays of a Flower ArrayRecord, in its order, as lifl can aggregate them
    (bfloat16 ones as the uint16 of their bits: ``bfloat16_keys`` names them)."""
    out = {}
    for key, array in record.items():
        if array.stype != "numpy.ndarray":
            raise errors.BadRequest(f"array {key!r} is serialized as {array.stype!r}; the lifl bridge takes numpy arrays",
                                    code="unsupported_stype")
        view = npy_view(array.data)
        if array.dtype == BFLOAT16 and view.dtype.kind == "V" and view.dtype.itemsize == 2:
            view = view.view(np.uint16)
        elif view.dtype.newbyteorder("<") not in LIFL_DTYPES:
            raise errors.BadRequest(f"array {key!r} has dtype {array.dtype} (.npy {view.dtype.str}); lifl aggregates "
                                    "bfloat16, float16, float32, float64, int32 and int64 arrays", code="unsupported_dtype")
        out[key] = view
    return out


def bfloat16_keys(record: ArrayRecord) -> frozenset[str]:
    """The arrays of ``record`` that are bfloat16."""
    return frozenset(key for key, array in record.items() if array.dtype == BFLOAT16)


def record_blob(record: ArrayRecord) -> bytearray:
    """A Flower ArrayRecord as a lifl update blob (one copy of its arrays)."""
    return to_blob(record_arrays(record), dtypes={key: fmt.BF16.name for key in bfloat16_keys(record)})


def global_record(arrays: Mapping[str, np.ndarray], keys: list[str], bfloat16: frozenset[str] = frozenset()) -> ArrayRecord:
    """lifl's global model as a Flower ArrayRecord with the initial model's keys and order; the
    ``bfloat16`` ones (uint16 bits in ``arrays``) as Arrays of ml_dtypes' bfloat16 would be."""
    return ArrayRecord({k: _bfloat16_array(arrays[k]) if k in bfloat16 else Array(arrays[k]) for k in keys})


def _bfloat16_array(bits: np.ndarray) -> Array:
    npy = io.BytesIO()
    np.save(npy, bits.view(np.dtype("V2")), allow_pickle=False)
    return Array(dtype=BFLOAT16, shape=tuple(bits.shape), stype="numpy.ndarray", data=npy.getvalue())


def sample_count(value: Any, key: str) -> int:
    """A reply's weight as lifl's sample count: a positive integer up to 2^53."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or not 1 <= value <= MAX_SAMPLES:
        raise errors.BadRequest(f"metric {key!r} is lifl's update weight and must be a positive integer "
                                f"(at most 2^53), got {value!r}", code="bad_weight")
    return int(value)


# -- the strategy -------------------------------------------------------------------------------------


@dataclass
class _Job:
    name: str
    goal: int
    keys: list[str]  # the model's arrays, in Flower's order
    bfloat16: frozenset[str]  # those that are bfloat16
    version: int = 0  # the version Flower's global arrays are


@dataclass
class _Round:
    base_version: int
    round_id: int  # lifl's round open when the training messages were sent
    pushed: int = 0
    client_ids: set[str] = field(default_factory=set)


# replies pushed but not yet folded that the node holds at once: the bound on its memory for a round
# (more are refused with 503 and pushed again by the SDK as the leaves fold: the ServerApp waits)
DEFAULT_MAX_INFLIGHT = 4


class LiflFedAvg(FedAvg):
    """Flower's FedAvg with aggregation in lifl. ``gateway`` is a lifl gateway's address (host:port,
    or https://...); ``token`` one allowed to create jobs and push updates naming clients (default:
    $LIFL_TOKEN); ``job`` the lifl job's name (default: flower-<random>); ``lifl_strategy`` how lifl
    aggregates (``{"name": ..., params}``, docs/strategies.md; default fedavg); ``round_deadline_s`` and
    ``min_updates`` when a round short of replies closes; ``job_options`` any other lifl job field
    (docs/api.md). Everything else is FedAvg's."""

    def __init__(self, gateway: str = "", *, token: str | None = None, protocol: str = "http", job: str = "",
                 lifl_strategy: Mapping[str, Any] | None = None, round_deadline_s: float = DEFAULT_ROUND_DEADLINE_S,
                 min_updates: int = 1, job_options: Mapping[str, Any] | None = None, poll_interval_s: float = 3.0,
                 **fedavg: Any) -> None:
        super().__init__(**fedavg)
        if not gateway:
            raise errors.BadRequest("LiflFedAvg needs the address of a lifl gateway (host:port)", code="no_gateway")
        probe = Gateway(gateway, protocol, retry=PROBE_RETRY, token=token)
        try:
            probe.jobs()  # unreachable, or a token the gateway refuses: say so now, before any client trains
        except (errors.LiflError, OSError) as e:
            e.add_note(f"LiflFedAvg: the lifl gateway at {gateway} cannot be used")
            raise
        finally:
            probe.close()
        self.lifl = Gateway(gateway, protocol, token=token)
        self.job_name = job or f"flower-{secrets.token_hex(4)}"
        self.job_fields = {"round_deadline_s": round_deadline_s, "min_updates": min_updates,
                           "max_inflight": DEFAULT_MAX_INFLIGHT, **(job_options or {})}
        if lifl_strategy is not None:  # passed through as it is; without one the job aggregates with fedavg
            self.job_fields["strategy"] = dict(lifl_strategy)
        self.poll_interval_s = poll_interval_s
        self._jobs = 0
        self._job: _Job | None = None
        self._round: _Round | None = None

    # -- Flower's entry points ------------------------------------------------------------------------

    def start(self, grid: Grid, *args: Any, **kwargs: Any) -> Any:
        """Flower's round loop, its training replies streamed into lifl."""
        return super().start(self.streaming(grid), *args, **kwargs)

    def streaming(self, grid: Grid) -> Grid:
        """``grid``, with training replies pushed to lifl one at a time as they are pulled."""
        return _StreamingGrid(grid, self)

    def summary(self) -> None:
        super().summary()
        log.info("lifl: gateway %s, job %s, fields %s", self.lifl.address, self.job_name, self.job_fields)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Wait for lifl's aggregate of the round's replies (any not streamed yet are pushed now)."""
        valid, _ = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        for reply in valid:
            if reply.content.array_records:
                self.take_reply(reply)
        metrics = None
        if valid:
            contents = [m.content for m in valid]
            validate_message_reply_consistency(contents, self.weighted_by_key, check_arrayrecord=False)
            metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        return self._finish_round(), metrics

    # -- rounds ----------------------------------------------------------------------------------------

    def open_round(self, messages: list[Message]) -> None:
        """A training round is sent: make sure a lifl job with this many updates a round holds the
        arrays the messages carry, and note the round's base."""
        arrays = messages[0].content[self.arrayrecord_key]
        if self._job is None or self._job.goal != len(messages):
            self._job = self._create_job(arrays, len(messages))
        status = self.lifl.job(self._job.name)
        self._round = _Round(self._job.version, status["round"]["id"])

    def _create_job(self, arrays: ArrayRecord, goal: int) -> _Job:
        model = record_blob(arrays)
        self._jobs += 1
        name = self.job_name if self._jobs == 1 else f"{self.job_name}-{self._jobs}"
        self.lifl.create_job(name, goal, **self.job_fields)
        self.lifl.set_model(name, model)
        log.info("lifl: job %s created, %d updates a round", name, goal)
        return _Job(name, goal, list(arrays), bfloat16_keys(arrays))

    def take_reply(self, reply: Message) -> Message:
        """Push a training reply's arrays to lifl and drop them from the reply (errors pass as they are)."""
        if reply.has_error():
            return reply
        if self._job is None or self._round is None:
            raise errors.BadRequest("a training reply came before its round was sent through LiflFedAvg.streaming(grid)",
                                    code="no_round")
        validate_message_reply_consistency([reply.content], self.weighted_by_key, check_arrayrecord=True)
        metrics = next(iter(reply.content.metric_records.values()))
        samples = sample_count(metrics[self.weighted_by_key], self.weighted_by_key)
        (key, record), = reply.content.array_records.items()
        client = f"flower-{reply.metadata.reply_to_message_id or reply.metadata.message_id}"[:256]
        blob = record_blob(record)
        del reply.content[key]  # the ServerApp keeps the reply's metrics, not its arrays
        del record
        try:
            self.lifl.push(self._job.name, blob, samples=samples, base_version=self._round.base_version, client=client)
            self._round.pushed += 1
        except errors.Conflict as e:  # the round closed (its deadline) or moved on: this reply is not counted
            log.warning("lifl: a reply from node %d was not taken: %s", reply.metadata.src_node_id, e)
        return reply

    def _finish_round(self) -> ArrayRecord | None:
        """The round's new global arrays once lifl has them; None if nothing was pushed or lifl
        abandoned the round (fewer than min_updates at its deadline)."""
        job, rnd, self._round = self._job, self._round, None
        if job is None or rnd is None or rnd.pushed == 0:
            return None
        delay = 0.02
        while True:
            status = self.lifl.job(job.name)
            if status["version"] is not None and status["version"] > rnd.base_version:
                break
            last = status.get("last_round") or {}
            if last.get("outcome") in _ROUND_OVER and last.get("round", -1) >= rnd.round_id:
                log.warning("lifl: round %s of job %s was %s: the global arrays stay as they were",
                            last["round"], job.name, last["outcome"])
                return None
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        version, blob = self.lifl.model(job.name)
        job.version = version
        return global_record(from_blob(blob), job.keys, job.bfloat16)


class _StreamingGrid(Grid):
    """A Grid whose training rounds go through the bridge reply by reply; the rest is ``grid``'s."""

    def __init__(self, grid: Grid, bridge: LiflFedAvg) -> None:
        self._grid, self._bridge = grid, bridge

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        return self._grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        if not any(m.metadata.message_type == MessageType.TRAIN for m in messages):
            return self._grid.send_and_receive(messages, timeout=timeout)
        self._bridge.open_round(messages)
        pending = [i for i in self._grid.push_messages(messages) if i]  # None: a message Flower could not push
        del messages
        end = time.time() + timeout if timeout is not None else math.inf
        replies: list[Message] = []
        while pending:
            for message_id in list(pending):
                for reply in self._grid.pull_messages([message_id]):  # one reply in memory at a time
                    pending.remove(message_id)
                    replies.append(self._bridge.take_reply(reply))
            if not pending or time.time() >= end:
                break
            time.sleep(min(self._bridge.poll_interval_s, max(0.0, end - time.time())))
        return replies
