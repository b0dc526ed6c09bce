"""Full training-state offload (as MindSpeed-RL does): besides the weights that ``allgather_swap`` swaps out,
the gradients (Megatron's ``main_grad`` buffers and ``.grad``), the optimizer state (Adam moments, any
per-parameter state tensor) and the fp32 master weights (optimizer parameters that are not the model's)
go to persistent pinned host mirrors while the rollout runs, and come back asynchronously. Each kind is
optional; the telemetry says what was freed per kind.

    offload = TrainingStateOffload()                      # owns its mirrors, engine and pool (injectable)
    state = offload.offload(model, optimizer)            # grads + optimizer state + master weights
    ... rollout ...
    state.swap_back(); state.wait()                      # before the next optimizer step

Offloading is local to the rank (no collectives). Between ``offload`` and ``wait()`` the offloaded tensors
must not be read: torch functions on them raise ``SwapStateError`` (see ``guard.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import ReshardError, SwapStateError
from .guard import ReadGuard
from .mirrors import EngineAndPool, HostMirrors, Storage, unique_storages
from .steps import DEFAULT_TIMEOUT, Deadline, current_stream

__all__ = ["KINDS", "OffloadTelemetry", "OffloadedState", "TrainingStateOffload"]

KINDS = ("grads", "optimizer_state", "master_weights")


@dataclass
class OffloadTelemetry:
    """Bytes freed on the device and held in pinned host mirrors, per kind; times of the two directions."""

    freed_bytes: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, int] = field(default_factory=dict)
    host_mirror_bytes: int = 0
    host_new_bytes: int = 0  # pinned bytes this offload allocated (0 once the mirrors exist)
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0


def _model_params(model: Any) -> dict[str, Any]:
    if hasattr(model, "named_parameters"):
        return dict(model.named_parameters())
    if isinstance(model, dict):
        return dict(model)
    return {str(i): p for i, p in enumerate(model)}


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a Megatron wrapper (``.optimizer``), or the optimizer itself."""
    import torch

    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def collect(model: Any, optimizer: Any, kinds: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{kind: {key: tensor}}`` of the training state to offload (tensors with bytes only)."""
    import torch

    kinds = set(kinds)
    params = _model_params(model) if model is not None else {}
    out: dict[str, dict[str, Any]] = {k: {} for k in KINDS if k in kinds}

    def add(kind: str, key: str, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.untyped_storage().nbytes() > 0:
            out[kind][key] = t

    if "grads" in out:
        for n, p in params.items():
            add("grads", f"{n}.main_grad", getattr(p, "main_grad", None))
            add("grads", f"{n}.grad", p.grad)
    if optimizer is not None and ("optimizer_state" in out or "master_weights" in out):
        opt = _torch_optimizer(optimizer)
        model_ids = {id(p) for p in params.values()}
        names = {id(p): n for n, p in params.items()}
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                key = names.get(id(p), f"group{gi}.param{pi}")
                if "master_weights" in out and id(p) not in model_ids:
                    add("master_weights", key, p)
                    if "grads" in out:
                        add("grads", f"{key}.grad", p.grad)
                if "optimizer_state" in out:
                    for sk, sv in opt.state.get(p, {}).items():
                        add("optimizer_state", f"{key}.{sk}", sv)
    return out


class OffloadedState:
    """The training state of one :meth:`TrainingStateOffload.offload`: ``swap_back()`` then ``wait()``."""

    def __init__(self, owner: TrainingStateOffload, storages: list[Storage], guard: ReadGuard, tele, timeout):
        self._owner, self._storages, self._guard = owner, storages, guard
        self.telemetry: OffloadTelemetry = tele
        self._timeout = timeout
        self._ticket: Any = None
        self._stream: Any = None
        self._t0 = 0.0
        self.state = "offloaded"

    def swap_back(self, stream: Any = None) -> OffloadedState:
        """Re-materialise the storages and start the host→device copies (asynchronous, after ``stream``)."""
        if self.state != "offloaded":
            raise SwapStateError(f"swap_back called twice (state is {self.state!r})")
        if stream is None and self._storages:
            stream = current_stream(self._storages[0].device)
        self._t0 = time.perf_counter()
        try:
            self._ticket = self._owner._host.copy_in(self._storages, self._owner.engine, stream)
        except Exception as e:
            raise ReshardError(f"training-state swap_back failed: {type(e).__name__}: {e}") from e
        self._stream = stream
        self.state = "swapping_in"
        return self

    def wait(self, timeout: float | None = None) -> None:
        """Finish the swap back; then the gradients and optimizer state are readable again."""
        if self.state == "offloaded":
            raise SwapStateError("wait() before swap_back(): nothing is in flight")
        if self.state == "back":
            return
        deadline = Deadline(self._timeout if timeout is None else timeout)
        self._ticket.wait(deadline.left())
        if self._stream is not None:
            self._owner.engine.order_stream(self._ticket, self._stream, deadline.left())
        self.telemetry.swap_in_s = time.perf_counter() - self._t0
        self._guard.remove()
        self.state = "back"
        if self._owner.active is self:
            self._owner.active = None


class TrainingStateOffload(EngineAndPool):
    """Owns the pinned mirrors of the training state (by kind and tensor), the copy engine and the pool
    (injected, or its own), and the :class:`OffloadedState` not yet swapped back."""

    def __init__(
        self,
        *,
        grads: bool = True,
        optimizer_state: bool = True,
        master_weights: bool = True,
        engine: Any = None,
        pool: Any = None,
    ) -> None:
        self.kinds = tuple(
            k for k, on in zip(KINDS, (grads, optimizer_state, master_weights), strict=True) if on
        )
        super().__init__(engine, pool)
        self._host = HostMirrors(lambda: self.pool)
        self.active: OffloadedState | None = None

    def offload(
        self, model: Any, optimizer: Any = None, *, timeout: float = DEFAULT_TIMEOUT
    ) -> OffloadedState:
        """Copy the selected kinds of training state to pinned host mirrors (one batch), free their device
        storages (the tensor objects survive) and guard them against reads. A failure restores everything."""
        if self.active is not None:
            raise SwapStateError("the previous offload was not swapped back; call swap_back() and wait()")
        deadline = Deadline(timeout)
        by_kind = collect(model, optimizer, self.kinds)
        tele = OffloadTelemetry()
        storages: list[Storage] = []
        seen: set[int] = set()
        for kind, named in by_kind.items():
            mine = [
                Storage(f"{kind}:{s.name}", s.storage, s.nbytes, s.device)
                for s in unique_storages(named)
                if s.storage.data_ptr() not in seen
            ]
            seen.update(s.storage.data_ptr() for s in mine)
            storages += mine
            tele.freed_bytes[kind] = sum(s.nbytes for s in mine)
            tele.tensors[kind] = len(named)
        if storages:
            stream = current_stream(storages[0].device)
            r = self._host.swap_out(storages, self.engine, deadline, stream, "training-state tensor")
            tele.host_new_bytes, tele.swap_out_s = r.new_bytes, r.seconds
        tele.host_mirror_bytes = self._host.nbytes
        guard = ReadGuard()
        guard.install({k: t for named in by_kind.values() for k, t in named.items()})
        self.active = OffloadedState(self, storages, guard, tele, timeout)
        return self.active
