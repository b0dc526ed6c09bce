"""The GRPO trainer: engines, the weight switch and the stages of one step over one ``Dock``.

One step (:meth:`GRPOTrainer.step`) reads top to bottom, like verl's ``fit``:

1. ``allgather_swap`` fills the rollout engine's HF-layout weights from the training shards and swaps the
   training weights out to pinned host memory (``timing/resharding_to_infer``);
2. the prompts of the step go into the dock (``rollout.n`` rows each, one group per prompt);
3. reference, rule_reward and adv start in the background: each claims a group as soon as the rollout has
   put it (they overlap the rollout, as in MindSpeed-RL's transfer dock);
4. rollout samples every group; then the training weights come back (``timing/resharding_to_train``);
5. old_log_p (off-policy only: several mini-batches or epochs) recomputes the old log-probs;
6. the background stages finish; update runs ``ppo_epochs`` x mini-batches of the clipped GRPO loss.

Every stage is one timed call whose work returns its outputs (the dock columns it writes) and its metrics.
The trainer moves no data of its own: samples go through the dock, weights through ``allgather_swap``;
model stages fetch their rows padded by the dock (one ``[rows, width]`` tensor per column).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from msrl_core import Ragged
from msrl_core.trainer import actor as A_
from msrl_core.trainer import algorithm as A
from msrl_core.trainer.actor import LocalActor
from msrl_core.trainer.config import rows_per_mini_batch, rows_per_step
from msrl_core.trainer.metrics import StageClock, e2e_tps, overlap_timings
from msrl_core.trainer.reward import score_record
from msrl_core.trainer.stages import STREAMING, StageRunner, Work, grpo_stages, make_dock


@dataclass
class Packed:
    """Prompt + response rows, right-padded: ``tokens`` [B, L]; the response token j of row i is
    ``tokens[i, pos[i, j] + 1]``, predicted at ``pos[i, j]``; ``mask`` [B, R] marks real response tokens."""

    tokens: torch.Tensor
    pos: torch.Tensor
    responses: torch.Tensor
    mask: torch.Tensor

    def to(self, device: Any) -> Packed:
        return Packed(*(t.to(device) for t in (self.tokens, self.pos, self.responses, self.mask)))


def pack(prompts: Any, responses: Any, pad_id: int) -> Packed:
    """Prompt + response rows from the dock's padded columns (``Padded``: values ``[B, W]``, lengths), in
    one vectorised pass; lists of per-row arrays (tests, the warm-up) are padded first."""
    P, plen = _padded(prompts, pad_id)
    R, rlen = _padded(responses, pad_id)
    B, Wp = P.shape
    Wr = max(1, R.shape[1])
    if R.shape[1] == 0:
        R = torch.full((B, 1), pad_id, dtype=torch.int64)
    rmask = torch.arange(Wr)[None, :] < rlen[:, None]
    L = int((plen + rlen).max())
    tokens = torch.full((B, Wp + Wr), pad_id, dtype=torch.int64)
    tokens[:, :Wp] = torch.where(torch.arange(Wp)[None, :] < plen[:, None], P, pad_id)
    resp = torch.where(rmask, R, pad_id)
    tokens.scatter_(1, plen[:, None] + torch.arange(Wr)[None, :], resp)
    tokens = tokens[:, :L]
    pos = ((plen - 1)[:, None] + torch.arange(Wr)[None, :]).clamp(max=L - 1)
    return Packed(tokens, pos, resp, rmask.float())


def _padded(x: Any, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [B, W] int64, lengths [B])`` of a dock ``Padded`` column or a list of per-row arrays."""
    if hasattr(x, "lengths") and hasattr(x, "values"):
        return torch.as_tensor(x.values).long(), torch.as_tensor(np.asarray(x.lengths), dtype=torch.int64)
    rows = [torch.as_tensor(np.asarray(r), dtype=torch.int64) for r in x]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id), lengths


def padded(col: Any, width: int) -> torch.Tensor:
    """A dock ``Padded`` float column as a ``[B, width]`` float32 tensor (zeros past each row's length)."""
    v = torch.as_tensor(col.values, dtype=torch.float32)
    out = torch.zeros((v.shape[0], width), dtype=torch.float32)
    out[:, : v.shape[1]] = v * col.mask
    return out


def ragged(values: torch.Tensor, lengths: torch.Tensor, dtype: Any) -> Ragged:
    """Right-padded ``[B, W]`` rows of ``lengths`` as the dock's ``Ragged`` (one masked select)."""
    mask = torch.arange(values.shape[1], device=values.device)[None, :] < lengths[:, None]
    return Ragged.from_lengths(values[mask].detach().cpu().numpy().astype(dtype), lengths.cpu().numpy())


#: The update's token count (prompt + response tokens of the step), for ``e2e_tps``.
TOKENS = "_tokens"


def loss_settings(actor: Any) -> dict[str, Any]:
    """The loss knobs of the actor section, as :func:`msrl_core.trainer.algorithm.actor_loss` takes them."""
    return {
        "clip_ratio_low": actor.clip_ratio_low,
        "clip_ratio_high": actor.clip_ratio_high,
        "kl_loss_coef": actor.kl_loss_coef,
        "kl_loss_type": actor.kl_loss_type,
        "entropy_coeff": actor.entropy_coeff,
        "loss_agg_mode": actor.loss_agg_mode,
    }


def on_policy(cfg: Any) -> bool:
    """Exactly on-policy (one epoch, one mini-batch): the update's own first forward is the old policy."""
    return cfg.actor.ppo_epochs == 1 and rows_per_mini_batch(cfg) == rows_per_step(cfg)


def stage_table(cfg: Any) -> list[Any]:
    """The stages of one step for ``cfg`` (:func:`msrl_core.trainer.stages.grpo_stages`)."""
    return grpo_stages(
        rows_per_step(cfg),
        cfg.rollout.n,
        claim_groups=cfg.rollout.claim_groups,
        use_reference=cfg.actor.kl_loss_coef != 0.0,
        recompute_old=not on_policy(cfg),
        dp=cfg.actor.dp,
    )


class RewardWork:
    """The rule_reward stage: scores each row's decoded response with the reward function against its
    record (:func:`msrl_core.trainer.reward.score_record`: this trainer's signature or verl's), and reports a
    dict reward's extra entries as ``reward/<key>/mean``. Picklable, so a Ray stage actor can run it: only
    the fields a reward takes travel, and the reward function is imported again from ``spec``
    (``reward.fn``) inside the actor."""

    FIELDS = ("prompt", "answer", "data_source", "extra_info")

    def __init__(self, records: list[dict], tokenizer: Any, fn: Any, spec: str | None) -> None:
        self.items = [{k: r[k] for k in self.FIELDS if k in r} for r in records]
        self.tok, self.fn, self.spec = tokenizer, fn, spec

    def __call__(self, batch: Any) -> tuple[dict[str, Any], dict[str, list[float]]]:
        scores: list[float] = []
        extras: dict[str, list[float]] = {}
        for r, i in zip(batch["responses"], np.asarray(batch["index"]).tolist()):
            value, extra = score_record(self.fn, self.items[i], self.tok.decode(r))
            scores.append(value)
            for k, v in extra.items():
                extras.setdefault(f"reward/{k}/mean", []).append(v)
        return {"scores": np.asarray(scores, dtype=np.float32)}, extras

    def __getstate__(self) -> dict[str, Any]:
        if self.spec is None:
            raise TypeError("a RewardWork without reward.fn cannot be sent to another process")
        return {k: v for k, v in self.__dict__.items() if k != "fn"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from msrl_core.trainer.reward import load_reward_fn

        self.__dict__.update(state)
        self.fn = load_reward_fn(state["spec"])


class AdvWork:
    """The adv stage: group-normalised GRPO advantages of whole groups (a group's rows are consecutive
    row ids, so sorting by row id lines the groups up)."""

    def __init__(self, n: int, norm_by_std: bool) -> None:
        self.n, self.norm_by_std = n, norm_by_std

    def __call__(self, batch: Any) -> dict[str, Any]:
        rows = np.asarray(batch.rows)
        order = np.argsort(rows, kind="stable")
        scores = torch.as_tensor(np.asarray(batch["scores"])[order])
        adv = A.grpo_advantages(scores, self.n, self.norm_by_std).numpy()
        out = np.empty_like(adv)
        out[order] = adv
        return {"advantages": out.astype(np.float32)}


class GRPOTrainer:
    """Engines, optimizer, dock and stage table of one run.

    ``records``: the training prompts (``{"prompt", "answer", ...}``); rows carry their position in this
    list through the dock's ``index`` column. ``reward_fn`` is called through
    :func:`msrl_core.trainer.reward.score_record` (either signature; failures name the function and the
    prompt). ``sampler_factory(views)`` builds the rollout engine over the HF-layout views that
    ``allgather_swap`` fills. ``train_engine``: an :class:`msrl_core.trainer.actor.Actor` (the Megatron
    engine's worker group, or an in-process engine wrapped in ``LocalActor``).
    """

    def __init__(
        self,
        cfg: Any,
        tokenizer: Any,
        records: list[dict],
        reward_fn: Any,
        train_engine: Any,
        sampler_factory: Any,
        swap: bool | None = None,
        dock_options: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.tok = cfg, tokenizer
        self.records = records
        self.reward_fn = reward_fn
        self.engine = train_engine if hasattr(train_engine, "rollout_buffer") else LocalActor(train_engine)
        self.swap_enabled = cfg.reshard.swap if swap is None else swap
        self.n = cfg.rollout.n
        self.batch_rows = rows_per_step(cfg)
        self.mini_batch_rows = rows_per_mini_batch(cfg)
        self.temperature = cfg.rollout.temperature
        a = cfg.actor
        self.on_policy = on_policy(cfg)
        self.use_reference = a.kl_loss_coef != 0.0
        if self.use_reference:
            self.engine.make_reference()
        self.engine.init_optimizer(a.lr, a.weight_decay)
        self.settings = A_.UpdateSettings(
            pad_id=tokenizer.pad_id,
            temperature=self.temperature,
            on_policy=self.on_policy,
            use_reference=self.use_reference,
            clip_grad=a.clip_grad,
            micro_batch_size=a.micro_batch_size,
            loss=loss_settings(a),
        )
        # the rollout engine's weights: the HF-layout buffer allgather_swap fills (allocated once)
        self.device = self.engine.device  # a torch.device: the rollout buffer lives there
        self.flat: torch.Tensor
        self.views: dict[str, torch.Tensor]
        self.flat, self.views = self.engine.rollout_buffer()
        self.sampler = sampler_factory(self.views)
        self.stages = stage_table(cfg)
        opts = dict(dock_options or {})
        if cfg.dock.backend == "ray" and cfg.dock.ray_address:
            opts.setdefault("ray_address", cfg.dock.ray_address)
        elif cfg.dock.backend == "ray":  # no Ray running: a small loopback one (the dock starts it)
            opts.setdefault("ray_init", LOOPBACK_RAY)
        if cfg.actor.dp > 1:  # the replicas' shares are balanced by their response tokens
            opts.setdefault("balance_by", "responses")
        self.dock = make_dock(
            self.stages, self.batch_rows, self.n, cfg.dock.warehouses, backend=cfg.dock.backend, **opts
        )
        work: dict[str, Work] = {
            "rollout": self._rollout,
            "reference": self._reference,
            "rule_reward": RewardWork(records, tokenizer, reward_fn, cfg.reward.fn),
            "adv": AdvWork(self.n, cfg.algorithm.norm_adv_by_std),
            "old_log_p": self._old_log_p,
            "update": self._update,
        }
        self.runner = StageRunner(
            self.dock,
            self.stages,
            work,
            deadline_s=cfg.trainer.step_timeout_s,
            remote=cfg.dock.backend == "ray",
        )
        self.step_index = 0
        self._gen = torch.Generator(device=self.device)

    # ---- stage work ----------------------------------------------------------------------------------

    def _rollout(self, batch: Any) -> dict[str, Any]:
        col = batch["prompts"]  # Ragged: the sampler takes one tensor per prompt (views of one array)
        prompts = list(torch.as_tensor(col.values).split(np.diff(np.asarray(col.offsets)).tolist()))
        r = self.cfg.rollout
        toks, lps, lengths = self.sampler.generate_padded(
            prompts,
            r.max_response_length,
            self.tok.eos_ids,
            self.tok.pad_id,
            self.temperature,
            r.top_p,
            self._gen,
        )
        return {
            "responses": ragged(toks, lengths, np.int64),
            "rollout_log_prob": ragged(lps, lengths, np.float32),
        }

    def _logp_of(self, model: str, batches: list[Any]) -> list[dict[str, Any]]:
        """Per replica, the log-probs of its rows under ``model`` (each replica computes its own share)."""
        shares = [A_.share_of(b, ("prompts", "responses")) if b is not None else _EMPTY for b in batches]
        col = "ref_log_prob" if model == "reference" else "old_log_prob"
        lps = self.engine.log_probs(model, shares, self.tok.pad_id, self.temperature)
        return [
            {col: ragged(lp, sh["responses"].lengths, np.float32)} if len(sh["rows"]) else {}
            for lp, sh in zip(lps, shares)
        ]

    def _reference(self, batches: list[Any]) -> list[dict[str, Any]]:
        return self._logp_of("reference", batches)

    def _old_log_p(self, batches: list[Any]) -> list[dict[str, Any]]:
        return self._logp_of("policy", batches)

    def _update(self, batches: list[Any]) -> tuple[None, dict[str, list[float]]]:
        """The update of the step: each replica trains on its share of the rows (DP-aware claims), the
        gradients summed over the replicas (see :mod:`msrl_core.trainer.actor`)."""
        spec = next(s for s in self.stages if s.name == "update")
        shares = [A_.share_of(b, spec.reads) if b is not None else _EMPTY for b in batches]
        lengths = [
            sh["responses"].lengths.numpy() if len(sh["rows"]) else np.zeros(0, np.int64) for sh in shares
        ]
        plans = A_.mini_batch_plan(
            lengths, self.mini_batch_rows, self.cfg.actor.ppo_epochs, self._step_seed()
        )
        out = self.engine.update(shares, plans, self.settings)
        resp = float(sum(int(x.sum()) for x in lengths))
        prompt = float(sum(int(sh["prompts"].lengths.sum()) for sh in shares if len(sh["rows"])))
        out["response_length/mean"] = [resp / self.batch_rows]
        out[TOKENS] = [resp + prompt]
        return None, out

    # ---- weights ------------------------------------------------------------------------------------

    def _switch_to_rollout(self, swap: bool) -> dict[str, Any]:
        return self.engine.switch(self.cfg.reshard.bucket_mb << 20, swap)

    def hf_weights(self) -> dict[str, Any]:
        """The current policy in the Hugging Face layout (``to_hf`` through ``allgather_swap``, no swap)."""
        self._switch_to_rollout(swap=False)
        self.sampler.on_switch()
        return self.views

    @contextlib.contextmanager
    def rollout_weights(self, metrics: dict[str, float]) -> Iterator[None]:
        """The rollout engine holds the policy inside this block (the training copy swapped out to pinned
        host memory); on leaving it, also on an error, the training weights come back (the one place)."""
        t = time.perf_counter()
        telemetry = self._switch_to_rollout(self.swap_enabled)
        self.sampler.on_switch()  # a live engine (vLLM) loads the switched weights; HF reads the views
        metrics["timing/resharding_to_infer"] = time.perf_counter() - t
        metrics.update({f"reshard/{k}": float(v) for k, v in telemetry.items()})
        try:
            yield
        finally:
            t = time.perf_counter()
            release = getattr(self.sampler, "release", None)  # vLLM: sleep, its memory goes to training
            if release is not None:
                release()
            self.engine.switch_back()
            metrics["timing/resharding_to_train"] = time.perf_counter() - t

    def _step_seed(self) -> int:
        return self.cfg.trainer.seed * 100_003 + self.step_index

    def _put_prompts(self, batch_records: list[dict]) -> None:
        """The step's prompts into the dock: one group of ``rollout.n`` rows per prompt."""
        lengths = np.asarray([len(r["prompt_ids"]) for r in batch_records], np.int64)
        values = np.concatenate([r["prompt_ids"] for r in batch_records])  # tokenized once, when read
        group = Ragged.from_lengths(values, lengths)
        rows = np.repeat(np.arange(len(batch_records)), self.n)
        starts = np.asarray(group.offsets[:-1])[rows]
        idx = (starts[:, None] + np.arange(lengths.max())[None, :])[
            np.arange(lengths.max()) < lengths[rows, None]
        ]
        self.dock.put(
            {
                "prompts": Ragged.from_lengths(values[idx], lengths[rows]),
                "index": np.repeat(np.asarray([r["_row"] for r in batch_records], np.int64), self.n),
            }
        )

    def step(self, batch_records: list[dict], val_records: list[dict] | None = None) -> dict[str, float]:
        """One GRPO iteration over ``batch_records`` (each with ``"_row"``, its index in ``records``, and
        ``"prompt_ids"``). With ``val_records``, also scores them with greedy decoding on the rollout
        weights of this step (the policy before this step's update) as ``val/score/mean``."""
        t_all = time.perf_counter()
        self._gen.manual_seed(self._step_seed())
        clock = StageClock()
        m: dict[str, float] = {}
        self.dock.reset()
        with self.runner.iteration(clock) as stages:
            with self.rollout_weights(m):
                if val_records:
                    t = time.perf_counter()
                    m["val/score/mean"] = self.validate(val_records)
                    m["timing/val"] = time.perf_counter() - t
                self._put_prompts(batch_records)
                stages.start(STREAMING)  # reference, rule_reward, adv: each group as the rollout puts it
                stages.run("rollout")
            if not self.on_policy:
                stages.run("old_log_p")
            stages.join()
            stages.run("update")
        m.update(self.runner.metric_means())  # the update's, and e.g. a dict reward's reward/<key>/mean
        tokens = m.pop(TOKENS)
        scores = self.dock.fetch(np.arange(self.batch_rows), ["scores"])["scores"]
        total = time.perf_counter() - t_all - m.get("timing/val", 0.0)  # the step without validation
        m["grpo/score/mean"] = float(np.mean(scores))
        m.update(overlap_timings(clock.intervals(), total))
        m["e2e_tps"] = e2e_tps(int(tokens), total, self.world_size())
        m.update(_dock_metrics(self.dock.stats(), self.dock.progress(), self.runner.counts))
        self.step_index += 1
        return m

    @torch.no_grad()
    def validate(self, records: list[dict]) -> float:
        """Mean reward of greedy responses to ``records`` on the rollout weights (call while they are
        filled: inside a step, or after :meth:`hf_weights`)."""
        total = 0.0
        r = self.cfg.rollout
        for s in range(0, len(records), 64):
            chunk = records[s : s + 64]
            prompts = [torch.as_tensor(x["prompt_ids"]) for x in chunk]
            toks, _ = self.sampler.generate(
                prompts,
                r.max_response_length,
                self.tok.eos_ids,
                self.tok.pad_id,
                1.0,
                1.0,
                None,
                greedy=True,
            )
            for x, t in zip(chunk, toks):
                total += score_record(self.reward_fn, x, self.tok.decode(t.tolist()))[0]
        return total / max(1, len(records))

    def close(self) -> None:
        """End the stage actors and the dock (its Ray actors with ``dock.backend=ray``)."""
        self.runner.close()
        self.dock.shutdown()

    def world_size(self) -> int:
        return self.engine.world_size()


#: The share of a replica that got no rows this round.
_EMPTY: dict[str, Any] = {"rows": np.zeros(0, np.int64)}

#: ``ray.init`` arguments of the loopback Ray started when ``dock.backend=ray`` and no address is given.
LOOPBACK_RAY = {
    "include_dashboard": False,
    "_node_ip_address": "127.0.0.1",
    "object_store_memory": 256 << 20,
    "log_to_driver": False,
}


def _dock_metrics(
    stats: dict[str, Any], progress: dict[str, dict[str, int]], counts: dict[str, int]
) -> dict[str, float]:
    """The same ``dock/*`` keys on every backend: client-side latencies of put/claim/fetch (the dock's
    own figures), the operations this step issued (counted by the trainer) and rows consumed per stage."""
    out: dict[str, float] = {}
    for op in ("put", "claim", "fetch"):
        d = stats.get("ops", {}).get(op, {})
        for k in ("p50_us", "p99_us"):
            v = d.get(k)
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                out[f"dock/{op}_{k}"] = float(v)
        out[f"dock/{op}_count"] = float(counts.get(op, 0))
    for stage, p in progress.items():
        out[f"dock/consumed_{stage}"] = float(p.get("consumed_rows", 0))
    return out
