"""Hugging Face checkpoints built in code for the model.path tests: a small Qwen2 with a byte-level BPE
tokenizer and a Qwen-style chat template, verl-format parquet files of an addition task and a verl-signature
reward (:func:`compute_score`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MAX_A, MAX_B = 4, 5


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def bpe_tokenizer(vocab_size: int = 320, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """A byte-level BPE tokenizer trained in code on the task's text, with Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [f"user\n{question(a, b)} assistant\n{a + b}" for a in range(10) for b in range(10)] * 3
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(corpus, trainer)
    kw: dict[str, Any] = {"chat_template": chat_template} if chat_template else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        **kw,
    )


def qwen2_section(vocab_size: int) -> Any:
    from msrl_core.trainer.config import ModelSection

    return ModelSection(
        arch="qwen2", vocab_size=vocab_size, hidden_size=32, ffn_hidden_size=64, num_layers=2,
        num_attention_heads=4, num_query_groups=2, max_position_embeddings=64, rope_theta=1e6,
        norm_epsilon=1e-6, tie_word_embeddings=False, make_vocab_size_divisible_by=8,
    )  # fmt: skip


def write_checkpoint(path: Path, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A fresh Qwen2 + BPE tokenizer + chat template + generation config as a checkpoint directory."""
    from msrl_core.trainer.hf_build import write_model_dir

    tok = bpe_tokenizer(chat_template=chat_template)
    return write_model_dir(path, qwen2_section(len(tok)), tok, seed=seed)


def verl_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = int(rng.integers(0, MAX_A + 1)), int(rng.integers(0, MAX_B + 1))
        rows.append(
            {
                "data_source": "arith",
                "prompt": [{"role": "user", "content": question(a, b)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_parquet(rows: list[dict], path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1 for the right number first in the response, else 0 (a dict with an extra)."""
    found = re.search(r"\d+", solution_str)
    right = float(found is not None and found.group() == ground_truth)
    return {"score": right, "has_number": float(found is not None)}


def greedy_eval(path: str, rows: list[dict], max_new_tokens: int) -> float:
    """The mean reward of transformers' own greedy decoding of the checkpoint at ``path`` (the independent
    evaluation the trainer's first validation must equal)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total = 0.0
    for r in rows:
        text = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        response = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        total += compute_score(r["data_source"], response, r["reward_model"]["ground_truth"])["score"]
    return total / len(rows)


def string_reward(data_source, solution_str, ground_truth, extra_info=None):
    """A broken reward: returns a string."""
    return "right"


def finetune(src: Path, out: Path, steps: int = 100, lr: float = 3e-3, seed: int = 0) -> Path:
    """A brief supervised fine-tune of the checkpoint at ``src`` on the task (chat prompt -> answer + eos),
    saved as a checkpoint directory at ``out``: with the defaults it is right part of the time (greedy
    accuracy about 0.5 on held-out prompts of the same pairs; sampled about 0.3)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    rows = verl_rows(200, seed=3)

    def example(r: dict) -> tuple[list[int], list[int]]:
        text = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        p = tok(text, add_special_tokens=False)["input_ids"]
        a = tok(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return p, a

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        seqs = [example(rows[i]) for i in torch.randint(0, len(rows), (32,), generator=g).tolist()]
        L = max(len(p) + len(a) for p, a in seqs)
        ids = torch.full((32, L), tok.pad_token_id)
        labels = torch.full((32, L), -100)
        att = torch.zeros((32, L), dtype=torch.long)
        for i, (p, a) in enumerate(seqs):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            att[i, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    shutil.copy(src / "generation_config.json", out / "generation_config.json")
    return out
