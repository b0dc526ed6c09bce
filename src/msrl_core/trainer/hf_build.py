"""Hugging Face model directories built in code: what the demo trains from (``model.path``), so the demo
runs the path users run.

- :func:`char_tokenizer`: the demo's character vocabulary (``msrl_core.trainer.task.CharTokenizer``: the same
  ids) as a ``PreTrainedTokenizerFast`` with a Jinja chat template;
- :func:`write_model_dir`: a seeded, freshly initialised transformers model of a model section, its
  tokenizer and ``generation_config.json``, written as a checkpoint directory transformers loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The demo's chat template: the messages' contents after a BOS (the task needs no roles).
CHAR_CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def char_tokenizer(chars: str | None = None) -> Any:
    """The character tokenizer of the demo task as a ``PreTrainedTokenizerFast``: one token per character,
    ``<pad>`` 0, ``<bos>`` 1 (added before a plain prompt), ``<eos>`` 2, and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from msrl_core.trainer.task import CHARS, SPECIALS

    itos = list(SPECIALS) + list(CHARS if chars is None else chars)
    tk = Tokenizer(models.WordLevel({s: i for i, s in enumerate(itos)}, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        chat_template=CHAR_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def token_ids(tokenizer: Any) -> dict[str, Any]:
    """``bos/eos/pad_token_id`` of a transformers tokenizer or of the trainer's
    :class:`~msrl_core.trainer.tokenizer.Tokenizer` (its eos ids from the generation config too)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    eos = list(getattr(tokenizer, "eos_ids", [hf.eos_token_id]))
    return {
        "bos_token_id": hf.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": getattr(tokenizer, "pad_id", hf.pad_token_id),
    }


def checkpoint_config(model: Any, tokenizer: Any) -> Any:
    """The ``config.json`` of a checkpoint of the model section ``model`` (the one model description, with
    the tokenizer's token ids)."""
    from msrl_core.models import hf_config
    from msrl_core.trainer.config import model_config

    ids = token_ids(tokenizer) if hasattr(getattr(tokenizer, "hf", tokenizer), "save_pretrained") else {}
    return hf_config(model_config(model), **ids)


def save_tokenizer(out: Path, tokenizer: Any) -> None:
    """The tokenizer (with its chat template) and a ``generation_config.json`` of its token ids."""
    from transformers import GenerationConfig

    getattr(tokenizer, "hf", tokenizer).save_pretrained(str(out))
    GenerationConfig(**token_ids(tokenizer)).save_pretrained(str(out))


def write_model_dir(path: str | Path, model: Any, tokenizer: Any, seed: int) -> Path:
    """A checkpoint directory of the model section ``model``: weights initialised by transformers (seeded),
    ``config.json`` (the one model description with the tokenizer's token ids), the tokenizer and
    ``generation_config.json``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = checkpoint_config(model, tokenizer)
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, model.dtype))
    net.save_pretrained(str(out))
    save_tokenizer(out, tokenizer)
    return out
