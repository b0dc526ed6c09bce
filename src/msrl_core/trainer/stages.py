"""Stages as data: a table of stage specs and one generic worker that claims, fetches and puts through
``msrl_core.Dock``.

Every stage of a GRPO iteration is a row of :func:`grpo_stages`: the columns it reads (its dock
controller's readiness condition), the columns it writes, how many rows it claims at a time and the gate
it waits for (``train_weights``: the training weights are swapped back in). :class:`StageRunner` starts
one worker thread per stage; a worker claims as soon as its first rows are ready, so reference and reward
score the rollout's groups while the rollout still samples the next ones. Each stage consumes every row of
the iteration exactly once (the dock's guarantee; ``progress()`` counts it).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Mapping
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
    gate: str | None = None  # an event the worker waits for before its first claim


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
    batch_rows: int, group_size: int, claim_groups: int, use_reference: bool, recompute_old: bool
) -> list[StageSpec]:
    """The GRPO iteration as data. ``use_reference``: the KL loss needs the reference policy.
    ``recompute_old``: off-policy updates (several mini-batches or epochs) need the old log-probs
    recomputed by the trainer; exactly on-policy, the update's own first forward is the old policy."""
    chunk = min(batch_rows, claim_groups * group_size)
    upd_reads = ["prompts", "responses", "rollout_log_prob", "advantages"]
    table = [StageSpec("rollout", ("prompts",), ("responses", "rollout_log_prob"), chunk)]
    if use_reference:
        table.append(StageSpec("reference", ("prompts", "responses"), ("ref_log_prob",), chunk))
        upd_reads.append("ref_log_prob")
    table.append(StageSpec("rule_reward", ("prompts", "responses", "index"), ("scores",), chunk))
    table.append(StageSpec("adv", ("scores",), ("advantages",), chunk))
    if recompute_old:
        table.append(
            StageSpec("old_log_p", ("prompts", "responses"), ("old_log_prob",), chunk, gate="train_weights")
        )
        upd_reads.append("old_log_prob")
    table.append(StageSpec("update", tuple(upd_reads), (), batch_rows, gate="train_weights"))
    return table


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


Work = Callable[[Any], "Mapping[str, Any] | None"]


class StageRunner:
    """Runs one iteration: one worker thread per stage over the dock; every wait has a deadline."""

    def __init__(
        self, dock: Dock, stages: list[StageSpec], work: Mapping[str, Work], deadline_s: float
    ) -> None:
        missing = [s.name for s in stages if s.name not in work]
        if missing:
            raise ValueError(f"no work function for stages {missing}")
        self.dock, self.stages, self.work, self.deadline_s = dock, stages, work, deadline_s
        self.counts: dict[str, int] = {}  # dock operations of the last run() (the trainer's own count)
        self._count_lock = threading.Lock()
        self.on_done: dict[str, Callable[[], None]] = {}

    def run(self, clock: StageClock, gates: Mapping[str, threading.Event]) -> None:
        """Start every stage, wait for all; the first failure stops the others and is raised as
        :class:`StageError`."""
        stop = threading.Event()
        self.counts = {"put": 1, "claim": 0, "fetch": 0}  # the driver's put of the prompts
        errors: list[StageError] = []
        deadline = time.monotonic() + self.deadline_s

        def worker(spec: StageSpec) -> None:
            try:
                self._work_loop(spec, clock, gates, stop, deadline)
                hook = self.on_done.get(spec.name)
                if hook is not None:
                    hook()
            except BaseException as e:  # recorded and re-raised in the driver
                errors.append(StageError(spec.name, e, traceback.format_exc()))
                stop.set()

        threads = [
            threading.Thread(target=worker, args=(s,), name=f"msrl-stage-{s.name}", daemon=True)
            for s in self.stages
        ]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.2)
                if time.monotonic() > deadline + 5.0:
                    stop.set()
                    raise StageError(t.name.removeprefix("msrl-stage-"), TimeoutError("stage hung"))
        if errors:
            raise errors[0] from errors[0].error

    def _work_loop(
        self,
        spec: StageSpec,
        clock: StageClock,
        gates: Mapping[str, threading.Event],
        stop: threading.Event,
        deadline: float,
    ) -> None:
        if spec.gate is not None:
            ev = gates[spec.gate]
            while not ev.wait(timeout=0.05):
                self._check(spec, stop, deadline)
        total, done = self.dock.capacity, 0
        work = self.work[spec.name]
        while done < total:
            self._check(spec, stop, deadline)
            want = min(spec.rows_per_claim, total - done)
            try:
                meta = self.dock.claim(spec.name, max_rows=want, timeout=0.1, min_rows=want)
            except Timeout:
                continue
            t0 = time.perf_counter()
            self._count("claim")
            batch = self.dock.fetch(meta, list(spec.reads))
            self._count("fetch")
            out = work(batch)
            if spec.writes:
                assert out is not None, f"stage {spec.name} must write {spec.writes}"
                self.dock.put(dict(out), rows=meta)
                self._count("put")
            clock.add(spec.name, t0, time.perf_counter())
            done += len(meta)

    def _count(self, op: str) -> None:
        with self._count_lock:
            self.counts[op] = self.counts.get(op, 0) + 1

    def _check(self, spec: StageSpec, stop: threading.Event, deadline: float) -> None:
        if stop.is_set():
            raise _Stopped(f"stage '{spec.name}' stopped because another stage failed")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"stage '{spec.name}' did not finish within {self.deadline_s:.0f} s "
                f"(dock progress: {self.dock.progress().get(spec.name)})"
            )


class _Stopped(RuntimeError):
    pass
