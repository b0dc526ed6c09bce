"""The trained policy as the driver sees it: log-probs of rows, the update, the weight switch, checkpoints.

:class:`Actor` is the one interface :class:`msrl_core.trainer.grpo.GRPOTrainer` drives. Two implementations
run the same per-rank code (the ``*_share`` functions below, which a rank applies to its replica's rows):

- :class:`WorkerActor`: the Megatron engine on a worker group (:mod:`msrl_core.trainer.workers`), one
  worker per rank of ``actor.dp`` x ``actor.tp`` x ``actor.pp`` x ``actor.ep``; each DP replica gets its own
  rows (a *share*: the dock's DP-aware claims), all ranks of a replica the same ones;
- :class:`LocalActor`: an engine in the driver's process (the HF engine: TP 1, DP 1).

Data parallelism keeps the arithmetic of one replica: the driver cuts each replica's rows into the same
number of mini-batches and gives every rank the *global* token and sequence counts of each mini-batch, so a
replica's loss is its share of the global batch's mean and the sum of the replicas' gradients (the DP
all-reduce in :meth:`msrl_core.trainer.engines.megatron.MegatronTrainEngine.clip_and_step`) is the gradient
a single replica computes on the whole batch. Metrics that are shares (losses, clip fractions) are summed
over replicas; the grad norm is the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from msrl_core.trainer import algorithm as A


@dataclass
class Cols:
    """A ragged column of a share, right-padded: ``values`` [B, W], ``lengths`` [B] (what ``pack`` reads)."""

    values: torch.Tensor
    lengths: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        return (torch.arange(self.values.shape[1])[None, :] < self.lengths[:, None]).to(self.values.dtype)


def share_of(batch: Any, columns: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """A replica's rows of a dock batch (padded fetch) as plain tensors: ``rows`` (row ids) and each column
    (ragged ones as :class:`Cols`). Picklable, so it travels to a worker."""
    out: dict[str, Any] = {"rows": np.asarray(batch.rows, dtype=np.int64)}
    for c in columns:
        v = batch[c]
        if hasattr(v, "lengths") and hasattr(v, "values"):
            out[c] = Cols(
                torch.as_tensor(v.values), torch.as_tensor(np.asarray(v.lengths), dtype=torch.int64)
            )
        else:
            out[c] = torch.as_tensor(np.asarray(v))
    return out


@dataclass(frozen=True)
class MiniBatch:
    """One replica's rows of one mini-batch (indices into its share) and the global batch's counts."""

    rows: np.ndarray
    num_tokens: float
    num_seqs: float


def mini_batch_plan(
    response_lengths: list[np.ndarray], mini_batch_rows: int, epochs: int, seed: int
) -> list[list[MiniBatch]]:
    """Per replica, its mini-batches in order (the same count on every replica: each epoch permutes a
    replica's rows and cuts them into ``global rows / mini_batch_rows`` pieces); each with the global
    mini-batch's token and sequence counts. One replica: :func:`msrl_core.trainer.algorithm.mini_batches`."""
    n = [len(x) for x in response_lengths]
    total = sum(n)
    if len(n) == 1:
        orders = [A.mini_batches(total, mini_batch_rows, epochs, seed)]
    else:
        per_epoch = max(1, total // mini_batch_rows)
        orders = []
        for r, nr in enumerate(n):
            rng = np.random.default_rng([seed, r])
            orders.append([c for _ in range(epochs) for c in np.array_split(rng.permutation(nr), per_epoch)])
    plans: list[list[MiniBatch]] = [[] for _ in n]
    for k in range(len(orders[0])):
        ntok = float(sum(int(response_lengths[r][orders[r][k]].sum()) for r in range(len(n))))
        nseq = float(sum(len(orders[r][k]) for r in range(len(n))))
        for r in range(len(n)):
            plans[r].append(MiniBatch(np.asarray(orders[r][k], dtype=np.int64), ntok, nseq))
    return plans


@dataclass(frozen=True)
class UpdateSettings:
    """What the update of a share needs besides its rows (all picklable)."""

    pad_id: int
    temperature: float
    on_policy: bool
    use_reference: bool
    clip_grad: float
    micro_batch_size: int
    loss: dict[str, Any]


def _tokens_logits(engine: Any, pk: Any, rows: Any) -> tuple[Any, int]:
    L = int(pk.pos[rows].max()) + 2
    return engine.logits(pk.tokens[rows, :L]), L


def response_log_probs(
    engine: Any, pk: Any, rows: Any, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
    """(log-probs, entropies, the forward's output) of the response tokens of ``rows`` under ``engine`` at
    ``temperature``; log-probs None on a later PP stage (its output is the anchor to run backward on)."""
    out, _ = _tokens_logits(engine, pk, rows)
    if out.dim() == 0:
        return None, None, out
    V = out.shape[-1]
    at = torch.gather(out, 1, pk.pos[rows].unsqueeze(-1).expand(-1, -1, V)) / temperature
    lp = A.log_probs_from_logits(at, pk.responses[rows])
    return lp, (A.entropy_from_logits(at) if entropy else None), out


def log_probs_share(
    engine: Any, share: dict[str, Any], pad_id: int, temperature: float
) -> torch.Tensor | None:
    """Padded ``[B, R]`` log-probs of a share's responses (None on a later PP stage; empty share: [0, 0])."""
    from msrl_core.trainer.grpo import pack

    if len(share["rows"]) == 0:
        return torch.zeros((0, 0))
    pk = pack(share["prompts"], share["responses"], pad_id).to(engine.device)
    with torch.no_grad():
        lp, _, _ = response_log_probs(engine, pk, slice(None), temperature)
    return None if lp is None else lp.cpu()


def update_share(
    engine: Any, share: dict[str, Any], plan: list[MiniBatch], s: UpdateSettings
) -> dict[str, Any]:
    """This rank's part of the update: per mini-batch, its rows' micro-batches (forward, clipped GRPO loss
    normalised by the global counts, backward), then the engine's ``clip_and_step`` (DP all-reduce inside).
    Returns per mini-batch the metric shares (``mb``), the grad norms and the rollout/trainer log-prob
    difference of its rows (max, sum, count)."""
    from msrl_core.trainer.grpo import pack, padded

    dev = engine.device
    n = len(share["rows"])
    pk = pack(share["prompts"], share["responses"], s.pad_id).to(dev) if n else None
    if pk is not None:
        R = pk.mask.shape[1]
        adv = share["advantages"].to(dev)
        rollout_lp = padded(share["rollout_log_prob"], R).to(dev)
        ref_lp = padded(share["ref_log_prob"], R).to(dev) if s.use_reference else None
        old_lp = None if s.on_policy else padded(share["old_log_prob"], R).to(dev)
        first_old = torch.zeros_like(rollout_lp)
    mbs: list[dict[str, float]] = []
    norms: list[float] = []
    for mb_i, mb in enumerate(plan):
        engine.zero_grad()
        acc: dict[str, float] = {}
        for st in range(0, len(mb.rows), s.micro_batch_size):
            assert pk is not None
            rows = torch.as_tensor(mb.rows[st : st + s.micro_batch_size], device=dev)
            lp, ent, out = response_log_probs(engine, pk, rows, s.temperature, entropy=True)
            if lp is None:  # a later PP stage: its backward from the anchor
                out.backward()
                continue
            if old_lp is None:  # exactly on-policy: this forward (before any optimizer step) is the old
                old = lp.detach()
                if mb_i == 0:
                    first_old[rows] = old
            else:
                old = old_lp[rows]
            loss, m = A.actor_loss(
                lp,
                old,
                None if ref_lp is None else ref_lp[rows],
                adv[rows],
                pk.mask[rows],
                ent,
                **s.loss,
                num_tokens=mb.num_tokens,
                num_seqs=mb.num_seqs,
            )
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite actor loss {float(loss)}")
            loss.backward()
            for k, v in m.items():  # micro-batch shares: they sum to the global mini-batch's value
                acc[k] = acc.get(k, 0.0) + v
        norms.append(engine.clip_and_step(s.clip_grad))
        mbs.append(acc)
    diff = {"max": 0.0, "sum": 0.0, "count": 0.0}
    if pk is not None:
        trainer_lp = first_old if old_lp is None else old_lp
        d = (trainer_lp - rollout_lp).abs()[pk.mask.bool()]
        if d.numel():
            diff = {"max": float(d.max()), "sum": float(d.sum()), "count": float(d.numel())}
    return {"mb": mbs, "grad_norm": norms, "diff": diff, "rows": share["rows"]}


def sft_share(engine: Any, prompts: list[Any], responses: list[Any], pad_id: int, num_tokens: float) -> float:
    """One supervised step (the demo's format warm-up): cross-entropy of ``responses`` after ``prompts``,
    normalised by the global ``num_tokens``; returns this replica's share of the loss."""
    from msrl_core.trainer.grpo import pack

    engine.zero_grad()
    loss_share = 0.0
    if prompts:
        pk = pack(prompts, responses, pad_id).to(engine.device)
        logits = engine.logits(pk.tokens)
        if logits.dim() == 0:
            logits.backward()
        else:
            V = logits.shape[-1]
            at = torch.gather(logits, 1, pk.pos.unsqueeze(-1).expand(-1, -1, V))
            lp = A.log_probs_from_logits(at, pk.responses)
            loss = -(lp * pk.mask).sum() / num_tokens
            loss.backward()
            loss_share = float(loss.detach())
    engine.clip_and_step(0.0)
    return loss_share


def combine_updates(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The replicas' update results (one per replica) as the step's metrics: per mini-batch the sum of the
    shares, then the mean over mini-batches; the grad norm of replica 0 (the same on all); the log-prob
    difference over every row."""
    sums: dict[str, list[float]] = {}
    for k_mb in range(len(results[0]["mb"])):
        acc: dict[str, float] = {}
        for res in results:
            for k, v in res["mb"][k_mb].items():
                acc[k] = acc.get(k, 0.0) + v
        acc["actor/grad_norm"] = results[0]["grad_norm"][k_mb]
        for k, v in acc.items():
            sums.setdefault(k, []).append(v)
    out = {k: [float(np.mean(v))] for k, v in sums.items()}
    count = sum(r["diff"]["count"] for r in results)
    out["training/rollout_probs_diff_max"] = [max(r["diff"]["max"] for r in results)]
    out["training/rollout_probs_diff_mean"] = [
        sum(r["diff"]["sum"] for r in results) / count if count else 0.0
    ]
    return out


class Actor(Protocol):
    """What the trainer drives (see the module docstring)."""

    model_config: Any
    parallel: Any
    dp: int
    device: Any  # the driver's device: where the rollout buffer lives

    def rollout_buffer(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rollout engine's HF-layout weights (flat buffer, views) that :meth:`switch` fills."""

    def init_optimizer(self, lr: float, weight_decay: float) -> None: ...

    def make_reference(self) -> None:
        """Copy the current policy as the frozen reference."""

    def log_probs(
        self, model: str, shares: list[dict[str, Any]], pad_id: int, temperature: float
    ) -> list[torch.Tensor]:
        """Per replica, the padded log-probs of its share under ``model`` (``policy`` or ``reference``)."""

    def update(
        self, shares: list[dict[str, Any]], plans: list[list[MiniBatch]], settings: UpdateSettings
    ) -> dict[str, list[float]]: ...

    def sft_step(self, prompts: list[Any], responses: list[Any], pad_id: int) -> float: ...

    def switch(self, bucket_bytes: int, swap: bool) -> dict[str, Any]:
        """Fill the rollout buffer (allgather_swap; ``swap``: training weights to host); its telemetry."""

    def switch_back(self) -> None: ...

    def save(self, run_dir: str, step: int) -> None:
        """Every rank's shard and optimizer state of the checkpoint of ``step`` (its temporary dir)."""

    def load(self, path: str) -> None: ...

    def world_size(self) -> int: ...

    def close(self) -> None: ...


def _numbers(telemetry: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in telemetry.items() if isinstance(v, (int, float))}


class LocalActor:
    """An engine in the driver's process (the HF engine; one replica)."""

    dp = 1

    def __init__(self, engine: Any) -> None:
        from msrl_core.reshard import to_hf

        self.engine = engine
        self.model_config, self.parallel, self.device = engine.model_config, engine.parallel, engine.device
        self.reference: Any = None
        self.plan = to_hf(self.model_config, self.parallel)
        self.flat, self.views = self.plan.allocate_inference(device=self.device)

    def rollout_buffer(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.flat, self.views

    def init_optimizer(self, lr: float, weight_decay: float) -> None:
        self.engine.init_optimizer(lr, weight_decay)

    def make_reference(self) -> None:
        self.reference = self.engine.frozen_copy()

    def log_probs(
        self, model: str, shares: list[dict[str, Any]], pad_id: int, temperature: float
    ) -> list[torch.Tensor]:
        eng = self.reference if model == "reference" else self.engine
        return [log_probs_share(eng, sh, pad_id, temperature) for sh in shares]  # type: ignore[misc]

    def update(
        self, shares: list[dict[str, Any]], plans: list[list[MiniBatch]], settings: UpdateSettings
    ) -> dict[str, list[float]]:
        return combine_updates([update_share(self.engine, shares[0], plans[0], settings)])

    def sft_step(self, prompts: list[Any], responses: list[Any], pad_id: int) -> float:
        ntok = float(sum(len(r) for r in responses))
        return sft_share(self.engine, prompts, responses, pad_id, ntok)

    def switch(self, bucket_bytes: int, swap: bool) -> dict[str, Any]:
        return _numbers(self.engine.switch(self.flat, self.plan, bucket_bytes, swap).telemetry)

    def switch_back(self) -> None:
        self.engine.switch_back()

    def save(self, run_dir: str, step: int) -> None:
        from msrl_core.trainer import checkpoint as ckpt

        ckpt.save_rank(
            run_dir, step, 0, _train_state(self.engine, self.reference), self.engine.optimizer_state()
        )

    def load(self, path: str) -> None:
        _load_train_state(self.engine, self.reference, path, 0)

    def world_size(self) -> int:
        return 1

    def close(self) -> None:
        self.engine.close()


def _train_state(engine: Any, reference: Any) -> dict[str, torch.Tensor]:
    tensors = {f"policy/{k}": v for k, v in engine.state_dict().items()}
    if reference is not None:
        tensors.update({f"ref/{k}": v for k, v in reference.state_dict().items()})
    return tensors


def _load_train_state(engine: Any, reference: Any, path: str, rank: int) -> None:
    from pathlib import Path

    from msrl_core.trainer import checkpoint as ckpt

    state, opt, _ = ckpt.load(Path(path), rank)
    engine.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("policy/")})
    if reference is not None:
        reference.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("ref/")})
    engine.load_optimizer_state(opt)


#: The worker class of the Megatron engine's ranks.
WORKER_CLASS = "msrl_core.trainer.actor_worker:ActorWorker"


class WorkerActor:
    """The Megatron engine on a worker group: ``actor.dp`` replicas of ``tp x pp x ep`` ranks."""

    def __init__(self, cfg: Any, seed: int, device: str = "cpu") -> None:
        from msrl_core.reshard import Parallel, to_hf
        from msrl_core.trainer.config import model_config, to_yaml
        from msrl_core.trainer.engines import torch_device
        from msrl_core.trainer.workers import START_TIMEOUT_S, LocalWorkerGroup, RayWorkerGroup

        a, t = cfg.actor, cfg.trainer
        self.dp = a.dp
        self.parallel = Parallel(tp=a.tp, pp=a.pp, ep=a.ep)
        self.model_config = model_config(cfg.model)
        self.ranks_per_replica = a.tp * a.pp * a.ep
        world = self.dp * self.ranks_per_replica
        self.device = torch_device(device, 0)
        self.plan = to_hf(self.model_config, self.parallel)
        self.flat, self.views = self.plan.allocate_inference(device=self.device)
        self.shared = t.workers == "local" and device == "cpu"
        kwargs = {"cfg_yaml": to_yaml(cfg), "seed": seed, "world": world, "device": device}
        if self.shared:  # rank 0 fills the driver's rollout buffer in shared memory, no copy
            self.flat.share_memory_()
            self.group: Any = LocalWorkerGroup(
                WORKER_CLASS,
                world,
                kwargs,
                spawn_kwargs={0: {"rollout_buffer": self.flat}},
                timeout=t.step_timeout_s,
            )
        elif t.workers == "local":
            self.group = LocalWorkerGroup(WORKER_CLASS, world, kwargs, timeout=t.step_timeout_s)
        else:
            per_node = t.devices_per_node or world // t.nnodes
            self.group = RayWorkerGroup(
                WORKER_CLASS, world, kwargs, t.nnodes, per_node, device=device, timeout=t.step_timeout_s
            )
        try:
            addr, port, _ = self.group.call("rendezvous")[0]
            # torch.distributed + the engine, every rank (a start-up deadline, not the step's)
            self.ranks = self.group.call("init", addr, port, timeout=max(t.step_timeout_s, START_TIMEOUT_S))
        except BaseException:
            self.group.close()
            raise
        # replica r's ranks, and the one whose results stand for the replica (TP rank 0 of PP stage 0)
        self.replica_of = [info["dp_rank"] for info in self.ranks]
        self.lead = [
            next(
                i
                for i, x in enumerate(self.ranks)
                if x["dp_rank"] == r and x["tp_rank"] == 0 and x["pp_rank"] == 0
            )
            for r in range(self.dp)
        ]

    def rollout_buffer(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.flat, self.views

    def _per_rank(self, per_replica: list[tuple]) -> list[tuple]:
        return [per_replica[d] for d in self.replica_of]

    def init_optimizer(self, lr: float, weight_decay: float) -> None:
        self.group.call("init_optimizer", lr, weight_decay)

    def make_reference(self) -> None:
        self.group.call("make_reference")

    def log_probs(
        self, model: str, shares: list[dict[str, Any]], pad_id: int, temperature: float
    ) -> list[torch.Tensor]:
        out = self.group.call(
            "log_probs", per_rank=self._per_rank([(model, sh, pad_id, temperature) for sh in shares])
        )
        return [out[i] for i in self.lead]

    def update(
        self, shares: list[dict[str, Any]], plans: list[list[MiniBatch]], settings: UpdateSettings
    ) -> dict[str, list[float]]:
        out = self.group.call(
            "update", per_rank=self._per_rank([(sh, pl, settings) for sh, pl in zip(shares, plans)])
        )
        return combine_updates([out[i] for i in self.lead])

    def sft_step(self, prompts: list[Any], responses: list[Any], pad_id: int) -> float:
        ntok = float(sum(len(r) for r in responses))
        parts = [(prompts[r :: self.dp], responses[r :: self.dp], pad_id, ntok) for r in range(self.dp)]
        out = self.group.call("sft_step", per_rank=self._per_rank(parts))
        return float(sum(out[i] for i in self.lead))

    def switch(self, bucket_bytes: int, swap: bool) -> dict[str, Any]:
        out = self.group.call("switch", bucket_bytes, swap)
        telemetry, flat = out[0]
        if flat is not None:  # not shared: rank 0's HF weights come back (a Ray actor, an accelerator)
            self.flat.copy_(flat.to(self.flat.device))
        return telemetry

    def switch_back(self) -> None:
        self.group.call("switch_back")

    def save(self, run_dir: str, step: int) -> None:
        self.group.call("save", str(run_dir), step)

    def load(self, path: str) -> None:
        self.group.call("load", str(path))

    def world_size(self) -> int:
        return self.dp * self.ranks_per_replica

    def rows_seen(self) -> list[dict[str, list[list[int]]]]:
        """Per rank, the row ids of every share it computed on, by method (what the tests check)."""
        return self.group.call("rows_seen")

    def parameters_of(self, rank: int) -> dict[str, np.ndarray]:
        return self.group.call("parameters")[rank]

    def close(self) -> None:
        self.group.close()
