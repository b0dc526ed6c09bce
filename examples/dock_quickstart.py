"""Transfer dock quickstart: one GRPO-like iteration through four stages (runs on a laptop in < 1 s).

python examples/dock_quickstart.py            # local backend (in-process)
python examples/dock_quickstart.py --ray      # Ray backend (starts a local Ray on loopback)
"""

import sys

import numpy as np

import msrl_core
from msrl_core import Column, Dock

backend = "ray" if "--ray" in sys.argv else "local"
if backend == "ray":
    import ray

    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, _node_ip_address="127.0.0.1")

dock = Dock(
    columns={
        "prompts": Column("int64", ragged=True),  # token ids, one length per row
        "responses": Column("int64", ragged=True),
        "ref_log_prob": Column("float32", ragged=True),
        "rewards": Column("float32"),  # one scalar per row, dense
    },
    stages={  # each stage reads these columns; a row is claimable once all of them are written
        "rollout": ["prompts"],
        "reference": ["prompts", "responses"],
        "reward": ["prompts", "responses"],
        "update": ["responses", "ref_log_prob", "rewards"],
    },
    capacity=16,  # rows per iteration = prompts x group_size
    group_size=4,  # the 4 responses of a prompt are one group: claimed together, stored together
    warehouses=2,
    backend=backend,
)

rng = np.random.default_rng(0)
prompts = [rng.integers(0, 1000, size=n) for n in (5, 7, 3, 9)]
dock.put({"prompts": [p for p in prompts for _ in range(4)]})  # 4 prompts x 4 samples, whole groups

# Rollout: claim metadata (row ids only), fetch the bytes, put the outputs back to the same rows.
meta = dock.claim("rollout", max_rows=8, timeout=1.0)
batch = dock.fetch(meta)  # batch["prompts"]: Ragged(values, offsets), no padding
dock.put({"responses": [np.arange(len(p) + 2) for p in batch["prompts"]]}, rows=meta)
rest = dock.take("rollout", max_rows=8)  # claim + fetch in one call
dock.put({"responses": [np.arange(3) for _ in rest["prompts"]]}, rows=rest)

# Reference and reward read the same columns independently; each sees every row exactly once.
ref = dock.take("reference", max_rows=16, timeout=1.0, min_rows=16)
lp = [np.full(len(r), -0.5, np.float32) for r in ref["responses"]]
dock.put({"ref_log_prob": lp}, rows=ref)
rew = dock.take("reward", max_rows=16, timeout=1.0, min_rows=16, layout="padded")  # Padded(values, lengths)
dock.put({"rewards": rew["responses"].mask.sum(axis=1).astype(np.float32)}, rows=rew)

update = dock.take("update", max_rows=16, timeout=1.0, min_rows=16)
print("update got", len(update.rows), "rows; rewards", update["rewards"].tolist()[:4], "...")
print("progress", {s: p["consumed_rows"] for s, p in dock.progress().items()})
assert all(p["consumed_rows"] == 16 for p in dock.progress().values())
dock.reset()  # next iteration
print(msrl_core.__version__, backend, "ok")
