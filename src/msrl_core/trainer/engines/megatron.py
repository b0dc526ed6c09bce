"""The Megatron-core training engine: a ``GPTModel`` (local layer spec) sharded with tensor parallelism over
torch.distributed on ``trainer.device``: NCCL process groups on CUDA, HCCL on an Ascend NPU (megatron-core
there needs MindSpeed's adaptor, not part of this package), gloo on a CPU through :mod:`megatron_cpu` (the
compatibility layer is activated only when the engine runs on the CPU). Rank ``r`` uses accelerator ``r``.

Process model. The trainer (stages, dock, rollout, reward) runs in rank 0. With ``actor.tp = 1`` the
engine lives in that process (a one-rank gloo group). With ``actor.tp = T > 1`` rank 0 spawns ``T - 1``
follower processes that build their shards and serve rank 0's engine operations: every operation rank 0
issues (forward, backward, grad clip + optimizer step, weight switch, swap back, save) is first announced
to the followers with a small broadcast header, then both sides run the same Megatron code, whose TP
collectives pair up. Operations are serialised by a lock, so concurrent stage threads (reference and
old_log_p forwards, the swap back) never interleave collectives. The backward needs no announcement by
the caller: a hook on the logits broadcasts their gradient when autograd reaches it, and the followers run
the same backward with it. A follower that fails exits; rank 0's next collective then fails after the
process group's timeout instead of hanging.

Pipeline parallelism: rank 0 is stage 0 and the driver; ``msrl_core.models.pipeline_forward`` runs the
stages in turn and brings the last stage's logits to the first; a follower of a later stage runs its backward
from an anchor, receiving its output's gradient from the next stage. Every rank runs the same tokens, so
``msrl_core.models.finish_grads`` completes the gradients (expert gradients divided by the dispatcher's
group) and ``grad_norm`` sums the norm over TP, EP and PP.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
from typing import Any

import torch

from msrl_core.reshard import ModelConfig, Parallel
from msrl_core.reshard.steps import current_stream
from msrl_core.trainer.config import model_config

# operation codes of the rank-0 -> follower protocol
_LOGITS, _FWD, _BWD, _STEP, _ZERO, _SWITCH, _BACK, _SAVE, _STOP, _OPT, _CLONE, _LOAD = range(12)
# The header: 8 int64 fields [op, model, ndim, d0, d1, d2, int0, int1] and 2 float64 fields [f0, f1] (stored
# bit for bit in the same int64 tensor: a float travels as a float, never scaled to an integer).
_HDR_INTS, _HDR_FLOATS = 8, 2
_HDR = _HDR_INTS + _HDR_FLOATS


def pack_header(
    op: int,
    model: int = 0,
    shape: tuple[int, ...] = (),
    ints: tuple[int, int] = (0, 0),
    floats: tuple[float, float] = (0.0, 0.0),
) -> torch.Tensor:
    """The fixed binary header of one operation (see ``_HDR_INTS``/``_HDR_FLOATS``)."""
    if len(shape) > 3:
        raise ValueError(f"an operation's tensor has at most 3 dims; got shape {shape}")
    hdr = torch.zeros(_HDR, dtype=torch.int64)
    hdr[0], hdr[1], hdr[2] = op, model, len(shape)
    for i, d in enumerate(shape):
        hdr[3 + i] = d
    hdr[6], hdr[7] = ints
    hdr[_HDR_INTS:] = torch.tensor(floats, dtype=torch.float64).view(torch.int64)
    return hdr


def unpack_header(
    hdr: torch.Tensor,
) -> tuple[int, int, tuple[int, ...], tuple[int, int], tuple[float, float]]:
    """(op, model, shape, ints, floats) of a header from :func:`pack_header`."""
    hdr = hdr.cpu()
    nd = int(hdr[2])
    f = hdr[_HDR_INTS:].clone().view(torch.float64)
    return (
        int(hdr[0]),
        int(hdr[1]),
        tuple(int(x) for x in hdr[3 : 3 + nd]),
        (int(hdr[6]), int(hdr[7])),
        (float(f[0]), float(f[1])),
    )


PG_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise RuntimeError(
                f"torch.distributed is already initialised with world size {dist.get_world_size()}, "
                f"the Megatron engine needs {world}"
            )
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )


def build_policy(cfg: Any, parallel: Parallel, seed: int, device: Any) -> Any:
    """This rank's ``GPTModel`` of ``cfg.model`` (``msrl_core.models.build_gpt``: the one builder)."""
    from msrl_core.models import build_gpt

    return build_gpt(model_config(cfg.model), parallel, seed=seed, device=device)


class _Model:
    """One GPTModel of this rank (the policy, or a frozen reference copy) and its optimizer."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.optimizer: Any = None
        self.pending: Any = None  # a follower's logits awaiting their gradient


class MegatronTrainEngine:
    """See the module docstring. Rank 0 constructs it (and spawns the followers when ``tp > 1``)."""

    def __init__(
        self,
        cfg: Any,
        mc: ModelConfig,
        seed: int,
        rank: int = 0,
        port: int | None = None,
        device: str = "cpu",
    ) -> None:
        import torch.distributed as dist

        from msrl_core.trainer.engines import process_group_backend, torch_device

        tp, pp, ep = cfg.actor.tp, cfg.actor.pp, cfg.actor.ep
        self.cfg, self.model_config, self.rank, self.seed = cfg, mc, rank, seed
        self.parallel = Parallel(tp=tp, pp=pp, ep=ep)
        self.device_name = device
        self.device = torch_device(device, rank)
        self._procs: Any = None
        world = tp * pp * ep
        if rank == 0 and world > 1:
            port = _free_port()
            self._procs = _spawn_followers(cfg, seed, world, port, device)
        init_distributed(rank, world, port or _free_port(), process_group_backend(device))
        self._lock = threading.RLock()
        self._models = [_Model(build_policy(cfg, self.parallel, seed, self.device))]
        self.module = self._models[0].module
        from msrl_core.models import ShardLayout, load_hf_checkpoint, megatron_groups

        if cfg.model.path:  # the checkpoint's weights, this rank's shard (the reshard plan in reverse)
            load_hf_checkpoint(self.module, cfg.model.path, ShardLayout.from_megatron(), config=mc)
        self.groups: dict[str, Any] = megatron_groups()
        self.tp_group, self.ep_group, self.pp_group = self.groups["tp"], self.groups["ep"], self.groups["pp"]
        self.rpc_group = None  # rank 0's operations reach every rank (the world: tp x pp x ep)
        self._dist = dist
        self._swap: Any = None
        self._infer: Any = None
        self._model_id = 0

    # ---- protocol -----------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.parallel.tp * self.parallel.pp * self.parallel.ep

    def _announce(
        self,
        op: int,
        model: int = 0,
        shape: tuple[int, ...] = (),
        ints: tuple[int, int] = (0, 0),
        floats: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        if self.world == 1 or self.rank != 0:
            return
        hdr = pack_header(op, model, shape, ints, floats)
        self._dist.broadcast(hdr.to(self.device), src=0, group=self.rpc_group)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            self._dist.broadcast(t, src=0, group=self.rpc_group)
        return t

    def serve(self) -> None:
        """Follower loop: run rank 0's operations until it sends STOP."""
        while True:
            hdr = self._bcast(torch.zeros(_HDR, dtype=torch.int64, device=self.device))
            op, model, shape, (a0, a1), (f0, f1) = unpack_header(hdr)
            if op == _STOP:
                return
            m = self._models[model]
            if op in (_LOGITS, _FWD):
                tokens = self._bcast(torch.zeros(shape, dtype=torch.int64, device=self.device))
                if op == _LOGITS:
                    with torch.no_grad():
                        self._forward(m, tokens)
                else:
                    self._forward(m, tokens)  # keeps what the backward needs (m.pending)
            elif op == _BWD:
                grad = self._bcast(torch.zeros(shape, dtype=torch.float32, device=self.device))
                self._backward(m, grad)
            elif op == _ZERO:
                m.optimizer.zero_grad(set_to_none=True)
            elif op == _STEP:
                self._clip_and_step(m, f0)
            elif op == _OPT:
                self._make_optimizer(m, f0, f1)
            elif op == _SWITCH:
                self._switch(bool(a0), a1)
            elif op == _BACK:
                self._back()
            elif op == _CLONE:
                self._clone()
            elif op == _SAVE:
                self._save_follower(a0)
            elif op == _LOAD:
                path = self._bcast(torch.zeros(shape, dtype=torch.uint8, device=self.device))
                self._load_follower(bytes(path.cpu().tolist()).decode())

    def close(self) -> None:
        """Stop the followers (rank 0)."""
        if self._procs is not None:
            with self._lock:
                self._announce(_STOP)
            _join(self._procs)
            self._procs = None

    # ---- local work (both sides) --------------------------------------------------------------------

    def _forward(self, m: _Model, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of ``tokens`` (with autograd when it is on) on the first PP stage's
        ranks; on the other stages an anchor (``msrl_core.models.pipeline_forward``: with PP the stages'
        activations and, in the backward, their gradients travel between the stages). What the backward
        needs is kept in ``m.pending``."""
        from msrl_core.models import pipeline_forward

        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        out = pipeline_forward(m.module, tokens, pos, None, group=self.pp_group)
        if out.dim() == 0:  # a later PP stage: its anchor
            m.pending = out
            return out
        logits = out[..., : self.model_config.vocab_size]
        m.pending = logits
        return logits

    def _backward(self, m: _Model, grad: torch.Tensor) -> None:
        """A follower's backward of its last :meth:`_forward` with rank 0's gradient of the logits (a later
        PP stage: from its anchor, receiving the gradient of its output from the stage after it)."""
        pending, m.pending = m.pending, None
        if pending.dim() == 0:
            pending.backward()
        else:
            pending.backward(grad.to(pending.dtype))

    def _make_optimizer(self, m: _Model, lr: float, wd: float) -> None:
        m.optimizer = torch.optim.AdamW(m.module.parameters(), lr=lr, weight_decay=wd)

    def _clip_and_step(self, m: _Model, max_norm: float) -> float:
        """``msrl_core.models.finish_grads`` (every rank ran the same batch: QK-norm grads summed over TP,
        expert grads divided by the dispatcher's group size), the global grad norm over TP, EP and PP,
        clipping to ``max_norm`` (> 0) and the optimizer step when the norm is finite."""
        from msrl_core.models import finish_grads, grad_norm

        finish_grads(m.module)
        norm = grad_norm(m.module)
        if norm == norm and norm != float("inf"):  # finite: clip, step
            if max_norm > 0 and norm > max_norm:
                for p in m.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(max_norm / (norm + 1e-6))
            m.optimizer.step()
        return norm

    def _switch(self, swap: bool, bucket_bytes: int) -> Any:
        import msrl_core
        from msrl_core.reshard import to_hf

        if self._infer is None:  # followers keep their own copy of the HF weights (inference TP is 1)
            self._infer_plan = to_hf(self.model_config, self.parallel)
            self._infer = self._infer_plan.allocate_inference(device=self.device)[0]
        self._swap = msrl_core.allgather_swap(
            self.module, self._infer, self._infer_plan, self.groups, bucket_bytes=bucket_bytes, swap=swap
        )
        return self._swap

    def _back(self) -> None:
        if self._swap is not None and self._swap.state != "back":
            self._swap.swap_back(stream=current_stream(self.device))
            self._swap.wait()

    def _clone(self) -> None:
        ref = build_policy(self.cfg, self.parallel, self.seed, self.device)  # process groups: no deepcopy
        _load(ref, _params(self.module))
        for p in ref.parameters():
            p.requires_grad_(False)
        self._models.append(_Model(ref))

    def _save_follower(self, step: int) -> None:
        from msrl_core.trainer import checkpoint as ckpt

        tensors = {f"policy/{k}": v for k, v in self.state_dict().items()}
        if len(self._models) > 1:
            tensors.update({f"ref/{k}": v for k, v in _params(self._models[1].module).items()})
        ckpt.save(
            self.cfg.trainer.output_dir,
            step,
            self.rank,
            tensors,
            self._models[0].optimizer.state_dict(),
            None,
            None,
        )
        self._dist.barrier(group=self.rpc_group)

    def _load_follower(self, path: str) -> None:
        from pathlib import Path

        from msrl_core.trainer import checkpoint as ckpt

        state, opt, _ = ckpt.load(Path(path), self.rank)
        _load(self.module, {k[7:]: v for k, v in state.items() if k.startswith("policy/")})
        if len(self._models) > 1:
            _load(self._models[1].module, {k[4:]: v for k, v in state.items() if k.startswith("ref/")})
        self._models[0].optimizer.load_state_dict(opt)
        self._dist.barrier(group=self.rpc_group)

    # ---- the TrainEngine interface (rank 0) -------------------------------------------------------------

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._logits(0, tokens)

    def _logits(self, model: int, tokens: torch.Tensor) -> torch.Tensor:
        m = self._models[model]
        tokens = tokens.to(self.device).contiguous()
        grad = torch.is_grad_enabled() and model == 0
        with self._lock:
            self._announce(_FWD if grad else _LOGITS, model, tuple(tokens.shape))
            self._bcast(tokens)
            out = self._forward(m, tokens)
        if grad and self.world > 1:
            out.register_hook(self._grad_hook(model))
        return out

    def _grad_hook(self, model: int) -> Any:
        def hook(g: torch.Tensor) -> None:
            with self._lock:
                self._announce(_BWD, model, tuple(g.shape))
                self._bcast(g.detach().float().contiguous())

        return hook

    def train_params(self) -> Any:
        return self.module

    def parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def init_optimizer(self, lr: float, weight_decay: float) -> None:
        with self._lock:
            self._announce(_OPT, floats=(lr, weight_decay))
            self._make_optimizer(self._models[0], lr, weight_decay)

    def zero_grad(self) -> None:
        with self._lock:
            self._announce(_ZERO)
            self._models[0].optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self, max_norm: float) -> float:
        with self._lock:
            self._announce(_STEP, floats=(max_norm, 0.0))
            return self._clip_and_step(self._models[0], max_norm)

    def switch(self, flat: Any, plan: Any, bucket_bytes: int, swap: bool) -> Any:
        """``allgather_swap`` of this rank's shard into rank 0's HF-layout ``flat`` buffer (every rank)."""
        with self._lock:
            self._announce(_SWITCH, ints=(int(swap), bucket_bytes))
            self._infer, self._infer_plan = flat, plan
            return self._switch(swap, bucket_bytes)

    def switch_back(self) -> None:
        with self._lock:
            self._announce(_BACK)
            self._back()

    def frozen_copy(self) -> _Reference:
        with self._lock:
            self._announce(_CLONE)
            self._clone()
        return _Reference(self, len(self._models) - 1)

    def save_followers(self, step: int) -> None:
        """Followers write their shards of the checkpoint of ``step`` (into its temporary directory)."""
        if self.world > 1:
            with self._lock:
                self._announce(_SAVE, ints=(step, 0))
                self._dist.barrier(group=self.rpc_group)

    def load_followers(self, path: str | os.PathLike[str]) -> None:
        """Followers load their shards (policy, reference, optimizer) of the checkpoint at ``path``."""
        if self.world > 1:
            data = torch.tensor(list(os.fsencode(os.fspath(path))), dtype=torch.uint8)
            with self._lock:
                self._announce(_LOAD, 0, tuple(data.shape))
                self._bcast(data.to(self.device))
                self._dist.barrier(group=self.rpc_group)

    def optimizer_state(self) -> dict[str, Any]:
        return self._models[0].optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self._models[0].optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return _params(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self.module, state)


class _Reference:
    """The frozen reference policy: a second GPTModel on every rank, forward only."""

    def __init__(self, engine: MegatronTrainEngine, model: int) -> None:
        self.engine, self.model = engine, model

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.engine._logits(self.model, tokens)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return _params(self.engine._models[self.model].module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self.engine._models[self.model].module, state)


def _params(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.named_parameters()}


def _load(module: Any, state: dict[str, Any]) -> None:
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"checkpoint lacks parameters {missing[:3]} ({len(missing)} missing)")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(state[k])


# ---- followers ------------------------------------------------------------------------------------------


def _spawn_followers(cfg: Any, seed: int, world: int, port: int, device: str) -> Any:
    import torch.multiprocessing as mp

    from msrl_core.trainer.config import to_yaml

    text = to_yaml(cfg)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_follower_main, args=(r, world, port, text, seed, device), daemon=True)
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    return procs


def _join(procs: list[Any], timeout: float = 60.0) -> None:
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()


def _follower_main(rank: int, world: int, port: int, cfg_yaml: str, seed: int, device: str) -> None:
    import signal

    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides when to stop (it sends STOP)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from msrl_core.reshard.errors import CheckpointError
    from msrl_core.trainer.config import from_yaml

    cfg = from_yaml(cfg_yaml)
    try:
        engine = MegatronTrainEngine(cfg, model_config(cfg.model), seed, rank=rank, port=port, device=device)
    except CheckpointError:  # every rank raises it together; rank 0 reports it
        sys.exit(1)
    engine.serve()
