"""The Megatron-core training engine of one rank: a ``GPTModel`` (local layer spec) sharded with tensor and
pipeline parallelism over torch.distributed on ``trainer.device``: NCCL process groups on CUDA, HCCL on an
Ascend NPU (megatron-core there needs MindSpeed's adaptor, not part of this package), gloo on a CPU through
:mod:`megatron_cpu` (the compatibility layer is activated only when the engine runs on the CPU). Local rank
``r`` of a node uses accelerator ``r``.

Process model. Every training rank (TP x PP x DP) is a worker of a worker group
(:mod:`msrl_core.trainer.workers`, :class:`msrl_core.trainer.actor_worker.ActorWorker`) that holds one of
these engines; the driver calls the workers' methods and every rank runs the same Megatron code on its
replica's rows, so the TP and PP collectives pair up. Data parallelism: megatron-core's data-parallel group
(world = DP x TP x PP x EP); the replicas start from rank 0's weights (broadcast, as Megatron's DDP does) and
:meth:`MegatronTrainEngine.clip_and_step` sums their gradients (one flattened all-reduce, the bucket of
Megatron's DDP) before clipping: the losses are normalised by the global batch's token and sequence
counts, so the sum is the gradient of the global batch's mean.

Pipeline parallelism: ``msrl_core.models.pipeline_forward`` runs the stages in turn and brings the last
stage's logits to the first; a later stage's rank gets an anchor from :meth:`logits` whose ``backward()``
receives its output's gradient from the next stage. ``msrl_core.models.finish_grads`` completes the
gradients (expert gradients divided by the dispatcher's group) and ``grad_norm`` sums the norm over TP, EP
and PP.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch

from msrl_core.reshard import ModelConfig, Parallel
from msrl_core.reshard.steps import current_stream
from msrl_core.trainer.config import model_config

PG_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(
    rank: int, world: int, port: int, backend: str = "gloo", addr: str = "127.0.0.1"
) -> None:
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
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )


def build_policy(cfg: Any, parallel: Parallel, seed: int, device: Any) -> Any:
    """This rank's ``GPTModel`` of ``cfg.model`` (``msrl_core.models.build_gpt``: the one builder)."""
    from msrl_core.models import build_gpt

    return build_gpt(model_config(cfg.model), parallel, seed=seed, device=device)


class MegatronTrainEngine:
    """This rank's policy (and, after :meth:`frozen_copy`, its reference copy) and optimizer; built inside a
    worker after torch.distributed is initialised (:func:`init_distributed`). Every method is this rank's
    part of an operation all ranks run together."""

    def __init__(
        self, cfg: Any, mc: ModelConfig, seed: int, rank: int = 0, device: str = "cpu", local_rank: int = 0
    ) -> None:
        import torch.distributed as dist

        from msrl_core.models import ShardLayout, load_hf_checkpoint, megatron_groups
        from msrl_core.trainer.engines import torch_device

        tp, pp, ep = cfg.actor.tp, cfg.actor.pp, cfg.actor.ep
        self.cfg, self.model_config, self.rank, self.seed = cfg, mc, rank, seed
        self.parallel = Parallel(tp=tp, pp=pp, ep=ep)
        self.device_name = device
        self.device = torch_device(device, local_rank)
        self.module = build_policy(cfg, self.parallel, seed, self.device)
        if cfg.model.path:  # the checkpoint's weights, this rank's shard (the reshard plan in reverse)
            load_hf_checkpoint(self.module, cfg.model.path, ShardLayout.from_megatron(), config=mc)
        self.groups: dict[str, Any] = megatron_groups()
        self.tp_group, self.ep_group, self.pp_group = self.groups["tp"], self.groups["ep"], self.groups["pp"]
        from megatron.core import parallel_state as ps

        # The trainer's replicas (actor.dp; with EP > 1 megatron-core's DP group is the EP group, whose ranks
        # run the same rows: one replica, no gradient sum over it; actor.dp > 1 with EP is rejected)
        self.dp_size = cfg.actor.dp
        self.dp_rank = ps.get_data_parallel_rank() if self.dp_size > 1 else 0
        if self.dp_size > 1 and ps.get_data_parallel_world_size() != self.dp_size:
            raise RuntimeError(
                f"megatron-core's data-parallel group has {ps.get_data_parallel_world_size()} ranks, "
                f"actor.dp is {self.dp_size}"
            )
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_group = ps.get_data_parallel_group() if self.dp_size > 1 else None
        self._dist = dist
        if self.dp_group is not None:  # every replica starts from DP rank 0's weights (Megatron's DDP)
            src = dist.get_global_rank(self.dp_group, 0)
            with torch.no_grad():
                for p in self.module.parameters():
                    dist.broadcast(p.data, src=src, group=self.dp_group)
        self.optimizer: Any = None
        self.reference: Any = None
        self._swap: Any = None
        self._infer: Any = None
        self._infer_plan: Any = None

    def logits(self, tokens: torch.Tensor, model: Any = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of ``tokens`` (autograd on when it is) on the first PP stage's ranks; on
        the other stages an anchor: a 0-dim tensor whose ``backward()`` runs this stage's backward
        (``msrl_core.models.pipeline_forward``)."""
        from msrl_core.models import pipeline_forward

        module = self.module if model is None else model
        tokens = tokens.to(self.device).contiguous()
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        out = pipeline_forward(module, tokens, pos, None, group=self.pp_group)
        if out.dim() == 0:
            return out
        return out[..., : self.model_config.vocab_size]

    def train_params(self) -> Any:
        return self.module

    def parameters(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def init_optimizer(self, lr: float, weight_decay: float) -> None:
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr, weight_decay=weight_decay)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self, max_norm: float) -> float:
        """The DP all-reduce (sum) of the gradients, ``msrl_core.models.finish_grads``, the global grad norm
        over TP, EP and PP, clipping to ``max_norm`` (> 0) and the optimizer step when the norm is finite."""
        from msrl_core.models import finish_grads, grad_norm

        if self.dp_group is not None:
            self._all_reduce_grads()
        finish_grads(self.module)
        norm = grad_norm(self.module)
        if norm == norm and norm != float("inf"):  # finite: clip, step
            if max_norm > 0 and norm > max_norm:
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(max_norm / (norm + 1e-6))
            self.optimizer.step()
        return norm

    def _all_reduce_grads(self) -> None:
        """Sum the replicas' gradients in one flattened bucket (a replica without rows adds zeros)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._dist.all_reduce(flat, group=self.dp_group)
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off : off + n].view_as(p.grad))
            off += n

    def switch(self, flat: Any, plan: Any, bucket_bytes: int, swap: bool) -> Any:
        """``allgather_swap`` of this rank's shard into the HF-layout buffer ``flat`` (None: this rank's own
        copy, allocated once); returns the ``Swap``."""
        import msrl_core
        from msrl_core.reshard import to_hf

        if flat is not None:
            self._infer, self._infer_plan = flat, plan
        elif self._infer is None:  # inference TP is 1: every rank gathers the whole HF weights
            self._infer_plan = to_hf(self.model_config, self.parallel)
            self._infer = self._infer_plan.allocate_inference(device=self.device)[0]
        self._swap = msrl_core.allgather_swap(
            self.module, self._infer, self._infer_plan, self.groups, bucket_bytes=bucket_bytes, swap=swap
        )
        return self._swap

    def switch_back(self) -> None:
        if self._swap is not None and self._swap.state != "back":
            self._swap.swap_back(stream=current_stream(self.device))
            self._swap.wait()

    def frozen_copy(self) -> Any:
        """The reference policy: a second GPTModel with this rank's current weights, autograd off."""
        ref = build_policy(self.cfg, self.parallel, self.seed, self.device)  # process groups: no deepcopy
        _load(ref, _params(self.module))
        for p in ref.parameters():
            p.requires_grad_(False)
        self.reference = ref
        return ref

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return _params(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load(self.module, state)

    def close(self) -> None:
        pass


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
