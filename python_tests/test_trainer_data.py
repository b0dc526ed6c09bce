"""Prompt data: JSONL/Parquet records, errors naming file, line and key, the seeded split and the
deterministic, resumable batch loader."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from msrl_core.errors import MsrlError
from msrl_core.trainer.data import DataError, PromptLoader, load_prompts, split


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_records(tmp_path):
    p = write_jsonl(
        tmp_path / "p.jsonl",
        [{"q": "1+1=", "a": 2, "x": 0}, "", {"q": [{"role": "user", "content": "hi"}], "a": "ok"}],
    )
    recs = load_prompts(p, "q", "a")
    assert recs == [
        {"index": 0, "prompt": "1+1=", "answer": "2"},
        {"index": 1, "prompt": [{"role": "user", "content": "hi"}], "answer": "ok"},
    ]


def test_nested_answer_key_and_parquet(tmp_path):
    rows = [{"prompt": f"p{i}", "reward_model": {"ground_truth": str(i)}} for i in range(3)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    recs = load_prompts(path, "prompt", "reward_model.ground_truth")
    assert [(r["prompt"], r["answer"], r["index"]) for r in recs] == [
        ("p0", "0", 0),
        ("p1", "1", 1),
        ("p2", "2", 2),
    ]
    with pytest.raises(DataError, match=r"d.parquet: row 0: no key 'answer'"):
        load_prompts(path, "prompt", "answer")


def test_malformed_line_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": 1}, "", '{"prompt": "b", "answer": '])
    with pytest.raises(DataError, match=r"bad.jsonl:3: malformed JSON line") as info:
        load_prompts(p)
    assert isinstance(info.value, MsrlError) and isinstance(info.value, ValueError)


def test_missing_key_names_key_and_line(tmp_path):
    p = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b", "solution": 2}])
    with pytest.raises(DataError, match=r"k.jsonl:2: no key 'answer' \(data.answer_key\); keys present"):
        load_prompts(p)
    p2 = write_jsonl(tmp_path / "n.jsonl", [[1, 2]])
    with pytest.raises(DataError, match=r"n.jsonl:1: expected a JSON object, got list"):
        load_prompts(p2)
    p3 = write_jsonl(tmp_path / "t.jsonl", [{"prompt": 5, "answer": 1}])
    with pytest.raises(DataError, match=r"t.jsonl:1: 'prompt' must be a string"):
        load_prompts(p3)


def test_missing_file_empty_file_and_unknown_type(tmp_path):
    with pytest.raises(DataError, match=r"prompt file '.*nope.jsonl' does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"unknown prompt file type '.csv'; allowed: .jsonl, .parquet"):
        load_prompts(tmp_path / "x.csv")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no records"):
        load_prompts(tmp_path / "e.jsonl")


def _records(n):
    return [{"index": i, "prompt": f"p{i}", "answer": str(i)} for i in range(n)]


def test_split_sizes_determinism_and_disjointness():
    recs = _records(20)
    train, val = split(recs, 0.25, seed=3)
    assert len(val) == 5 and len(train) == 15
    assert sorted(r["index"] for r in train + val) == list(range(20))
    assert split(recs, 0.25, seed=3) == (train, val)
    assert split(recs, 0.25, seed=4)[1] != val
    assert split(recs, 0.0, seed=3) == (recs, [])
    assert len(split(_records(3), 0.01, seed=0)[1]) == 1  # a positive fraction keeps at least one
    with pytest.raises(DataError, match="no training record left"):
        split(_records(1), 0.5, seed=0)
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        split(recs, 1.0, seed=0)


def test_loader_epochs_cover_records_once_and_reshuffle():
    loader = PromptLoader(_records(10), batch_size=3, seed=5)
    assert len(loader) == 3  # the tail of 1 is left out each epoch
    epoch0 = [next(loader) for _ in range(3)]
    epoch1 = [next(loader) for _ in range(3)]
    seen0 = [r["index"] for b in epoch0 for r in b]
    assert len(set(seen0)) == 9 and all(len(b) == 3 for b in epoch0)
    assert [r["index"] for b in epoch1 for r in b] != seen0
    again = PromptLoader(_records(10), batch_size=3, seed=5)
    assert [next(again) for _ in range(6)] == epoch0 + epoch1


def test_loader_resume_reproduces_the_uninterrupted_sequence():
    full = PromptLoader(_records(7), batch_size=2, seed=1)
    expected = [next(full) for _ in range(8)]
    first = PromptLoader(_records(7), batch_size=2, seed=1)
    head = [next(first) for _ in range(5)]  # stops inside epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptLoader(_records(7), batch_size=2, seed=1)
    resumed.load_state_dict(state)
    assert head + [next(resumed) for _ in range(3)] == expected


def test_loader_bad_input():
    with pytest.raises(DataError, match="fewer than one batch of data.global_batch_size=4"):
        PromptLoader(_records(3), batch_size=4, seed=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptLoader(_records(3), batch_size=0, seed=0)
    loader = PromptLoader(_records(4), batch_size=2, seed=0)
    with pytest.raises(DataError, match="seed=9, this run has seed=0"):
        loader.load_state_dict({**loader.state_dict(), "seed": 9})
    with pytest.raises(DataError, match="out of range"):
        loader.load_state_dict({**loader.state_dict(), "batch_in_epoch": 5})
    assert loader.state_dict()["batch_in_epoch"] == 0  # state unchanged after the refused load


def test_verl_parquet_layout_is_read_as_it_is(tmp_path):
    """verl's layout (data_source, prompt as chat messages, ability, reward_model.ground_truth, extra_info)
    with the default data keys: the answer is the ground truth, data_source and extra_info are kept."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i}+1? Answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(3)
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    recs = load_prompts(path)
    assert [r["answer"] for r in recs] == ["1", "2", "3"]
    assert recs[1]["prompt"] == [{"role": "user", "content": "What is 1+1? Answer after ####."}]
    assert recs[2]["data_source"] == "openai/gsm8k" and recs[2]["extra_info"] == {
        "split": "train",
        "index": 2,
    }
