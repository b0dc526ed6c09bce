"""save_hf_checkpoint in one process (plain ``{name: tensor}`` shards of TP 1, no Megatron): a Hugging Face
directory transformers loads — the same logits as the source, the tokenizer, chat template and generation
config beside it — single file or sharded with an index that load_hf_checkpoint reads back; a failed save
leaves no shard behind."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from msrl_core.models import CheckpointError, ModelConfig, ShardLayout, load_hf_checkpoint, save_hf_checkpoint
from msrl_core.reshard import Parallel, to_hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def _source(tmp_path):
    import models_harness

    hf = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    model = models_harness.tiny_hf_model("qwen2", hf)
    path = str(tmp_path / "src")
    model.save_pretrained(path)
    return model, path


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abcdefgh ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = TEMPLATE
    return fast


def _loaded_shards(path, mc):
    sh = {n: torch.empty(s) for n, s in to_hf(mc, Parallel()).train_shapes(0).items()}
    load_hf_checkpoint(sh, path, ShardLayout(), config=mc)
    return sh


def test_save_writes_a_directory_transformers_loads(tmp_path):
    _, src = _source(tmp_path)
    mc = ModelConfig.from_pretrained(src)
    shards = _loaded_shards(src, mc)
    out = str(tmp_path / "out")
    gen = transformers.GenerationConfig(eos_token_id=1, pad_token_id=0, max_new_tokens=7)
    files = save_hf_checkpoint(shards, out, mc, Parallel(), {}, tokenizer=_tokenizer(), generation_config=gen)
    assert sorted(os.path.basename(f) for f in files) == ["config.json", "model.safetensors"]
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = []
    for p in (src, out):
        m = transformers.AutoModelForCausalLM.from_pretrained(p, attn_implementation="eager").eval()
        with torch.no_grad():
            logits.append(m(tokens).logits)
    assert torch.equal(logits[0], logits[1])
    assert ModelConfig.from_pretrained(out) == mc
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == TEMPLATE and tok.eos_token == "<eos>"
    assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 7
    assert not [f for f in os.listdir(out) if f.startswith(".msrl")]


def test_sharded_save_round_trips_through_the_index(tmp_path):
    _, src = _source(tmp_path)
    mc = ModelConfig.from_pretrained(src)
    shards = _loaded_shards(src, mc)
    out = str(tmp_path / "out")
    save_hf_checkpoint(shards, out, mc, Parallel(), {}, max_shard_bytes=20_000, bucket_bytes=8 << 10)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    files = sorted(set(wm.values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    again = _loaded_shards(out, mc)
    assert all(torch.equal(again[n], shards[n]) for n in shards)
    # saved again unsharded into the same directory: the stale index goes, model.safetensors is read
    save_hf_checkpoint(shards, out, mc, Parallel(), {})
    assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert all(torch.equal(_loaded_shards(out, mc)[n], shards[n]) for n in shards)


def test_a_bf16_save_says_bf16(tmp_path):
    _, src = _source(tmp_path)
    mc = ModelConfig.from_pretrained(src)
    shards = _loaded_shards(src, mc)
    out = str(tmp_path / "out")
    save_hf_checkpoint(shards, out, mc, Parallel(), {}, dtype=torch.bfloat16)
    back = ModelConfig.from_pretrained(out)
    assert back.dtype == "bfloat16" and back == dataclasses.replace(mc, dtype="bfloat16")
    sh = {n: torch.empty(s) for n, s in to_hf(mc, Parallel()).train_shapes(0).items()}
    load_hf_checkpoint(sh, out, ShardLayout(), config=mc)  # bf16 on disk, cast to the fp32 parameters
    for n in shards:
        assert torch.equal(sh[n], shards[n].to(torch.bfloat16).float()), n


def test_a_failed_save_leaves_no_shard(tmp_path):
    _, src = _source(tmp_path)
    mc = ModelConfig.from_pretrained(src)
    shards = _loaded_shards(src, mc)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").mkdir()  # config.json cannot be written
    with pytest.raises(CheckpointError, match="save_hf_checkpoint"):
        save_hf_checkpoint(shards, str(out), mc, Parallel(), {})
    assert sorted(os.listdir(out)) == ["config.json"]
