"""Stages as data: a table of stage specs and one generic worker that claims, fetches and puts through
``msrl_core.Dock``; :class:`StageRunner` runs them in the order the trainer's step writes.

Every stage of a GRPO iteration is a row of :func:`grpo_stages`: the columns it reads (its dock controller's
readiness condition), the columns it writes, how many rows it claims at a time, and the layout it fetches
(``padded``: one ``[rows, width]`` tensor per ragged column, what the model stages feed to the engine). The
step (``GRPOTrainer.step``) calls them top to bottom: ``start`` the streaming stages (reference,
rule_reward, adv claim each group as soon as the rollout has put it), ``run`` the rollout, ``run`` old_log_p
when off-policy, ``join`` the streaming stages, ``run`` the update. A worker consumes every row of the
iteration exactly once (the dock's guarantee; ``progress()`` counts it).

Placement is a column of the table too: ``"trainer"`` stages need the training process's models
(rollout, reference, old_log_p, update) and run beside their engines, colocated as MindSpeed-RL colocates
actor, reference and rollout in one worker group; ``"actor"`` stages (rule_reward, adv) need no model: with a
Ray dock they run as Ray actors with a fractional CPU (:data:`ACTOR_NUM_CPUS`) that claim, fetch and put
through the same dock; with a local dock they are threads. Their work must then be a picklable callable (the
reward function is imported again inside the actor, see :class:`msrl_core.trainer.grpo.RewardWork`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msrl_core import Column, Dock
from msrl_core.errors import Timeout
from msrl_core.trainer.metrics import StageClock


class StageError(RuntimeError):
    """A stage worker failed; names the stage and carries the original error as ``__cause__``."""

    def __init__(self, stage: str, error: BaseException, tb: str = "") -> None:
        super().__init__(f"stage '{stage}' failed: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error
        self.tb = tb


@dataclass(frozen=True)
class StageSpec:
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    rows_per_claim: int  # rows claimed at a time (whole groups); the full batch for the update
    placement: str = "trainer"  # "trainer": beside the engines; "actor": a Ray actor (Ray dock)
    layout: str = "packed"  # how ragged columns are fetched: "packed" (Ragged) or "padded" (torch, one call)
    dp: int = 0  # 0: one worker; D >= 1: a stage of the D data-parallel replicas (DP-aware claims)


#: Where a stage may run: beside the training process's engines, or anywhere (a Ray actor).
PLACEMENTS = ("trainer", "actor")
#: CPUs a Ray stage actor asks for (fractional: a few stage actors share one core with the trainer).
ACTOR_NUM_CPUS = 0.25


#: Columns of the GRPO dock. Ragged columns hold one variable-length row per sample.
COLUMNS: dict[str, Column] = {
    "prompts": Column("int64", ragged=True),
    "index": Column("int64"),  # record index (answer lookup for the reward)
    "responses": Column("int64", ragged=True),
    "rollout_log_prob": Column("float32", ragged=True),
    "ref_log_prob": Column("float32", ragged=True),
    "old_log_prob": Column("float32", ragged=True),
    "scores": Column("float32"),
    "advantages": Column("float32"),
}


def grpo_stages(
    batch_rows: int,
    group_size: int,
    claim_groups: int,
    use_reference: bool,
    recompute_old: bool,
    dp: int = 0,
) -> list[StageSpec]:
    """The GRPO iteration as data. ``use_reference``: the KL loss needs the reference policy.
    ``recompute_old``: off-policy updates (several mini-batches or epochs) need the old log-probs
    recomputed by the trainer; exactly on-policy, the update's own first forward is the old policy.
    ``dp`` >= 1: the model stages (reference, old_log_p, update) claim for that many replicas at once and
    their work takes one batch per replica (0: one batch, as a plain stage)."""
    chunk = min(batch_rows, claim_groups * group_size)
    upd_reads = ["prompts", "responses", "rollout_log_prob", "advantages"]
    table = [StageSpec("rollout", ("prompts",), ("responses", "rollout_log_prob"), chunk)]
    if use_reference:
        table.append(
            StageSpec("reference", ("prompts", "responses"), ("ref_log_prob",), chunk, layout=PADDED, dp=dp)
        )
        upd_reads.append("ref_log_prob")
    table.append(
        StageSpec("rule_reward", ("prompts", "responses", "index"), ("scores",), chunk, placement="actor")
    )
    table.append(StageSpec("adv", ("scores",), ("advantages",), chunk, placement="actor"))
    if recompute_old:
        table.append(
            StageSpec("old_log_p", ("prompts", "responses"), ("old_log_prob",), chunk, layout=PADDED, dp=dp)
        )
        upd_reads.append("old_log_prob")
    table.append(StageSpec("update", tuple(upd_reads), (), batch_rows, layout=PADDED, dp=dp))
    return table


#: The stages that stream behind the rollout (claim each group as soon as it is ready).
STREAMING = ("reference", "rule_reward", "adv")
PADDED = "padded"


def make_dock(stages: list[StageSpec], batch_rows: int, group_size: int, warehouses: int, **kw: Any) -> Dock:
    used = {c for s in stages for c in s.reads + s.writes}
    return Dock(
        columns={k: v for k, v in COLUMNS.items() if k in used},
        stages={s.name: list(s.reads) for s in stages},
        capacity=batch_rows,
        group_size=group_size,
        warehouses=warehouses,
        **kw,
    )


#: A stage's work: a fetched batch -> the columns it writes (or None when it writes none), or a pair
#: ``(outputs, metrics)`` whose metrics map a name to per-row values (the step reports their mean).
Work = Callable[[Any], Any]
Record = Callable[[str, float, float], None]
Report = Callable[[Mapping[str, Any]], None]


def work_loop(
    dock: Dock,
    spec: StageSpec,
    work: Work,
    record: Record,
    count: Callable[[str], None],
    check: Callable[[], None],
    report: Report | None = None,
) -> None:
    """One stage's iteration: claim whole groups as they become ready, fetch what it reads, run ``work``,
    put what it writes, until it has consumed every row. ``check()`` raises to stop (deadline, another
    stage failed); the same loop runs in a driver thread and inside a Ray stage actor."""
    total, done = dock.capacity, 0
    while done < total:
        check()
        if spec.dp >= 1:
            n = _replica_round(
                dock, spec, work, min(spec.rows_per_claim * spec.dp, total - done), count, report
            )
            if n:
                record(spec.name, *n[1:])
                done += n[0]
            continue
        want = min(spec.rows_per_claim, total - done)
        try:
            meta = dock.claim(spec.name, max_rows=want, timeout=0.1, min_rows=want)
        except Timeout:
            continue
        t0 = time.perf_counter()
        count("claim")
        batch = _fetch(dock, spec, meta)
        count("fetch")
        out = _run_work(work, batch, report)
        if spec.writes:
            if out is None:
                raise RuntimeError(f"stage {spec.name} returned nothing; it must write {spec.writes}")
            dock.put(dict(out), rows=meta)
            count("put")
        record(spec.name, t0, time.perf_counter())
        done += len(meta)


_ROUNDS = itertools.count()


def _run_work(work: Work, batch: Any, report: Report | None) -> Any:
    """``work(batch)``'s outputs; the metrics of an ``(outputs, metrics)`` pair go to ``report``."""
    out = work(batch)
    if isinstance(out, tuple):
        out, metrics = out
        if report is not None:
            report(metrics)
    return out


def _fetch(dock: Dock, spec: StageSpec, meta: Any) -> Any:
    if spec.layout == PADDED:
        return dock.fetch(meta, list(spec.reads), layout=PADDED, output="torch")
    return dock.fetch(meta, list(spec.reads))


def _replica_round(
    dock: Dock,
    spec: StageSpec,
    work: Work,
    want: int,
    count: Callable[[str], None],
    report: Report | None,
) -> tuple[int, float, float] | None:
    """One round of a replica stage: ``want`` ready rows (whole groups) split over the ``spec.dp``
    replicas by the dock's DP-aware claims (token-balanced by its ``balance_by`` column; one replica: a
    plain claim); ``work`` gets one batch per replica (None for an empty share) and returns one output
    per replica (and metrics). Returns (rows, start, end), or None when fewer than ``want`` were ready."""
    D = spec.dp
    try:
        if D == 1:
            metas = [dock.claim(spec.name, max_rows=want, timeout=0.1, min_rows=want)]
        else:
            # the dock's DP sizes are per replica: the round takes D x max_rows at most, D x min_rows at least
            b, least = f"{spec.name}:{next(_ROUNDS)}", -(-want // D)
            metas = [
                dock.claim(
                    spec.name, max_rows=want, timeout=0.1, min_rows=least, dp_rank=r, dp_size=D, batch=b
                )
                for r in range(D)
            ]
    except Timeout:
        return None
    t0 = time.perf_counter()
    for _ in metas:
        count("claim")
    batches = [_fetch(dock, spec, m) if len(m) else None for m in metas]
    for m in metas:
        if len(m):
            count("fetch")
    out = _run_work(work, batches, report)
    if spec.writes:
        if out is None or len(out) != D:
            raise RuntimeError(
                f"stage {spec.name} must return one output per replica ({D}) with {spec.writes}"
            )
        for m, o in zip(metas, out):
            if len(m):
                dock.put(dict(o), rows=m)
                count("put")
    return sum(len(m) for m in metas), t0, time.perf_counter()


class StageRunner:
    """Runs the stages of one iteration in the order the caller writes (see the module docstring); every
    wait has a deadline and the first failure stops the others.

    ``remote=True`` (a Ray dock): the stages placed ``"actor"`` run as Ray actors with
    :data:`ACTOR_NUM_CPUS` CPUs each, created once here and reused every iteration (their work functions
    must be picklable); the others are threads of this process. Call :meth:`close` to end the actors.
    """

    def __init__(
        self,
        dock: Dock,
        stages: list[StageSpec],
        work: Mapping[str, Work],
        deadline_s: float,
        remote: bool = False,
    ) -> None:
        missing = [s.name for s in stages if s.name not in work]
        if missing:
            raise ValueError(f"no work function for stages {missing}")
        bad = [(s.name, s.placement) for s in stages if s.placement not in PLACEMENTS]
        if bad:
            raise ValueError(f"stage placements {bad} are not among {PLACEMENTS}")
        self.dock, self.work, self.deadline_s = dock, work, deadline_s
        self.specs = {s.name: s for s in stages}
        self.counts: dict[str, int] = {}  # dock operations of the last iteration (the trainer's own count)
        self.metrics: dict[str, list[float]] = {}  # per-row values the stages' work reported, last iteration
        self._lock = threading.Lock()
        self.actors: dict[str, Any] = {}
        if remote:
            self.actors = {
                s.name: _start_actor(dock, s, work[s.name]) for s in stages if s.placement == "actor"
            }
        self._clock = StageClock()
        self._stop = threading.Event()
        self._errors: list[StageError] = []
        self._threads: list[threading.Thread] = []
        self._pending: dict[Any, str] = {}
        self._deadline = 0.0

    def close(self) -> None:
        """End the stage actors (if any). Calling it again does nothing."""
        if self.actors:
            import ray

            for a in self.actors.values():
                ray.kill(a)
            self.actors = {}

    # ---- one iteration ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def iteration(self, clock: StageClock) -> Iterator[StageRunner]:
        """One iteration's scope: the deadline starts now; on leaving (normally or on an error) the
        background stages are stopped if still running and joined, and the first failure is raised."""
        self._clock, self._stop, self._errors = clock, threading.Event(), []
        self.counts = {"put": 1, "claim": 0, "fetch": 0}  # the driver's put of the prompts
        self.metrics = {}
        self._deadline = time.monotonic() + self.deadline_s
        try:
            yield self
        except BaseException:
            self._stop.set()
            self._wait_background()
            raise
        self.join()

    def start(self, names: Sequence[str]) -> None:
        """Start the stages ``names`` in the background (threads, or their Ray actors); they claim rows as
        soon as they are ready. :meth:`join` waits for them."""
        for name in names:
            if name not in self.specs:
                continue
            if name in self.actors:
                self._pending[self.actors[name].run.remote(max(0.0, self._deadline - time.monotonic()))] = (
                    name
                )
                continue
            t = threading.Thread(
                target=self._background, args=(name,), name=f"msrl-stage-{name}", daemon=True
            )
            self._threads.append(t)
            t.start()

    def run(self, name: str) -> dict[str, float]:
        """Run stage ``name`` in this thread until it consumed every row; returns the means of the metrics
        its work reported. A background stage's failure stops it and is raised instead."""
        try:
            before = {k: len(v) for k, v in self.metrics.items()}
            self._loop(name)
        except _Stopped:
            self._raise_first()
            raise
        except BaseException as e:
            self._stop.set()
            raise StageError(name, e, traceback.format_exc()) from e
        with self._lock:
            new = {k: v[before.get(k, 0) :] for k, v in self.metrics.items()}
        return {k: sum(v) / len(v) for k, v in new.items() if v}

    def join(self) -> None:
        """Wait for the background stages (within the deadline); raise the first failure."""
        self._wait_background()
        self._raise_first()

    def metric_means(self) -> dict[str, float]:
        """The mean of every metric the stages reported in the last iteration."""
        return {k: sum(v) / len(v) for k, v in self.metrics.items() if v}

    # ---- inside ----------------------------------------------------------------------------------------

    def _loop(self, name: str) -> None:
        spec = self.specs[name]
        work_loop(
            self.dock,
            spec,
            self.work[name],
            self._clock.add,
            self._count,
            lambda: self._check(spec),
            self._report,
        )

    def _background(self, name: str) -> None:
        try:
            self._loop(name)
        except _Stopped:
            pass
        except BaseException as e:  # recorded and raised by the driver
            self._errors.append(StageError(name, e, traceback.format_exc()))
            self._stop.set()

    def _wait_background(self) -> None:
        stopped_actors = False
        while self._pending or any(t.is_alive() for t in self._threads):
            if self._pending:
                self._poll_actors()
            else:
                next(t for t in self._threads if t.is_alive()).join(timeout=0.2)
            if self._stop.is_set() and self._pending and not stopped_actors:
                for name in self._pending.values():
                    self.actors[name].stop.remote()
                stopped_actors = True
            if time.monotonic() > self._deadline + 5.0:
                self._stop.set()
                for name in self._pending.values():
                    self.actors[name].stop.remote()
                late = [t.name.removeprefix("msrl-stage-") for t in self._threads if t.is_alive()]
                names = [*self._pending.values(), *late] or ["?"]
                self._pending, self._threads = {}, []
                raise StageError(names[0], TimeoutError("stage hung"))
        self._threads = []

    def _raise_first(self) -> None:
        if self._errors:
            raise self._errors[0] from self._errors[0].error

    def _poll_actors(self) -> None:
        import ray

        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0.2)
        for ref in ready:
            name = self._pending.pop(ref)
            try:
                out = ray.get(ref)
            except Exception as e:  # the actor died (killed, out of memory): its work is lost
                self._errors.append(
                    StageError(name, RuntimeError(f"the Ray actor of stage '{name}' died: {e}"))
                )
                self._stop.set()
                continue
            if "error" in out:
                self._errors.append(StageError(name, out["error"], out["tb"]))
                self._stop.set()
                continue
            for start, end in out["spans"]:
                self._clock.add(name, start, end)
            for op, n in out["counts"].items():
                self._count(op, n)
            self._report(out.get("metrics", {}))

    def _count(self, op: str, n: int = 1) -> None:
        with self._lock:
            self.counts[op] = self.counts.get(op, 0) + n

    def _report(self, metrics: Mapping[str, Any]) -> None:
        with self._lock:
            for k, v in metrics.items():
                self.metrics.setdefault(k, []).extend(float(x) for x in v)

    def _check(self, spec: StageSpec) -> None:
        if self._stop.is_set():
            raise _Stopped(f"stage '{spec.name}' stopped because another stage failed")
        if time.monotonic() > self._deadline:
            raise TimeoutError(
                f"stage '{spec.name}' did not finish within {self.deadline_s:.0f} s "
                f"(dock progress: {self.dock.progress().get(spec.name)})"
            )


class _Stopped(RuntimeError):
    pass


class StageActor:
    """A stage as a Ray actor: :func:`work_loop` over its own handle of the (Ray) dock. ``run`` returns
    the busy intervals and operation counts of the iteration, or the error it raised (so the driver
    re-raises the same exception the thread path raises); ``stop`` ends a running ``run`` early."""

    def __init__(self, dock: Dock, spec: StageSpec, work: Work) -> None:
        self.dock, self.spec, self.work = dock, spec, work
        self._stop = threading.Event()

    def run(self, deadline_s: float) -> dict[str, Any]:
        self._stop.clear()
        deadline = time.monotonic() + deadline_s
        spans: list[tuple[float, float]] = []
        counts: dict[str, int] = {}
        metrics: dict[str, list[float]] = {}

        def report(m: Mapping[str, Any]) -> None:
            for k, v in m.items():
                metrics.setdefault(k, []).extend(float(x) for x in v)

        def check() -> None:
            if self._stop.is_set():
                raise _Stopped(self.spec.name)
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage '{self.spec.name}' did not finish within {deadline_s:.0f} s")

        def count(op: str) -> None:
            counts[op] = counts.get(op, 0) + 1

        try:
            work_loop(
                self.dock, self.spec, self.work, lambda _, a, b: spans.append((a, b)), count, check, report
            )
        except _Stopped:
            pass
        except BaseException as e:
            return {"error": _portable(e), "tb": traceback.format_exc()}
        return {"spans": spans, "counts": counts, "metrics": metrics}

    def stop(self) -> None:
        self._stop.set()


def _portable(e: BaseException) -> BaseException:
    """``e`` itself when it survives pickling (the driver then raises the same type), else a
    RuntimeError with its type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _start_actor(dock: Dock, spec: StageSpec, work: Work) -> Any:
    import ray

    # max_concurrency=2: stop() is served while run() works
    cls = ray.remote(StageActor).options(
        num_cpus=ACTOR_NUM_CPUS, max_concurrency=2, name=None, max_restarts=0
    )
    return cls.remote(dock, spec, work)
