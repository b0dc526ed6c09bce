"""Prompt data: records from local JSONL or Parquet files, a seeded held-out split, and a deterministic,
resumable loader of shuffled prompt batches.

A record is ``{"prompt": ..., "answer": str, "index": int}`` (plus ``data_source`` and ``extra_info`` when
the row has them); ``index`` is the record's 0-based position in its file, so a row can be traced back to
its source line. ``prompt`` is a string or a list of chat messages (``{"role", "content"}``).

verl's layout is read as it is: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model.ground_truth`` (the answer: found by the default ``data.answer_key``), ``extra_info``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from msrl_core.trainer.errors import DataError

Record = dict[str, Any]

#: File extensions :func:`load_prompts` reads, by format.
FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
#: Where the answer is looked for when ``data.answer_key`` is not set: this trainer's, then verl's.
ANSWER_KEYS = ("answer", "reward_model.ground_truth")
#: Row fields a record keeps for the reward function (verl's ``compute_score`` takes them).
PASSED_THROUGH = ("data_source", "extra_info")


def _lookup(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``; a dotted key reaches into nested mappings (verl's ``reward_model.ground_truth``)."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def _answer_key(row: Mapping[str, Any]) -> str:
    for key in ANSWER_KEYS:
        try:
            _lookup(row, key)
            return key
        except KeyError:
            continue
    return ANSWER_KEYS[0]  # reported as missing below


def _record(row: Any, where: str, index: int, prompt_key: str, answer_key: str | None) -> Record:
    if not isinstance(row, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    out: Record = {"index": index}
    if answer_key is None:
        answer_key = _answer_key(row)
    for name, key in (("prompt", prompt_key), ("answer", answer_key)):
        try:
            value = _lookup(row, key)
        except KeyError:
            raise DataError(
                f"{where}: no key {key!r} (data.{name}_key); keys present: {sorted(row)}"
            ) from None
        if value is None:
            raise DataError(f"{where}: key {key!r} is null")
        out[name] = value if name == "prompt" else str(value)
    for key in PASSED_THROUGH:
        if key in row:
            out[key] = row[key]
    prompt = out["prompt"]
    if not (
        isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, Mapping) for m in prompt))
    ):
        raise DataError(
            f"{where}: {prompt_key!r} must be a string or a list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    return out


def _read_jsonl(path: Path, prompt_key: str, answer_key: str | None) -> list[Record]:
    records: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: malformed JSON line ({exc.msg} at column {exc.colno})") from None
            records.append(_record(row, where, len(records), prompt_key, answer_key))
    return records


def _read_parquet(path: Path, prompt_key: str, answer_key: str | None) -> list[Record]:
    import pyarrow.parquet as pq  # optional dependency, only for Parquet input

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for corrupt files
        raise DataError(f"{path}: cannot read Parquet file: {exc}") from exc
    return [_record(row, f"{path}: row {i}", i, prompt_key, answer_key) for i, row in enumerate(rows)]


def load_prompts(
    path: str | os.PathLike[str], prompt_key: str = "prompt", answer_key: str | None = None
) -> list[Record]:
    """Read every record of a ``.jsonl`` (one JSON object per line) or ``.parquet`` file.

    ``answer_key`` None: the first of :data:`ANSWER_KEYS` the row has. Raises :class:`DataError` naming the
    path if it is missing or of an unknown type, the file and line of a malformed line, and the key and
    line of a missing ``prompt_key``/``answer_key``.
    """
    p = Path(path)
    kind = FORMATS.get(p.suffix.lower())
    if kind is None:
        raise DataError(f"{str(p)!r}: unknown prompt file type {p.suffix!r}; allowed: {', '.join(FORMATS)}")
    if not p.is_file():
        raise DataError(f"prompt file {str(p)!r} does not exist")
    records = (
        _read_jsonl(p, prompt_key, answer_key)
        if kind == "jsonl"
        else _read_parquet(p, prompt_key, answer_key)
    )
    if not records:
        raise DataError(f"prompt file {str(p)!r} holds no records")
    return records


def split(records: Sequence[Record], val_fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """Seeded held-out split: ``round(len * val_fraction)`` records (at least 1 when the fraction is > 0)
    go to validation, the rest to training, each in file order."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n = len(records)
    n_val = 0 if val_fraction == 0.0 else max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise DataError(
            f"{n} records cannot be split with val_fraction={val_fraction}: no training record left"
        )
    held = set(np.random.default_rng(seed).permutation(n)[:n_val].tolist())
    train = [r for i, r in enumerate(records) if i not in held]
    val = [r for i, r in enumerate(records) if i in held]
    return train, val


class PromptLoader:
    """Endless iterator over batches of ``batch_size`` records: each epoch is a fresh seeded permutation
    cut into whole batches (the incomplete tail is left out, GRPO needs full batches).

    The order depends only on ``seed`` and the epoch number, so ``state_dict()`` is two integers and a
    resumed loader yields exactly the batches an uninterrupted one would.
    """

    def __init__(self, records: Sequence[Record], batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(records) < batch_size:
            raise DataError(
                f"{len(records)} training records are fewer than one batch of "
                f"data.global_batch_size={batch_size}"
            )
        self.records = list(records)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.records) // self.batch_size

    def __iter__(self) -> Iterator[list[Record]]:
        return self

    def __next__(self) -> list[Record]:
        if self.batch_in_epoch == len(self):
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = self._permutation(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        batch = [self.records[i] for i in self._order[start : start + self.batch_size]]
        self.batch_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch (with the seed and sizes, to refuse a mismatched resume)."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state``; raises DataError if it was saved for other data, seed or batch size."""
        mine = self.state_dict()
        for key in ("seed", "batch_size", "num_records"):
            if key in state and state[key] != mine[key]:
                raise DataError(
                    f"loader state was saved with {key}={state[key]}, this run has {key}={mine[key]}"
                )
        epoch, pos = int(state["epoch"]), int(state["batch_in_epoch"])
        if epoch < 0 or not 0 <= pos <= len(self):
            raise DataError(
                f"loader state epoch={epoch}, batch_in_epoch={pos} is out of range (0..{len(self)})"
            )
        self.epoch, self.batch_in_epoch = epoch, pos
        self._order = self._permutation(epoch)


__all__ = ["FORMATS", "DataError", "PromptLoader", "Record", "load_prompts", "split"]
