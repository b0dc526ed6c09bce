"""Device tensors through the native copy engine (put: device -> pinned staging; fetch(device=)).

No GPU here: CPU tensors stand in for device tensors (the device check is monkeypatched), so the engine
path runs for real but with host-to-host copies. Not run on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from msrl_core import Column, Dock
from msrl_core.dock import _device
from msrl_core.errors import InvalidArgument

torch = pytest.importorskip("torch")


def small_dock() -> Dock:
    return Dock(
        columns={
            "tokens": Column("int64", ragged=True, max_len=16),
            "hidden": Column("bfloat16", shape=(2,)),
        },
        stages={"train": ["tokens", "hidden"]},
        capacity=4,
        group_size=2,
    )


def engine_bytes() -> int:
    return _device.device_io().engine.stats()["bytes_other"]


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(_device, "is_device_tensor", lambda x: True)


def test_put_of_device_tensors_goes_through_the_engine(fake_device):
    dock = small_dock()
    hidden = torch.arange(4, dtype=torch.float32).reshape(2, 2).to(torch.bfloat16)
    tokens = [torch.arange(3), torch.arange(5) + 7]
    before = engine_bytes()
    rows = dock.put({"tokens": tokens, "hidden": hidden})
    assert engine_bytes() - before == 8 * 8 + 4 * 2  # every tensor staged by the engine
    batch = dock.fetch(rows, ["tokens", "hidden"], output="torch")
    assert batch["tokens"].values.tolist() == [0, 1, 2, 7, 8, 9, 10, 11]
    assert torch.equal(batch["hidden"], hidden)


def test_fetch_to_a_device_copies_through_the_engine():
    dock = small_dock()
    rows = dock.put(
        {"tokens": [np.arange(2), np.arange(4)], "hidden": np.arange(4, dtype=np.int16).reshape(2, 2)}
    )
    before = engine_bytes()
    batch = dock.fetch(rows, output="torch", device="cpu", columns=["tokens", "hidden"])
    assert engine_bytes() - before == 6 * 8 + 4 * 2
    assert batch["tokens"].values.tolist() == [0, 1, 0, 1, 2, 3]
    assert batch["tokens"].offsets.tolist() == [0, 2, 6]
    assert batch["hidden"].dtype == torch.bfloat16
    assert batch["hidden"].view(torch.int16).tolist() == [[0, 1], [2, 3]]
    padded = dock.fetch(rows, ["tokens"], layout="padded", output="torch", device="cpu")["tokens"]
    assert padded.values.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]
    assert padded.mask.tolist() == [[True, True, False, False], [True, True, True, True]]


def test_bad_device_requests_are_refused_before_claiming():
    dock = small_dock()
    dock.put({"tokens": [np.arange(2), np.arange(4)], "hidden": np.zeros((2, 2), np.int16)})
    with pytest.raises(InvalidArgument, match="output='torch'"):
        dock.take("train", max_rows=2, device="cpu", output="numpy")
    assert dock.progress()["train"]["consumed_rows"] == 0  # nothing claimed
    with pytest.raises(InvalidArgument, match="copy=False"):
        dock.fetch(np.arange(2), ["tokens"], output="torch", device="cpu", copy=False)
