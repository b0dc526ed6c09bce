"""The run's tokenizer: the checkpoint's own (``AutoTokenizer`` of ``model.path``), its chat template, and
the end-of-sequence and padding ids from the tokenizer and ``generation_config.json``.

A prompt is a string (tokenized as it is, with the tokenizer's own special tokens, e.g. Llama's BOS) or a
list of chat messages, rendered with the tokenizer's chat template (``add_generation_prompt=True``) and
tokenized without adding special tokens again (the template writes them), as verl does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from msrl_core.trainer.errors import ConfigError, DataError


class Tokenizer:
    """A Hugging Face tokenizer with what the trainer needs: ``encode(prompt)``, ``decode(ids)``,
    ``eos_ids`` (every id that ends a response), ``eos_id`` (the first), ``pad_id``, ``vocab_size``."""

    def __init__(self, hf: Any, generation_config: Any = None) -> None:
        self.hf = hf
        eos: list[int] = []
        gen_eos = getattr(generation_config, "eos_token_id", None)
        for e in [*(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]), hf.eos_token_id]:
            if e is not None and int(e) not in eos:
                eos.append(int(e))
        if not eos:
            raise ConfigError(
                "the tokenizer has no eos_token_id and generation_config.json gives none: a response could "
                "never end; set eos_token in the tokenizer or eos_token_id in generation_config.json"
            )
        self.eos_ids: tuple[int, ...] = tuple(eos)
        self.eos_id = eos[0]
        pad = hf.pad_token_id
        if pad is None:
            pad = getattr(generation_config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(hf)

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """The tokenizer and generation config of the checkpoint directory ``path``."""
        from transformers import AutoTokenizer, GenerationConfig

        try:
            hf = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # OSError / ValueError: no tokenizer files
            raise ConfigError(
                f"model.path={path!r}: cannot load its tokenizer ({type(e).__name__}: {e})"
            ) from None
        try:
            gen = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: the tokenizer's eos alone
            gen = None
        return cls(hf, gen)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render(self, prompt: Any) -> str:
        """The text the model sees for ``prompt`` (chat messages through the chat template)."""
        if isinstance(prompt, str):
            return prompt
        if not self.has_chat_template:
            raise DataError(
                "the prompt is a list of chat messages but the tokenizer has no chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja); give plain-string prompts "
                "or a tokenizer with a chat template"
            )
        return str(self.hf.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False))

    def encode(self, prompt: Any) -> list[int]:
        """Token ids of ``prompt`` (a string, or chat messages)."""
        text = self.render(prompt)
        ids = self.hf(text, add_special_tokens=isinstance(prompt, str))["input_ids"]
        return [int(i) for i in ids]

    def encode_response(self, text: str) -> list[int]:
        """Token ids of a response text (no special tokens added)."""
        return [int(i) for i in self.hf(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        """The response text: tokens up to the first end-of-sequence id, special tokens dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i in self.eos_ids:
                break
            out.append(i)
        return str(self.hf.decode(out, skip_special_tokens=True))
