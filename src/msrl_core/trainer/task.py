"""The demo's verifiable task and tokenizer, built in code (no hub downloads).

Task: ``"a+b="`` with ``a`` in ``[0, max_a]`` and ``b`` in ``[0, max_b]``; the answer is ``a+b`` in
decimal. The answer depends on the prompt: with the default ranges (0..4, 0..5) the most frequent sum covers
5 of the 30 operand pairs, so a constant answer scores at most 1/6 (``constant_answer_score``).

Tokenizer: one token per character of ``0-9 + - * =``, plus ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence

import numpy as np

SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789+-*= "


class CharTokenizer:
    """Character-level tokenizer: ``encode("3+4=")`` -> ``[bos, '3', '+', '4', '=']``."""

    def __init__(self, chars: str = CHARS) -> None:
        self.itos = list(SPECIALS) + list(chars)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = (self.eos_id,)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError("the built-in character tokenizer takes plain-string prompts, not chat messages")
        bad = sorted({ch for ch in text if ch not in self.stoi})
        if bad:
            raise ValueError(
                f"characters {bad} are not in the tokenizer's alphabet {''.join(self.itos[3:])!r}"
            )
        return ([self.bos_id] if bos else []) + [self.stoi[ch] for ch in text]

    def encode_response(self, text: str) -> list[int]:
        return self.encode(text, bos=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first ``<eos>``; specials dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                out.append(self.itos[i])
        return "".join(out)


def arithmetic_records(n: int, max_a: int, max_b: int, seed: int) -> list[dict[str, str]]:
    """``n`` records ``{"prompt": "a+b=", "answer": "a+b"}`` with operands drawn uniformly."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, max_a + 1, size=n)
    b = rng.integers(0, max_b + 1, size=n)
    return [{"prompt": f"{x}+{y}=", "answer": str(x + y)} for x, y in zip(a.tolist(), b.tolist())]


def constant_answer_score(max_a: int, max_b: int) -> float:
    """Best exact-match score of a policy that ignores the prompt (always the most frequent sum)."""
    sums = Counter(x + y for x in range(max_a + 1) for y in range(max_b + 1))
    return max(sums.values()) / ((max_a + 1) * (max_b + 1))


def write_jsonl(records: list[dict[str, str]], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path
