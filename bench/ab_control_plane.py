"""The Ray controller actor's control plane in-process, without the wire: claim of 64 rows among 16,384
ready and a put of 16,384 new rows (allocate + publish), for A/B runs across the commit that moved it
into the native DockCore.

Up to de7e8d5 ControllerState was Python (row allocator, put registry) over per-stage native
Controllers; since then it hosts a metadata-only DockCore. This script drives either (the constructor
and publish arguments differ), so one command measures both trees in one session:

  for t in OLD_TREE NEW_TREE OLD_TREE NEW_TREE; do PYTHONPATH=$t/src python bench/ab_control_plane.py; done
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from msrl_core.dock._actors import ControllerState

ROWS, CLAIM, FILLS = 16384, 64, 20

if hasattr(ControllerState, "layout"):  # the DockCore-hosting ControllerState (columns, stages, ...)
    st = ControllerState([("p", "int64", False, [], 0)], [("s", ["p"], "")], ROWS, 4, 1)

    def begin(n: int) -> tuple[np.ndarray, int]:
        rows, put_id, _ = st.allocate(n)
        return rows, put_id

    def publish(rows: np.ndarray, put_id: int) -> None:
        st.mark_ready([(0, None)], rows, -1, 0, put_id)

    def reset() -> None:
        st.reset(False, False, 10.0)  # no warehouse actors attached

    tree = "dockcore"
else:  # de7e8d5 and before: (stage, column ids) list, capacity, group, warehouses, length column
    st = ControllerState([("s", [0])], ROWS, 4, 1, -1)  # type: ignore[call-arg]

    def begin(n: int) -> tuple[np.ndarray, int]:
        return st.allocate(n)  # type: ignore[return-value]

    def publish(rows: np.ndarray, put_id: int) -> None:
        st.mark_ready([0], rows, None, -1, 0, put_id)  # type: ignore[arg-type]

    def reset() -> None:
        st.reset(False, False, [], 10.0)  # type: ignore[call-arg]

    tree = "python-allocator"

claims, puts = [], []
for _ in range(FILLS):
    t = time.perf_counter()
    rows, put_id = begin(ROWS)
    publish(rows, put_id)
    puts.append(time.perf_counter() - t)
    for _ in range(ROWS // CLAIM):
        t = time.perf_counter()
        got = st.claim(0, CLAIM, CLAIM, 0.0)
        claims.append(time.perf_counter() - t)
        assert len(got[0]) == CLAIM
    reset()
print(
    json.dumps(
        {
            "case": "control_plane",
            "tree": tree,
            "pythonpath": os.environ.get("PYTHONPATH", ""),
            "claim_p50_us": round(float(np.median(claims)) * 1e6, 2),
            "put_16k_rows_p50_us": round(float(np.median(puts)) * 1e6, 1),
        }
    )
)
