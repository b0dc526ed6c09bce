"""A short supervised warm-up that teaches the answer *format* without solving the task.

Targets are answers drawn at random from the task's answer set, independent of the prompt, so after the
warm-up the policy writes a well-formed answer (digits, then ``<eos>``) whose value does not depend on the
prompt: it scores like a prompt-blind policy (about 1/number-of-answers), and the rise of the reward comes
from GRPO.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def format_warmup(
    engine: Any,
    tokenizer: Any,
    prompts: list[str],
    answer_set: list[str],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[float]:
    """Cross-entropy on ``prompt -> random answer from answer_set + <eos>`` (``engine``: the trainer's
    :class:`msrl_core.trainer.actor.Actor`, every replica a share of each batch); returns the losses."""
    if steps <= 0:
        return []
    rng = np.random.default_rng(seed)
    engine.init_optimizer(lr, 0.0)
    losses = []
    for _ in range(steps):
        pi = rng.integers(0, len(prompts), size=batch_size)
        ai = rng.integers(0, len(answer_set), size=batch_size)
        ps = [np.asarray(tokenizer.encode(prompts[i]), np.int64) for i in pi]
        rs = [np.asarray(tokenizer.encode_response(answer_set[j]) + [tokenizer.eos_id], np.int64) for j in ai]
        losses.append(engine.sft_step(ps, rs, tokenizer.pad_id))
    return losses
