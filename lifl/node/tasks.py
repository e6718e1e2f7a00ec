"""Tasks on instances, as a pure state machine: which instance runs which task, what each task
was given and has folded, when a task runs again, when an instance is started or let go.

The node's tree (``lifl.node.tree``) says which tasks exist and what their inputs are; this
board places them on the tenant's function instances and follows them to their end. Events
come in (an input for a task, a task's new fan-in, a fold reported, a task through or failed,
an instance ready or gone, a query to run, the clock for idle instances) and effects go out
(``Invoke`` an instance, ``SendKeys`` to it, ``Spawn`` or ``Stop`` one, ``CancelRun``, ``Rerun``
or ``Abandon`` a task's round, ``Release`` a task's objects). Nothing here does I/O: the agent
applies the effects, and tables test every transition.

Placement (LIFL §5.3, reuse): a task with inputs runs on an idle warm instance of its tenant
(the one used most recently: its caches are warmest), else on a new instance while the node
has room (a cold start), else waits. Producers go first (leaves, then middles, then tops): a
full node must not give its last instance to a task that waits for one still waiting. A task
whose producer runs already waits for that instance rather than starting another: it comes
free for it. Queries run on warm instances like tasks (after them), and scale out.

Crashes: a task's inputs stay held until it reports them folded into a new accumulator, so a
run that ends without a result (its instance died, or it failed) runs again from its latest
accumulator and the inputs it had not folded, up to ``MAX_TASK_ATTEMPTS`` runs; after that the
round is abandoned (the inputs may be what fails).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from lifl.control.planner import expired, pick_warm
from lifl.keys.record import KIND_CLOSE, KeyMessage
from lifl.node.tree import OPEN, Task
from lifl.protocol import LEAF, MIDDLE, QUERY_ROLE, ROLES

MAX_TASK_ATTEMPTS = 3  # runs of one task (the first and two re-runs) before its round is abandoned


@dataclass(eq=False)
class Worker:
    """A function instance as the board sees it."""

    id: int
    tenant: str
    task: int | None = None  # the task or query it runs
    ready: bool = False  # it has loaded its function (warm), not still starting
    last_used: float = 0.0
    inference: bool = False  # it loaded torch before dropping privileges: it may answer inference queries
    jobs_known: set[str] = field(default_factory=set)  # jobs whose model spec it was sent

    @property
    def idle(self) -> bool:
        return self.task is None


@dataclass(eq=False)
class Progress:
    """What a task was given and what it folded so far: enough to run it again from there."""

    unfolded: list[KeyMessage] = field(default_factory=list)  # inputs delivered, not reported folded
    state: KeyMessage | None = None  # the accumulator summing up the inputs folded so far
    folded: int = 0  # task inputs summed up in ``state``
    attempts: int = 0  # runs started
    offset: int = 0  # inputs the current run does not see one by one (``state`` stands for them)

    def start(self) -> None:
        self.attempts += 1
        self.offset = self.folded - 1 if self.state is not None else 0

    def fan_in(self, fan_in: int) -> int:
        """The task's fan-in as the current run counts its inputs."""
        return fan_in if fan_in == OPEN else fan_in - self.offset

    def inputs(self) -> list[KeyMessage]:
        """What a new run is given: the latest accumulator, then the inputs not folded into it."""
        return ([self.state] if self.state is not None else []) + self.unfolded

    def known(self) -> set[bytes]:
        return {m.key for m in self.inputs()}


# -- effects -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Invoke:
    """Run ``task`` on ``instance``, giving it ``inputs`` (first: a previous run's accumulator)."""

    instance: int
    task: Task
    fan_in: int  # as this run counts its inputs
    inputs: tuple[KeyMessage, ...]
    first_for_job: bool  # the instance has not seen the job yet: send its model spec along
    parent: tuple[int, int]  # (instance, task) of a leaf's middle if it runs already, else (0, 0)


@dataclass(frozen=True)
class InvokeQuery:
    instance: int
    query: int


@dataclass(frozen=True)
class SendKeys:
    """Messages for a running task on ``instance``."""

    instance: int
    messages: tuple[KeyMessage, ...]


@dataclass(frozen=True)
class Spawn:
    """Start instance ``instance`` of ``tenant`` (a cold start); ``preload``: for inference."""

    instance: int
    tenant: str
    reason: str  # "cold_start", "prewarm", "query"
    preload: bool = False


@dataclass(frozen=True)
class Stop:
    instance: int


@dataclass(frozen=True)
class CancelRun:
    """Tell a running task's instance to stop it (it acknowledges with Done)."""

    instance: int
    task: int
    reason: str


@dataclass(frozen=True)
class ReleaseObjects:
    """The task will not run again: let go of what it holds (inputs, accumulators, scratch)."""

    task: int


@dataclass(frozen=True)
class ReleaseScratch:
    """A run ended: its scratch objects (accumulators not reported) go; a re-run allocates again."""

    task: int


@dataclass(frozen=True)
class Rerun:
    """Say so: the task runs again (its previous run ended without a result)."""

    task: Task
    folded: int
    unfolded: int
    why: str


@dataclass(frozen=True)
class Abandon:
    """A task failed ``MAX_TASK_ATTEMPTS`` times: its round starts over."""

    task: Task
    reason: str


@dataclass(frozen=True)
class QueryFailed:
    query: int
    why: str


Effect = Invoke | InvokeQuery | SendKeys | Spawn | Stop | CancelRun | ReleaseObjects | ReleaseScratch | Rerun | Abandon | QueryFailed


@dataclass(eq=False)
class QueryWait:
    id: int
    tenant: str
    inference: bool
    instance: int = 0


class Board:
    """Every task and query of the node and the instances they run on.

    ``tasks`` is the tree's view (a task the tree has let go of is over); ``producers(task)``
    the tree's unfinished tasks whose results feed it; ``tenant_of(job)`` the job's tenant."""

    def __init__(self, max_instances: int, *, reuse: bool = True, starts_instances: bool = True) -> None:
        self.max_instances = max_instances
        self.reuse = reuse
        self.starts_instances = starts_instances  # False: instances are pods, which attach (no cold starts)
        self.workers: dict[int, Worker] = {}
        self.waiting: deque[int] = deque()  # tasks with inputs, waiting for an instance
        self.pending: dict[int, list[KeyMessage]] = {}  # inputs of tasks not running yet
        self.placed: dict[int, int] = {}  # running task -> instance
        self.running: dict[int, Task] = {}  # running task -> the task (its round may end before its instance reports)
        self.progress: dict[int, Progress] = {}  # tasks without a result yet (to run them again)
        self.queries: dict[int, QueryWait] = {}
        self.query_waiting: deque[int] = deque()
        self._next_instance = 0

    # -- instances -------------------------------------------------------------------------------
    def new_instance_id(self) -> int:
        self._next_instance += 1
        return self._next_instance

    def attached(self, instance: int, tenant: str, now: float) -> None:
        """An instance the node did not start (a pod) attached."""
        self.workers[instance] = Worker(instance, tenant, last_used=now)

    def ready(self, instance: int) -> None:
        worker = self.workers.get(instance)
        if worker is not None:
            worker.ready = True

    def gone(self, instance: int, why: str, tasks: dict[int, Task], producers: Callable[[int], list[int]],
             tenant_of: Callable[[str], str], now: float) -> list[Effect]:
        """An instance's connection closed: what it ran runs again elsewhere."""
        worker = self.workers.pop(instance, None)
        if worker is None or worker.task is None:
            return self.dispatch(tasks, producers, tenant_of, now)
        running = worker.task
        if running in self.queries:
            del self.queries[running]
            return [QueryFailed(running, f"the query's function instance {instance} died ({why})"),
                    *self.dispatch(tasks, producers, tenant_of, now)]
        task = self.running.get(running)
        if task is None:
            return self.dispatch(tasks, producers, tenant_of, now)
        return self._run_again(task, f"aggregator instance {instance} died ({why})", tasks, producers, tenant_of, now)

    # -- inputs ----------------------------------------------------------------------------------
    def deliver(self, task: Task, message: KeyMessage) -> list[Effect]:
        """An input for ``task`` (its object is now the task's): sent to it if it runs, else kept
        for its start (it waits for an instance: ``dispatch`` places it)."""
        self.progress.setdefault(task.id, Progress()).unfolded.append(message)
        instance = self.placed.get(task.id)
        if instance is not None:
            return [SendKeys(instance, (message,))]
        self.pending.setdefault(task.id, []).append(message)
        if task.id not in self.waiting:
            self.waiting.append(task.id)
        return []

    def resize(self, task: int, fan_in: int) -> list[Effect]:
        """The task's final fan-in is known; a task not started yet is invoked with it (and one
        that handed off its result has no use for it)."""
        instance = self.placed.get(task)
        progress = self.progress.get(task)
        if instance is None or progress is None:
            return []
        count = progress.fan_in(fan_in)
        return [SendKeys(instance, (KeyMessage(dest=instance, task=task, kind=KIND_CLOSE, count=count),))]

    def folded(self, task_id: int, keys: Iterable[bytes], state: bytes, sent_ns: int) -> tuple[list[KeyMessage], KeyMessage | None]:
        """The run summed ``keys`` (inputs, and its previous accumulator) up in the new
        accumulator ``state``: (the inputs it folded, the previous accumulator if it was one of
        ``keys``). ``state`` is what the task runs again from from now on."""
        progress = self.progress[task_id]
        previous = progress.state
        samples, updates = (previous.samples, previous.count) if previous is not None else (0, 0)
        inputs = []
        for key in keys:
            for i, msg in enumerate(progress.unfolded):
                if msg.key == key:
                    progress.folded += 1
                    inputs.append(progress.unfolded.pop(i))
                    samples, updates = samples + msg.samples, updates + msg.count
                    break
        progress.state = KeyMessage(dest=0, task=task_id, key=state, samples=samples, count=updates, partial=True,
                                    sent_ns=sent_ns)
        return inputs, previous if previous is not None and previous.key in keys else None

    def running_on(self, instance: int, task: int) -> Task | None:
        """The task if it runs on ``instance`` (None: it does not, or not any more)."""
        return self.running.get(task) if self.placed.get(task) == instance else None

    # -- ends ------------------------------------------------------------------------------------
    def result_exists(self, task: int) -> None:
        """The task's result is kept by its round: it will not run again from its inputs."""
        self.progress.pop(task, None)

    def through(self, instance: int, task: int, now: float) -> Task | None:
        """The instance is through with ``task`` (done, or its cancellation acknowledged): the
        task (None if it was not running there) is over; the instance is free."""
        worker = self.workers.get(instance)
        if worker is None or worker.task != task:
            return None
        worker.task, worker.last_used = None, now
        finished = self.running.pop(task, None)
        self.placed.pop(task, None)
        self.pending.pop(task, None)
        self.progress.pop(task, None)
        return finished

    def failed(self, instance: int, task: int, problem: str, tasks: dict[int, Task], producers: Callable[[int], list[int]],
               tenant_of: Callable[[str], str], now: float) -> list[Effect]:
        worker = self.workers.get(instance)
        if worker is None or worker.task != task or task not in self.running:
            return []
        worker.task, worker.last_used = None, now
        t = self.running[task]
        return self._run_again(t, f"{t.role} failed on instance {instance}: {problem}", tasks, producers, tenant_of, now)

    def cancel(self, task: int, reason: str) -> list[Effect]:
        """The tree called the task off: a running one keeps its objects until its instance
        acknowledges (it may still be writing into them); one not started lets them go now."""
        instance = self.placed.get(task)
        if instance is not None:
            return [CancelRun(instance, task, reason)]
        if task in self.waiting:
            self.waiting.remove(task)
        self.pending.pop(task, None)
        self.progress.pop(task, None)
        return [ReleaseObjects(task)]

    def _run_again(self, task: Task, why: str, tasks: dict[int, Task], producers: Callable[[int], list[int]],
                   tenant_of: Callable[[str], str], now: float) -> list[Effect]:
        self.placed.pop(task.id, None)
        self.running.pop(task.id, None)
        effects: list[Effect] = [ReleaseScratch(task.id)]
        progress = self.progress.get(task.id)
        if task.id not in tasks:  # called off (its round ended here) before its instance acknowledged
            self.pending.pop(task.id, None)
            self.progress.pop(task.id, None)
            return effects + [ReleaseObjects(task.id), *self.dispatch(tasks, producers, tenant_of, now)]
        if progress is None:  # it handed off its result before it went
            self.pending.pop(task.id, None)
            return effects + [ReleaseObjects(task.id), *self.dispatch(tasks, producers, tenant_of, now)]
        if progress.attempts < MAX_TASK_ATTEMPTS:
            effects.append(Rerun(task, progress.folded if progress.state else 0, len(progress.unfolded), why))
            self.pending[task.id] = progress.inputs()
            if task.id not in self.waiting:
                self.waiting.append(task.id)
            return effects + self.dispatch(tasks, producers, tenant_of, now)
        self.pending.pop(task.id, None)
        self.progress.pop(task.id, None)
        return effects + [ReleaseObjects(task.id),
                          Abandon(task, f"{task.role} failed {progress.attempts} times, last: {why}"),
                          *self.dispatch(tasks, producers, tenant_of, now)]

    # -- queries ---------------------------------------------------------------------------------
    def query(self, query: int, tenant: str, inference: bool, tasks: dict[int, Task],
              producers: Callable[[int], list[int]], tenant_of: Callable[[str], str], now: float) -> list[Effect]:
        self.queries[query] = QueryWait(query, tenant, inference)
        self.query_waiting.append(query)
        return self.dispatch(tasks, producers, tenant_of, now)

    def query_over(self, instance: int, query: int, now: float) -> None:
        """A query's run ended (answered or failed); its instance is free."""
        self.queries.pop(query, None)
        worker = self.workers.get(instance)
        if worker is not None and worker.task == query:
            worker.task, worker.last_used = None, now

    def drop_query(self, query: int) -> list[Effect]:
        """A query timed out: one still waiting is forgotten, a running one's instance goes
        (it computes for nobody: its slot goes to others)."""
        q = self.queries.pop(query, None)
        if q is None:
            return []
        if query in self.query_waiting:
            self.query_waiting.remove(query)
            return []
        return [self.stop(q.instance)] if q.instance else []

    # -- placement -------------------------------------------------------------------------------
    def dispatch(self, tasks: dict[int, Task], producers: Callable[[int], list[int]], tenant_of: Callable[[str], str],
                 now: float) -> list[Effect]:
        """Give waiting tasks instances (see the module docstring), then waiting queries."""
        effects: list[Effect] = []
        for task_id in [t for t in self.waiting if t not in tasks]:
            self.waiting.remove(task_id)
        for task_id in sorted(self.waiting, key=lambda t: ROLES.index(tasks[t].role)):
            task = tasks[task_id]
            tenant = tenant_of(task.job)
            worker = self._idle(tenant) if self.reuse else None
            reason = "warm"
            if worker is None:
                if self.reuse and self._producer_running(task_id, producers):
                    continue  # its input's producer is about to be idle: it takes over, no cold start
                worker = self._spawn(tenant, "cold_start", effects, now)
                reason = "cold"
                if worker is None:
                    continue
            self.waiting.remove(task_id)
            effects.append(self._start(worker, task, tasks, reason, now))
        for query in list(self.query_waiting):
            q = self.queries[query]
            worker = self._idle(q.tenant, q.inference) or self._spawn_for_query(q, effects, now)
            if worker is None:
                continue
            self.query_waiting.remove(query)
            worker.task, q.instance = query, worker.id
            effects.append(InvokeQuery(worker.id, query))
        return effects

    def _start(self, worker: Worker, task: Task, tasks: dict[int, Task], reason: str, now: float) -> Invoke:
        worker.task, worker.last_used = task.id, now
        self.placed[task.id] = worker.id
        self.running[task.id] = task
        progress = self.progress.setdefault(task.id, Progress())
        progress.start()
        first = task.job not in worker.jobs_known
        worker.jobs_known.add(task.job)
        inputs = tuple(self.pending.pop(task.id, []))
        return Invoke(worker.id, task, progress.fan_in(task.fan_in), inputs, first, self._parent(task, tasks))

    def _parent(self, task: Task, tasks: dict[int, Task]) -> tuple[int, int]:
        """A leaf's middle, if it runs already: the leaf sends its result's key there itself."""
        if task.role != LEAF:
            return 0, 0
        for other, instance in self.placed.items():
            t = self.running.get(other)
            if t is not None and t.role == MIDDLE and (t.job, t.round, t.shard) == (task.job, task.round, task.shard):
                return instance, other
        return 0, 0

    def _producer_running(self, task: int, producers: Callable[[int], list[int]]) -> bool:
        """Whether an instance runs one of the task's producers. Only such an instance is sure to
        come free for it: any other busy one may hold a task that waits for this one."""
        return any(p in self.placed for p in producers(task))

    def _idle(self, tenant: str, inference: bool = False) -> Worker | None:
        chosen = pick_warm((w for w in self.workers.values() if w.inference or not inference), tenant)
        return self.workers[chosen] if chosen is not None else None

    def _spawn(self, tenant: str, reason: str, effects: list[Effect], now: float, preload: bool = False) -> Worker | None:
        if not self.starts_instances or len(self.workers) >= self.max_instances:
            return None
        instance = self.new_instance_id()
        worker = self.workers[instance] = Worker(instance, tenant, last_used=now, inference=preload)
        effects.append(Spawn(worker.id, tenant, reason, preload))
        return worker

    def _spawn_for_query(self, q: QueryWait, effects: list[Effect], now: float) -> Worker | None:
        """A cold start for a query; one that needs torch may take the place of an idle
        instance without it."""
        if q.inference and self.starts_instances and len(self.workers) >= self.max_instances:
            idle = self._idle(q.tenant) or next((w for w in self.workers.values() if w.task is None), None)
            if idle is None:
                return None
            effects.append(self.stop(idle.id))
        return self._spawn(q.tenant, "query", effects, now, preload=q.inference)

    # -- keeping instances -----------------------------------------------------------------------
    def expire(self, now: float, keep_warm: float, keep: dict[str, int]) -> list[Effect]:
        """Scale to zero: idle instances past ``keep_warm`` go, beyond ``keep`` (per tenant, what
        the planner wants warm). Pods are the cluster's to scale down."""
        if not self.starts_instances:
            return []
        keep = dict(keep)
        effects: list[Effect] = []
        for instance in expired(list(self.workers.values()), now, keep_warm):
            tenant = self.workers[instance].tenant
            if keep.get(tenant, 0) > 0:
                keep[tenant] -= 1
                continue
            effects.append(self.stop(instance))
        return effects

    def stop(self, instance: int) -> Stop:
        """Let an instance go: it takes no task from now on (its end is reported by ``gone``)."""
        self.workers.pop(instance, None)
        return Stop(instance)

    def warm(self, wanted: dict[str, int], tasks: dict[int, Task], producers: Callable[[int], list[int]],
             tenant_of: Callable[[str], str], now: float) -> list[Effect]:
        """Start the instances the planner wants warm ahead of the load (§5.2)."""
        if not self.starts_instances:
            return []
        effects: list[Effect] = []
        for tenant, count in wanted.items():
            have = sum(1 for w in self.workers.values() if w.tenant == tenant)
            for _ in range(max(0, min(count - have, self.max_instances - len(self.workers)))):
                self._spawn(tenant, "prewarm", effects, now)
        return effects + self.dispatch(tasks, producers, tenant_of, now)

    def counts(self) -> dict[str, int]:
        """Instances by what they do: a role, a query, or idle."""
        out = dict.fromkeys((*ROLES, QUERY_ROLE, "idle"), 0)
        for w in self.workers.values():
            task = self.running.get(w.task) if w.task is not None else None  # the tree may have called it off already
            out[task.role if task else QUERY_ROLE if w.task in self.queries else "idle"] += 1
        return out
