"""Hugging Face engines: the ``hf`` training engine (TP 1) and the built-in HF rollout sampler.

Both run a transformers ``*ForCausalLM`` built from the trainer's model config (no hub download). The
training engine keeps its trainable leaves in the Megatron layout (what ``allgather_swap`` reads) and
derives the HF tensors on each forward with ``msrl_core.reshard.reference.megatron_to_hf`` (differentiable
torch slicing: one rule for the layout, shared with the reshard reference). The sampler's weights are the
views of the flat buffer that ``allgather_swap`` fills (``plan.allocate_inference()``): nothing is copied
into it outside the switch.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Sequence
from typing import Any

import torch

import msrl_core
from msrl_core.reshard import ModelConfig, Parallel, to_hf
from msrl_core.reshard.reference import megatron_to_hf
from msrl_core.reshard.steps import current_stream
from msrl_core.trainer.config import model_config
from msrl_core.trainer.engines import torch_device


def hf_config(model: Any) -> Any:
    """The transformers config of the model section (``cfg.model``) through the one model description
    (``msrl_core.models.hf_config``): the same norm epsilon, RoPE base and positions in every engine."""
    from msrl_core.models import hf_config as models_hf_config

    return models_hf_config(model_config(model))


def transformers_model(model: Any, device: Any = "cpu") -> Any:
    """A transformers model of the model section ``model`` (llama / qwen2 / qwen3) with its parameters on
    the meta device (every forward supplies them) and its buffers on ``device``."""
    import transformers as tf

    c = hf_config(model)
    c._attn_implementation = "eager"
    # parameters stay on the meta device (every forward supplies them); buffers (rotary frequencies) are
    # rebuilt on the device by constructing their owning modules there
    with torch.device("meta"):
        net = tf.AutoModelForCausalLM.from_config(c)
    for mod in list(net.modules()):
        metas = [n for n, b in mod.named_buffers(recurse=False) if b.is_meta]
        if metas:
            with torch.device(device):
                fresh = type(mod)(mod.config)
            for n in metas:
                setattr(mod, n, getattr(fresh, n))
    return net.eval()


def initial_params(model: Any, seed: int) -> dict[str, torch.Tensor]:
    """The TP-1 Megatron-layout starting weights: the checkpoint at ``model.path`` (through the reshard
    plan run in reverse), else seeded random ones (:func:`init_megatron_params`)."""
    if model.path:
        from msrl_core.trainer.hf_dir import load_megatron_shard

        return load_megatron_shard(model, Parallel(tp=1))
    return init_megatron_params(model_config(model), seed)


def init_megatron_params(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Megatron-layout (TP 1) parameters, seeded per name: norms 1, biases 0, others N(0, 0.02)."""
    shapes = to_hf(cfg, Parallel(tp=1)).train_shapes(0)
    out = {}
    for name, shape in shapes.items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if "norm" in name.rsplit(".", 2)[-2] or name.endswith("layer_norm_weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        out[name] = t.to(getattr(torch, cfg.dtype))
    return out


_EXPERT = re.compile(
    r"^(?P<layer>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fuse_experts(hf: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint-layout expert tensors (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) as transformers'
    in-memory layout: ``...mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and
    ``...mlp.experts.down_proj`` ``[E, H, I]``; every other tensor as it is."""
    out: dict[str, Any] = {}
    experts: dict[str, dict[str, dict[int, Any]]] = {}
    for k, v in hf.items():
        m = _EXPERT.match(k)
        if m is None:
            out[k] = v
        else:
            experts.setdefault(m["layer"], {}).setdefault(m["proj"], {})[int(m["e"])] = v
    for layer, projs in experts.items():
        n = len(projs["down_proj"])
        out[f"{layer}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)]
        )
        out[f"{layer}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def _functional_logits(model: Any, hf_tensors: dict[str, Any], tokens: torch.Tensor, mask=None, pos=None):
    out = torch.func.functional_call(
        model,
        {**dict(model.named_buffers()), **hf_tensors},
        args=(),
        kwargs={"input_ids": tokens, "attention_mask": mask, "position_ids": pos, "use_cache": False},
        tie_weights=False,
        strict=True,
    )
    return out.logits


class HFTrainEngine:
    """TP-1 training engine: transformers forward over Megatron-layout leaves."""

    def __init__(
        self,
        model: Any,
        seed: int,
        params: dict[str, torch.Tensor] | None = None,
        trainable: bool = True,
        device: str = "cpu",
    ) -> None:
        self.section = model  # cfg.model
        self.model_config = model_config(model)
        self.parallel = Parallel(tp=1)
        self.groups: dict[str, Any] = {"tp": None, "pp": None, "ep": None}
        self.device_name = device
        self.device = torch_device(device)
        self.model = transformers_model(model, self.device)
        if params is None:  # initialised on the CPU (the same weights on every device), then moved
            params = {k: v.to(self.device) for k, v in initial_params(model, seed).items()}
        self.params = params
        for p in self.params.values():
            p.requires_grad_(trainable)
        self.rank = 0
        self.optimizer: Any = None
        self._swap: Any = None

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        hf = megatron_to_hf(self.model_config, self.parallel, {(0, 0, 0): self.params})
        if self.model_config.tie_word_embeddings:
            hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
        return _functional_logits(self.model, hf, tokens.to(self.device))

    def train_params(self) -> dict[str, torch.Tensor]:
        return self.params

    def parameters(self) -> list[torch.Tensor]:
        return list(self.params.values())

    def init_optimizer(self, lr: float, weight_decay: float) -> None:
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_and_step(self, max_norm: float) -> float:
        """Global grad norm; clips to ``max_norm`` (> 0) and steps when the norm is finite."""
        ps = [p for p in self.params.values() if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(ps, max_norm if max_norm > 0 else float("inf")))
        if math.isfinite(norm):
            self.optimizer.step()
        return norm

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def switch(self, flat: Any, plan: Any, bucket_bytes: int, swap: bool) -> Any:
        """``allgather_swap`` of the Megatron-layout leaves into the HF-layout ``flat`` buffer."""
        self._swap = msrl_core.allgather_swap(
            self.params, flat, plan, self.groups, bucket_bytes=bucket_bytes, swap=swap
        )
        return self._swap

    def switch_back(self) -> None:
        if self._swap is not None and self._swap.state != "back":
            self._swap.swap_back(stream=current_stream(self.device))
            self._swap.wait()

    def save_followers(self, step: int) -> None:
        """No other ranks (TP 1)."""

    def load_followers(self, path: Any) -> None:
        """No other ranks (TP 1)."""

    def close(self) -> None:
        """Nothing to stop."""

    def frozen_copy(self) -> HFTrainEngine:
        params = {k: v.detach().clone() for k, v in self.params.items()}
        return HFTrainEngine(
            self.section,
            0,
            params=params,
            trainable=False,
            device=self.device_name,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.params.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self.params) - set(state))
        if missing:
            raise ValueError(f"checkpoint lacks parameters {missing[:3]}... ({len(missing)} missing)")
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(state[k])


class HFSampler:
    """Built-in rollout engine: a transformers model whose weights are the HF-layout views that
    ``allgather_swap`` fills. Batched sampling with left padding; returns the log-probs of the sampled
    tokens under the temperature-scaled distribution (what the trainer recomputes)."""

    def __init__(self, model: Any, views: dict[str, Any], device: str = "cpu"):
        self.device = torch_device(device)
        self.model = transformers_model(model, self.device)
        self.views = dict(views)
        if model.tie_word_embeddings:
            self.views["lm_head.weight"] = self.views["model.embed_tokens.weight"]
        self._weights = self.views
        self._fused = any(".mlp.experts.0." in k for k in self.views)

    def on_switch(self) -> None:
        """Dense models: nothing to do, the views are this sampler's weights (``allgather_swap`` filled them
        in place). MoE: transformers keeps each layer's experts as two stacked tensors, built here once per
        switch from the per-expert checkpoint-layout views (a copy of the expert weights)."""
        if self._fused:
            self._weights = fuse_experts(self.views)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return _functional_logits(self.model, self._weights, tokens, mask, pos)

    @torch.no_grad()
    def generate(
        self, prompts: list[torch.Tensor], *args: Any, **kw: Any
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`generate_padded` per row: the response tokens and their log-probs."""
        toks, lps, lengths = self.generate_padded(prompts, *args, **kw)
        n = lengths.tolist()
        return [toks[i, : n[i]].clone() for i in range(len(n))], [
            lps[i, : n[i]].clone() for i in range(len(n))
        ]

    @torch.no_grad()
    def generate_padded(
        self,
        prompts: list[torch.Tensor],
        max_new: int,
        eos_id: int | Sequence[int],
        pad_id: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        greedy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample up to ``max_new`` tokens per prompt (stops at an ``eos_id``, which is kept: one id or
        several; ``greedy``: argmax). Returns right-padded ``[B, T]`` tokens and their log-probs under the
        temperature-scaled distribution, and the ``[B]`` lengths."""
        B = len(prompts)
        dev = self.device
        tokens = torch.nn.utils.rnn.pad_sequence(
            [p.long() for p in prompts], batch_first=True, padding_value=pad_id, padding_side="left"
        ).to(dev)
        plens = torch.tensor([len(p) for p in prompts], device=dev)
        mask = (torch.arange(tokens.shape[1], device=dev)[None, :] >= tokens.shape[1] - plens[:, None]).long()
        eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        lengths = torch.zeros(B, dtype=torch.int64, device=dev)
        out_tok, out_lp = [], []
        for _ in range(max_new):
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            last = self.logits(tokens, mask, pos)[:, -1, :].float()
            if greedy:
                nxt = last.argmax(-1)
                lp = torch.log_softmax(last, -1).gather(1, nxt[:, None])[:, 0]
            else:
                scaled = last / temperature
                logp = torch.log_softmax(scaled, -1)
                probs = logp.exp()
                if top_p < 1.0:
                    probs = _top_p(probs, top_p)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
                lp = logp.gather(1, nxt[:, None])[:, 0]
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            out_tok.append(nxt)
            out_lp.append(lp)
            lengths += (~done).long()
            ended = torch.isin(nxt, eos)
            done |= ended
            tokens = torch.cat([tokens, nxt[:, None]], 1)
            mask = torch.cat([mask, (~done | ended).long()[:, None]], 1)
            if bool(done.all()):
                break
        toks, lps = torch.stack(out_tok, 1), torch.stack(out_lp, 1)
        return toks, lps, lengths


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sp, idx = probs.sort(-1, descending=True)
    keep = sp.cumsum(-1) - sp < top_p
    sp = sp * keep
    return torch.zeros_like(probs).scatter(-1, idx, sp)
