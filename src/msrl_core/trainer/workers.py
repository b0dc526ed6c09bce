"""Worker groups: one worker per training rank, called by the driver as method calls.

A :class:`WorkerGroup` holds ``world`` instances of one worker class (``"module:Class"``), one per rank
(Megatron's TP x PP x DP grid), each in its own process. The driver calls a method on every rank at once
(:meth:`WorkerGroup.call`; per-rank arguments with ``per_rank=``) and gets one result per rank; calls are
serialised (one at a time), so concurrent stage threads never interleave the ranks' collectives. Every wait
has a deadline; a worker that raises, dies or misses the deadline ends the call with :class:`WorkerError`
naming the method, the rank and its node.

Two placements through the same worker code:

- :class:`LocalWorkerGroup` (the single-machine default): spawned processes of this machine, each connected
  to the driver by its own ``multiprocessing`` pipe (a socket pair created before the spawn and inherited:
  no listening endpoint another process could reach). Objects given to a rank at spawn (``spawn_kwargs``,
  e.g. the rollout engine's weight buffer in shared memory) are shared with it, not copied.
- :class:`RayWorkerGroup`: Ray actors in one placement group of ``trainer.nnodes`` bundles, one per node
  (``STRICT_SPREAD``: each bundle on its own node), each holding ``trainer.devices_per_node`` devices
  (``GPU``/``NPU`` on an accelerator, a fraction of a CPU per rank on a CPU); the ranks of node ``k`` are
  ``k * devices_per_node ...``, one device each, as verl's ``nnodes`` x ``n_gpus_per_node`` resource pool.

Rank 0's worker reports the address and a free port for torch.distributed's rendezvous
(:meth:`WorkerGroup.rendezvous`); every worker then initialises torch.distributed itself in its ``init``
method (gloo on a CPU, NCCL on CUDA, HCCL on an NPU).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any, Protocol

#: ``trainer.workers`` values.
PLACEMENTS = ("local", "ray")
#: Deadline of starting the workers (spawn, imports, placement), apart from the per-call deadline.
START_TIMEOUT_S = 300.0
#: CPUs a Ray worker bundle asks for on a CPU-only node (fractional: a few workers share a core).
CPU_WORKER_NUM_CPUS = 0.25


class WorkerError(RuntimeError):
    """A worker failed, died or missed its deadline; names the method, rank and node."""

    def __init__(self, message: str, rank: int, node: str, method: str) -> None:
        super().__init__(message)
        self.rank, self.node, self.method = rank, node, method


class WorkerGroup(Protocol):
    """The driver's handle on the workers of one group (see the module docstring)."""

    world: int
    nodes: list[str]  # the node of each rank

    def call(
        self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """``method(*args)`` (or ``method(*per_rank[r])``) on every rank, in parallel; results by rank."""

    def close(self) -> None:
        """End the workers (idempotent)."""


def _failed(rank: int, node: str, method: str, error: BaseException) -> WorkerError:
    """The error of a worker's method that raised ``error``."""
    return WorkerError(
        f"worker rank {rank} on node {node} failed in {method}: {type(error).__name__}: {error}",
        rank,
        node,
        method,
    )


def load_class(path: str) -> Any:
    """``"package.module:Class"`` -> the class."""
    mod, _, name = path.partition(":")
    if not mod or not name:
        raise ValueError(f"a worker class is named 'package.module:Class'; got {path!r}")
    return getattr(importlib.import_module(mod), name)


def node_name() -> str:
    return socket.gethostname()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RendezvousMixin:
    """What every worker class offers the group: its node and, on rank 0, torch.distributed's address."""

    def rendezvous(self) -> tuple[str, int, str]:
        host = os.environ.get("MSRL_MASTER_ADDR", "127.0.0.1")
        return host, free_port(host), node_name()


def _check_args(world: int, args: tuple, per_rank: Sequence[tuple] | None) -> list[tuple]:
    if per_rank is None:
        return [args] * world
    if args:
        raise ValueError("give either shared args or per_rank, not both")
    if len(per_rank) != world:
        raise ValueError(f"per_rank has {len(per_rank)} entries for a group of {world} ranks")
    return [tuple(a) for a in per_rank]


# ---- local processes ----------------------------------------------------------------------------------


def _serve(conn: Any, cls_path: str, rank: int, kwargs: dict[str, Any]) -> None:
    """A local worker process: build the worker, then answer ``(method, args)`` until ``None`` or EOF."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the driver decides
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        worker = load_class(cls_path)(rank=rank, **kwargs)
        conn.send(("ok", None, ""))
    except BaseException as e:
        conn.send(("err", _portable(e), traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        method, args = msg
        try:
            conn.send(("ok", getattr(worker, method)(*args), ""))
        except BaseException as e:
            conn.send(("err", _portable(e), traceback.format_exc()))


class LocalWorkerGroup:
    """``world`` spawned processes of this machine (see the module docstring)."""

    def __init__(
        self,
        cls_path: str,
        world: int,
        kwargs: dict[str, Any],
        spawn_kwargs: dict[int, dict[str, Any]] | None = None,
        timeout: float = 600.0,
    ) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world, self.timeout = world, timeout
        self.nodes = [node_name()] * world
        self._lock = threading.RLock()
        self.broken: WorkerError | None = None
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        for r in range(world):
            parent, child = ctx.Pipe(duplex=True)
            kw = {**kwargs, **(spawn_kwargs or {}).get(r, {})}
            p = ctx.Process(
                target=_serve, args=(child, cls_path, r, kw), daemon=True, name=f"msrl-worker-{r}"
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        try:
            self._gather("__init__", max(timeout, START_TIMEOUT_S))
        except BaseException:
            self.close()
            raise

    def call(
        self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None, timeout: float | None = None
    ) -> list[Any]:
        argv = _check_args(self.world, args, per_rank)
        with self._lock:
            if self.broken is not None:  # the first failure again: it names the rank and node
                f = self.broken
                raise WorkerError(
                    f"{f} (the group is broken; calling {method})", f.rank, f.node, method
                ) from f
            if not self._procs:
                raise RuntimeError(f"the worker group is closed (calling {method})")
            for r, (c, a) in enumerate(zip(self._conns, argv)):
                try:
                    c.send((method, a))
                except (BrokenPipeError, OSError):
                    self._raise_dead(r, method)
            return self._gather(method, self.timeout if timeout is None else timeout)

    def _gather(self, method: str, timeout: float) -> list[Any]:
        """Every rank's answer to ``method`` within ``timeout``. The first failure (an error, a dead process,
        the deadline) breaks the group: the other ranks may wait in a collective with the failed one, so
        the group takes no further calls (close it)."""
        deadline = time.monotonic() + timeout
        out: list[Any] = [None] * self.world
        waiting = set(range(self.world))
        try:
            while waiting:
                for r in sorted(waiting):
                    c = self._conns[r]
                    if c.poll(0):
                        try:
                            status, value, tb = c.recv()
                        except (EOFError, OSError):
                            self._raise_dead(r, method)
                        waiting.discard(r)
                        if status != "ok":
                            raise _failed(r, self.nodes[r], method, value) from value
                        out[r] = value
                    elif not self._procs[r].is_alive():
                        self._raise_dead(r, method)
                if waiting and time.monotonic() > deadline:
                    r = min(waiting)
                    raise WorkerError(
                        f"worker rank {r} on node {self.nodes[r]} did not answer {method} "
                        f"within {timeout:.0f} s",
                        r,
                        self.nodes[r],
                        method,
                    )
                if waiting:
                    _wait_any([self._conns[r] for r in waiting], 0.05)
        except WorkerError as e:
            self.broken = e
            raise
        return out

    def _raise_dead(self, r: int, method: str) -> None:
        p = self._procs[r]
        p.join(0.5)
        raise WorkerError(
            f"worker rank {r} on node {self.nodes[r]} died during {method} (exit code {p.exitcode})",
            r,
            self.nodes[r],
            method,
        )

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def close(self) -> None:
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    c.send(None)
            for p in self._procs:
                p.join(30.0 if self.broken is None else 2.0)
                if p.is_alive():
                    p.kill()
                    p.join(5.0)
            for c in self._conns:
                c.close()
            self._procs, self._conns = [], []


def _wait_any(conns: list[Any], timeout: float) -> None:
    from multiprocessing.connection import wait

    wait(conns, timeout)


# ---- Ray actors ---------------------------------------------------------------------------------------


class _RayHost:
    """The Ray actor hosting one worker: builds it, runs its methods (errors come back as values)."""

    def __init__(self, cls_path: str, rank: int, kwargs: dict[str, Any]) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import ray
        import torch

        torch.set_num_threads(1)
        self.node = ray.get_runtime_context().get_node_id()
        os.environ.setdefault("MSRL_MASTER_ADDR", ray.util.get_node_ip_address())
        if ray.get_gpu_ids() or kwargs.get("device", "cpu") != "cpu":
            os.environ.setdefault("LOCAL_RANK", "0")  # Ray shows each actor its one device as device 0
        self.worker = load_class(cls_path)(rank=rank, **kwargs)

    def node_id(self) -> str:
        return str(self.node)

    def run(self, method: str, args: tuple) -> tuple[str, Any, str]:
        try:
            return "ok", getattr(self.worker, method)(*args), ""
        except BaseException as e:
            return "err", _portable(e), traceback.format_exc()


class RayWorkerGroup:
    """Ray actors in per-node placement groups (see the module docstring)."""

    def __init__(
        self,
        cls_path: str,
        world: int,
        kwargs: dict[str, Any],
        nnodes: int,
        devices_per_node: int,
        device: str = "cpu",
        timeout: float = 600.0,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if nnodes * devices_per_node != world:
            raise ValueError(
                f"trainer.nnodes={nnodes} x trainer.devices_per_node={devices_per_node} must equal the world "
                f"size {world} (actor.dp x actor.tp x actor.pp x actor.ep)"
            )
        self.world, self.timeout = world, timeout
        self._lock = threading.RLock()
        per_rank = _bundle(device)
        node_bundle = {k: v * devices_per_node for k, v in per_rank.items()}
        strategy = "STRICT_SPREAD" if nnodes > 1 else "STRICT_PACK"
        self._pgs = [placement_group([dict(node_bundle) for _ in range(nnodes)], strategy=strategy)]
        try:
            ready = [pg.ready() for pg in self._pgs]
            done, _ = ray.wait(ready, num_returns=len(ready), timeout=max(timeout, START_TIMEOUT_S))
            if len(done) != len(ready):
                raise TimeoutError(
                    f"Ray could not place {nnodes} node(s) x {node_bundle} ({strategy}) within "
                    f"{max(timeout, START_TIMEOUT_S):.0f} s (cluster resources: {ray.cluster_resources()})"
                )
            cls = ray.remote(_RayHost)
            self._actors: list[Any] = []
            for r in range(world):
                pg, idx = self._pgs[0], r // devices_per_node
                opts: dict[str, Any] = {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=idx
                    ),
                    "max_restarts": 0,
                    "num_cpus": per_rank.get("CPU", 0),
                }
                if "GPU" in per_rank:
                    opts["num_gpus"] = 1
                if "NPU" in per_rank:
                    opts["resources"] = {"NPU": 1}
                self._actors.append(cls.options(**opts).remote(cls_path, r, kwargs))
            self.nodes = self._get(
                [a.node_id.remote() for a in self._actors], "__init__", max(timeout, START_TIMEOUT_S)
            )
        except BaseException:
            for pg in self._pgs:
                remove_placement_group(pg)
            raise
        self._remove = remove_placement_group

    def call(
        self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None, timeout: float | None = None
    ) -> list[Any]:
        argv = _check_args(self.world, args, per_rank)
        with self._lock:
            refs = [a.run.remote(method, x) for a, x in zip(self._actors, argv)]
            outs = self._get(refs, method, self.timeout if timeout is None else timeout)
        for r, (status, value, _tb) in enumerate(outs):
            if status != "ok":
                raise _failed(r, self.nodes[r], method, value) from value
        return [v for _, v, _ in outs]

    def _get(self, refs: list[Any], method: str, timeout: float) -> list[Any]:
        import ray

        nodes = getattr(self, "nodes", ["?"] * self.world)
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for r, ref in enumerate(refs):
            if ref in pending:
                raise WorkerError(
                    f"worker rank {r} on node {nodes[r]} did not answer {method} within {timeout:.0f} s",
                    r,
                    nodes[r],
                    method,
                )
            try:
                out.append(ray.get(ref))
            except Exception as e:  # the actor died
                raise WorkerError(
                    f"worker rank {r} on node {nodes[r]} died during {method}: {type(e).__name__}",
                    r,
                    nodes[r],
                    method,
                ) from e
        return out

    def close(self) -> None:
        import ray

        with self._lock:
            for a in getattr(self, "_actors", []):
                ray.kill(a)
            self._actors = []
            for pg in getattr(self, "_pgs", []):
                self._remove(pg)
            self._pgs = []


def _bundle(device: str) -> dict[str, float]:
    if device == "cuda":
        return {"CPU": 1, "GPU": 1}
    if device == "npu":
        return {"CPU": 1, "NPU": 1}
    return {"CPU": CPU_WORKER_NUM_CPUS}


def _portable(e: BaseException) -> BaseException:
    """``e`` when it survives pickling (the driver raises the same type), else a RuntimeError."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
