"""One training rank as a worker (:mod:`msrl_core.trainer.workers`): torch.distributed and this rank's
Megatron engine, built inside the worker's process (a local process or a Ray actor); its methods are this
rank's part of the operations :class:`msrl_core.trainer.actor.WorkerActor` calls on every rank."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from msrl_core.trainer import actor as ops
from msrl_core.trainer.workers import RendezvousMixin, node_name


class ActorWorker(RendezvousMixin):
    def __init__(
        self,
        rank: int,
        world: int,
        cfg_yaml: str,
        seed: int,
        device: str = "cpu",
        rollout_buffer: torch.Tensor | None = None,
    ) -> None:
        self.rank, self.world, self.cfg_yaml, self.seed, self.device = rank, world, cfg_yaml, seed, device
        self.rollout_buffer = rollout_buffer  # the driver's HF-layout buffer (shared memory), rank 0 only
        self.engine: Any = None
        self.reference: Any = None
        self.seen: dict[str, list[list[int]]] = {}

    def init(self, addr: str, port: int) -> dict[str, Any]:
        """torch.distributed (gloo / NCCL / HCCL by device) and the engine; this rank's place in the grid."""
        from msrl_core.trainer.config import from_yaml, model_config
        from msrl_core.trainer.engines import process_group_backend
        from msrl_core.trainer.engines.megatron import MegatronTrainEngine, init_distributed

        cfg = from_yaml(self.cfg_yaml)
        local_rank = int(
            os.environ.get("LOCAL_RANK", self.rank % max(1, cfg.trainer.devices_per_node or self.world))
        )
        init_distributed(self.rank, self.world, port, process_group_backend(self.device), addr=addr)
        self.engine = MegatronTrainEngine(
            cfg, model_config(cfg.model), self.seed, rank=self.rank, device=self.device, local_rank=local_rank
        )
        e = self.engine
        return {
            "rank": self.rank,
            "dp_rank": e.dp_rank,
            "tp_rank": e.tp_rank,
            "pp_rank": e.pp_rank,
            "node": node_name(),
        }

    def init_optimizer(self, lr: float, weight_decay: float) -> None:
        self.engine.init_optimizer(lr, weight_decay)

    def make_reference(self) -> None:
        self.reference = _Reference(self.engine, self.engine.frozen_copy())

    def _saw(self, what: str, rows: Any) -> None:
        self.seen.setdefault(what, []).append([int(x) for x in np.asarray(rows)])

    def log_probs(self, model: str, share: dict[str, Any], pad_id: int, temperature: float) -> Any:
        self._saw(model, share["rows"])
        eng = self.reference if model == "reference" else self.engine
        return ops.log_probs_share(eng, share, pad_id, temperature)

    def update(self, share: dict[str, Any], plan: list[ops.MiniBatch], settings: ops.UpdateSettings) -> Any:
        self._saw("update", share["rows"])
        return ops.update_share(self.engine, share, plan, settings)

    def sft_step(self, prompts: list[Any], responses: list[Any], pad_id: int, num_tokens: float) -> float:
        return ops.sft_share(self.engine, prompts, responses, pad_id, num_tokens)

    def switch(self, bucket_bytes: int, swap: bool) -> tuple[dict[str, float], Any]:
        """allgather_swap into rank 0's buffer (the driver's, when shared) or each rank's own copy; rank 0
        returns its HF weights when the driver's buffer is not shared with it."""
        from msrl_core.reshard import to_hf

        flat = plan = None
        if self.rank == 0 and self.rollout_buffer is not None:
            flat, plan = self.rollout_buffer, to_hf(self.engine.model_config, self.engine.parallel)
        sw = self.engine.switch(flat, plan, bucket_bytes, swap)
        telemetry = ops._numbers(sw.telemetry)
        back = None
        if self.rank == 0 and self.rollout_buffer is None:
            back = self.engine._infer.detach().cpu()
        return telemetry, back

    def switch_back(self) -> None:
        self.engine.switch_back()

    def save(self, run_dir: str, step: int) -> None:
        from msrl_core.trainer import checkpoint as ckpt

        ckpt.save_rank(
            run_dir,
            step,
            self.rank,
            ops._train_state(self.engine, self.reference),
            self.engine.optimizer_state(),
        )

    def load(self, path: str) -> None:
        ops._load_train_state(self.engine, self.reference, path, self.rank)

    def rows_seen(self) -> dict[str, list[list[int]]]:
        return self.seen

    def parameters(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.engine.state_dict().items()}

    def pid(self) -> int:
        return os.getpid()


class _Reference:
    """The frozen reference policy of this rank: forward only, through the engine's pipeline."""

    def __init__(self, engine: Any, module: Any) -> None:
        self.engine, self.module, self.device = engine, module, engine.device

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.engine.logits(tokens, model=self.module)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.module.named_parameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from msrl_core.trainer.engines.megatron import _load

        _load(self.module, state)
