"""Two simulated nodes, the same clients in the same places: the dock against the centralized buffer.

One Ray cluster of two raylets on this machine (`ray.cluster_utils.Cluster`; custom resources node_a on
the head, where the driver runs, and node_b) serves the whole run. Each repetition builds each system on
it, in rotating order (dock, central; central, dock; ...), runs the GRPO-shaped streaming workload of
bench/grpo_workload.py through it, verifies the data and tears it down:

  dock       the dock (Ray backend), one warehouse on each node; its controller where Ray puts it (reported)
  central    the centralized buffer (bench/central_buffer.py): one actor, pinned to node_a
  central-b  the same buffer pinned to node_b (optional, --systems dock,central,central-b)

Both systems get the SAME clients on the SAME nodes (grpo_workload.TWO_NODE_PLACEMENT): the driver (puts
the prompts) on node_a, rollout#1 / reference / update on node_a, rollout#2 / reward / critic on node_b.

The workers' outputs are functions of their inputs (not random pools), so every value can be checked:
responses of the prompt with id i (prompts[:, 0] == i) are i * 4096 + arange(len(i)), the log-probs and
values are fixed float32 multiples of the responses (exact in float32), the reward is i. After the timed
steps: every timed step's update stage saw every id exactly once, and one untimed step is read back in full
(all columns plus prompts) by the update worker and compared value for value.

Bytes across the node boundary are measured, not computed: a thread samples `ss -tinp` (the kernel's
tcp_info bytes_received per socket) during the timed steps; each process of the cluster is assigned to a node
by its raylet ancestry (the head's GCS and the driver: node_a); a socket's bytes count as cross-node when
its two endpoint processes belong to different nodes. Both raylets share this VM's memory and loopback:
these bytes travel through the kernel's loopback device, not a network, so they cost what a local TCP copy
costs, not what a NIC would. The dock's same-node traffic (Unix socket + shared memfd arenas) is not TCP
and not counted; same-node Ray calls are TCP over loopback and appear in the total, not in cross-node.

    python bench/dock_two_nodes.py [--systems dock,central] [--reps 3] [--steps 10] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_workload import (  # noqa: E402  (bench/ scripts import each other by path)
    _CLUSTERS,
    PROMPT_LEN,
    STAGE_INPUTS,
    TWO_NODE_PLACEMENT,
    WORKER_NAMES,
    CentralClient,
    DockClient,
    Worker,
    make_central,
    make_dock,
    pcts,
    start_two_nodes,
    stop_ray,
)

ID_STRIDE = 4096  # responses of prompt i: i * ID_STRIDE + arange(len): < 2**24, exact in float32
RESP_MIN, RESP_SPAN = 16, 2033  # lengths 16..2048, as in grpo_workload


# ---- deterministic outputs (the workers compute them; the verifier recomputes them) -----------------


def response_lengths(ids: np.ndarray) -> np.ndarray:
    return RESP_MIN + (ids.astype(np.int64) * 2654435761) % RESP_SPAN


def responses_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64)
    lens = response_lengths(ids)
    starts = np.cumsum(lens) - lens
    vals = np.repeat(ids * ID_STRIDE - starts, lens) + np.arange(int(lens.sum()), dtype=np.int64)
    return vals, lens


DERIVED = {  # column -> float32 function of the responses' values (exact in float32)
    "old_log_prob": lambda v: v.astype(np.float32) * np.float32(-1.0 / 1024),
    "ref_log_prob": lambda v: v.astype(np.float32) * np.float32(0.5),
    "values": lambda v: v.astype(np.float32) * np.float32(0.25),
}


def make_prompts(capacity: int) -> np.ndarray:
    prompts = np.random.default_rng(0).integers(0, 50000, size=(capacity, PROMPT_LEN), dtype=np.int64)
    prompts[:, 0] = np.arange(capacity)  # the prompt's id
    return prompts


class _Recording:
    """A client that remembers the ids (rewards) of every batch its stage fetched."""

    def __init__(self, client):
        self.client = client
        self.seen: list[np.ndarray] = []

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def fetch(self, h, fields: list[str]) -> dict:
        data = self.client.fetch(h, fields)
        if "rewards" in data:
            self.seen.append(np.asarray(data["rewards"]).astype(np.int64))
        return data


class CheckedWorker(Worker):
    """grpo_workload.Worker with outputs that are functions of the inputs, and a verifying read."""

    def __init__(self, client, stage: str, claim_n: int, seed: int):
        super().__init__(_Recording(client), stage, claim_n, seed)

    def _outputs(self, data: dict, k: int) -> dict:
        if self.stage == "rollout":
            vals, lens = responses_of(data["prompts"][:, 0])
            return {"responses": (vals, lens), "old_log_prob": (DERIVED["old_log_prob"](vals), lens)}
        vals, lens = data["responses"]
        if self.stage == "reward":
            return {"rewards": data["prompts"][:, 0].astype(np.float32)}
        col = "ref_log_prob" if self.stage == "reference" else "values"
        return {col: (DERIVED[col](vals), np.asarray(lens))}

    def probe(self, rounds: int) -> dict:
        """Uncontended (the stream stopped): `rounds` x (claim 64 ready rows as rollout, fetch the prompts,
        put the outputs), medians per op; for the dock also the median time per op spent in each of its
        client's internal calls (controller ops, same-node warehouse ops, far-warehouse Ray calls; the
        labels nest: a controller op from another node contains its Ray wait)."""
        spans: list[tuple[str, float]] = []
        backend = getattr(getattr(self.client.client, "dock", None), "_backend", None)
        if backend is not None:  # dock: time its client's calls (private names: a bench diagnostic)

            def timed(name: str, label):
                inner = getattr(backend, name)

                def wrapper(*a, **kw):
                    t0 = time.perf_counter()
                    try:
                        return inner(*a, **kw)
                    finally:
                        spans.append((label(*a), time.perf_counter() - t0))

                setattr(backend, name, wrapper)

            timed("_ctl", lambda op, *a: f"controller {op}")
            timed("_wh", lambda w, op, *a: f"same-node warehouse {op}")
            timed("_put_far", lambda inputs, rows, parts, *a: f"far put ({len(parts)} warehouse calls)")
            timed("_get", lambda refs, what, *a: f"ray.get {what.split()[0]}")
        ops: dict[str, list[float]] = {"claim": [], "fetch": [], "put": []}
        parts: dict[str, dict[str, list[float]]] = {op: {} for op in ops}
        try:
            for _ in range(rounds):
                for op in ops:
                    spans.clear()
                    t0 = time.perf_counter()
                    if op == "claim":
                        h = self.client.claim(self.stage, self.n, 5.0)
                        assert h is not None, "probe: no ready rows"
                    elif op == "fetch":
                        data = self.client.fetch(h, STAGE_INPUTS[self.stage])
                    else:
                        self.client.put(h, self._outputs(data, self.client.rows(h)))
                    ops[op].append(time.perf_counter() - t0)
                    sums: dict[str, float] = {}
                    for label, dt in spans:
                        sums[label] = sums.get(label, 0.0) + dt
                    for label in set(parts[op]) | set(sums):
                        parts[op].setdefault(label, [0.0] * (len(ops[op]) - 1)).append(sums.get(label, 0.0))
        finally:
            if backend is not None:
                for name in ("_ctl", "_wh", "_put_far", "_get"):
                    backend.__dict__.pop(name, None)

        def med_us(xs: list[float]) -> float:
            return round(statistics.median(xs) * 1e6, 1)

        return {
            op: {"p50_us": med_us(ts), "parts_p50_us": {k: med_us(v) for k, v in sorted(parts[op].items())}}
            for op, ts in ops.items()
        }

    def seen_ids(self) -> list[np.ndarray]:
        out, self.client.seen = self.client.seen, []
        return out

    def verify_rows(self, total: int, prompts: np.ndarray, timeout: float = 120.0) -> dict:
        """Claims `total` rows as this (update) stage and compares every column and the prompts with what
        the workers must have written. Returns counts; never raises on a mismatch (the driver reports)."""
        deadline = time.monotonic() + timeout
        fields = [*STAGE_INPUTS[self.stage], "prompts"]
        checked, bad, ids_all = 0, [], []
        while checked < total and time.monotonic() < deadline:
            h = self.client.claim(self.stage, self.n, 0.5)
            if h is None:
                continue
            d = self.client.fetch(h, fields)
            ids = np.asarray(d["rewards"]).astype(np.int64)
            ids_all.append(ids)
            vals, lens = responses_of(ids)
            if not np.array_equal(d["prompts"], prompts[ids]):
                bad.append("prompts")
            for col in ("responses", *DERIVED):
                got_v, got_l = d[col]
                want = vals if col == "responses" else DERIVED[col](vals)
                if not (np.array_equal(np.asarray(got_l), lens) and np.array_equal(got_v, want)):
                    bad.append(col)
            checked += self.client.rows(h)
        ids = np.sort(np.concatenate(ids_all)) if ids_all else np.array([], np.int64)
        return {
            "rows_checked": checked,
            "ids_exactly_once": bool(np.array_equal(ids, np.arange(total))),
            "mismatched_columns": sorted(set(bad)),
        }


# ---- cross-node TCP bytes (ss -tinp) -------------------------------------------------------------

_SS_HEAD = re.compile(r"^\S+\s+\S+\s+(\S+)\s+(\S+)\s+users:\((.*)\)\s*$")
_PID = re.compile(r"pid=(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


def ss_snapshot() -> dict[tuple[str, str], tuple[int, int]]:
    """(local, peer) -> (pid, bytes_received) of every established TCP socket the kernel shows us
    (received, not sent: tcp_info's bytes_sent counts retransmitted bytes too; a test on this loaded VM
    once read 3,014,875 sent for 3,000,000 received)."""
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, timeout=30
    ).stdout
    snap: dict[tuple[str, str], tuple[int, int]] = {}
    key = None
    for line in out.splitlines():
        if line and not line[0].isspace():
            m = _SS_HEAD.match(line)
            key = None
            if m and (pids := _PID.findall(m.group(3))):
                key = (m.group(1), m.group(2))
                snap[key] = (int(pids[0]), 0)
        elif key is not None:
            s = _RECEIVED.search(line)
            snap[key] = (snap[key][0], int(s.group(1)) if s else 0)
    return snap


class TcpTally:
    """Samples ss every `interval` s; per socket the bytes received between the first and the last sample
    (a socket first seen after the start counts from 0; one closed between samples loses its last
    interval)."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.first: dict | None = None  # None until the first sample (which may find no socket at all)
        self.last: dict = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        snap = ss_snapshot()
        if self.first is None:
            self.first = dict(snap)
        self.last.update(snap)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> TcpTally:
        self._sample()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self._sample()

    def deltas(self) -> list[tuple[int, int, int]]:
        """(sender pid or -1, receiver pid, bytes received in the window) per socket."""
        out = []
        for (loc, peer), (pid, got) in self.last.items():
            peer_pid = self.last.get((peer, loc), (-1, 0))[0]
            start = (self.first or {}).get((loc, peer), (pid, 0))[1]
            if got > start:
                out.append((peer_pid, pid, got - start))
        return out


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _kind(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            arg0 = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return "?"
    if arg0.startswith("ray::"):
        return "ray::" + arg0[5:].split(".")[0].split()[0]
    return os.path.basename(arg0.split()[0]) if arg0 else "?"


def process_nodes(cluster) -> dict[int, tuple[str, str]]:
    """pid -> (node label, process kind) for every live process of the cluster: a raylet's descendants
    belong to its node; the head's other processes and the driver to node_a."""
    from ray._private import ray_constants as rc

    anchor: dict[int, str] = {os.getpid(): "node_a"}
    for node in cluster.list_all_nodes():
        label = "node_a" if node is cluster.head_node else "node_b"
        for ptype, infos in node.all_processes.items():
            for info in infos:
                if info.process is not None and ptype != rc.PROCESS_TYPE_REAPER:
                    anchor[info.process.pid] = label
    raylets = {
        i.process.pid for n in cluster.list_all_nodes() for i in n.all_processes[rc.PROCESS_TYPE_RAYLET]
    }
    out: dict[int, tuple[str, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = p = int(name)
        try:
            while p > 1 and p not in raylets and p not in anchor:
                p = _ppid(p)
        except (OSError, IndexError, ValueError):
            continue
        if p in raylets or p in anchor:
            out[pid] = (anchor[p], _kind(pid))
    return out


def cross_node_bytes(tally: TcpTally, procs: dict[int, tuple[str, str]]) -> dict:
    total = cross = unknown = 0
    pairs: dict[str, int] = {}
    for peer, pid, sent in tally.deltas():
        if pid not in procs:
            continue  # not this cluster's socket
        total += sent
        if peer not in procs:
            unknown += sent
            continue
        (na, ka), (nb, kb) = procs[peer], procs[pid]  # sender, receiver
        if na != nb:
            cross += sent
            pair = f"{na}:{ka} -> {nb}:{kb}"
            pairs[pair] = pairs.get(pair, 0) + sent
    top = dict(sorted(pairs.items(), key=lambda kv: -kv[1])[:8])
    return {
        "tcp_bytes_cross_node": cross,
        "tcp_bytes_all_cluster": total,
        "tcp_bytes_peer_unknown": unknown,
        "cross_node_top_pairs": top,
    }


# ---- one system, one repetition ------------------------------------------------------------------


CENTRAL_NODE = {"central": "node_a", "central-b": "node_b"}  # where the buffer's one actor runs
SYSTEMS = ("dock", *CENTRAL_NODE)


def build(system: str, capacity: int, group: int):
    if system == "dock":
        dock = make_dock(capacity, group)
        return DockClient(dock), dock.shutdown
    if system in CENTRAL_NODE:
        import ray

        h = make_central(capacity, group, resources={CENTRAL_NODE[system]: 0.01})
        return CentralClient(h), (lambda: ray.kill(h))
    raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")


def placement(system: str, workers: dict[int, Any]) -> dict:
    import ray
    from ray._private import state

    label = {
        n["NodeID"]: next((k for k in n["Resources"] if k in ("node_a", "node_b")), n["NodeID"][:8])
        for n in ray.nodes()
        if n.get("Alive")
    }
    actors: dict[str, list[str]] = {}
    for a in state.actors().values():
        cls = a.get("ActorClassName", "")
        if a.get("State") == "ALIVE" and cls in ("ControllerActor", "WarehouseActor", "CentralBuffer"):
            actors.setdefault(cls, []).append(label.get(a.get("Address", {}).get("NodeID"), "?"))
    where = dict(zip(workers, ray.get([w.where.remote() for w in workers.values()], timeout=120)))
    clients = {"driver": "node_a"} | {WORKER_NAMES[k]: label.get(v["node"], "?") for k, v in where.items()}
    return {
        "actors": {k: sorted(v) for k, v in actors.items()},
        "clients": clients,
        "data_via_shared_arenas": {WORKER_NAMES[k]: v.get("data_via_shared_arenas") for k, v in where.items()}
        if system == "dock"
        else None,
    }


def run_once(system: str, args, cluster, rep: int) -> dict:
    import ray

    P, G = args.prompts, args.group
    capacity = P * G
    client, shutdown = build(system, capacity, G)
    by_seed: dict[int, Any] = {}

    def worker(stage: str, n: int, seed: int):
        opts = {"num_cpus": 0.05, "max_concurrency": 2, "resources": {TWO_NODE_PLACEMENT[seed]: 0.01}}
        by_seed[seed] = ray.remote(CheckedWorker).options(**opts).remote(client, stage, n, seed)
        return by_seed[seed]

    stream = [
        worker("rollout", 64, 1),
        worker("rollout", 64, 2),
        worker("reference", 64, 3),
        worker("reward", 64, 4),
        worker("critic", 64, 5),
    ]
    update = worker("update", 256, 6)
    try:
        ray.get([w.report.remote() for w in [*stream, update]], timeout=300)
        where = placement(system, by_seed)
        prompts = make_prompts(capacity)
        loops = [w.loop.remote() for w in stream]
        for _ in range(args.warmup):  # untimed
            client.put_prompts(prompts)
            ray.get(update.run_rows.remote(capacity), timeout=600)
            client.reset()
        ray.get(update.seen_ids.remote(), timeout=60)
        base = ray.get([w.report.remote() for w in [*stream, update]], timeout=60)
        load0 = os.getloadavg()
        with TcpTally(args.ss_interval) as tally:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                client.put_prompts(prompts)
                ray.get(update.run_rows.remote(capacity), timeout=1200)
                client.reset()
            wall = time.perf_counter() - t0
        load1 = os.getloadavg()
        procs = process_nodes(cluster)
        timed = ray.get([w.report.remote() for w in [*stream, update]], timeout=60)
        # -- after timing: exactly once per timed step, then one step read back in full --
        seen = ray.get(update.seen_ids.remote(), timeout=60)
        ids = np.concatenate(seen) if seen else np.array([], np.int64)
        steps_exact = len(ids) == capacity * args.steps and all(
            np.array_equal(np.sort(ids[s * capacity : (s + 1) * capacity]), np.arange(capacity))
            for s in range(args.steps)
        )
        client.put_prompts(prompts)
        ver = ray.get(update.verify_rows.remote(capacity, prompts), timeout=300)
        client.reset()
        for w in stream:
            w.stop.remote()
        ray.get(loops, timeout=120)
        probe = {}
        if args.probe_rounds:  # one rollout worker on each node, alone: fixed costs of each op
            for w, node in ((stream[0], "node_a"), (stream[1], "node_b")):
                client.put_prompts(prompts)
                probe[node] = ray.get(w.probe.remote(args.probe_rounds), timeout=300)
                client.reset()
    finally:
        for h in by_seed.values():
            ray.kill(h)
        shutdown()
    # operation times and bytes of the timed steps only (reports after them minus those before; a stream
    # worker's op that straddles the end of the last timed step may count: at most one per worker)
    ops = ("claim", "fetch", "put")
    window = {
        seed: {op: r["t"][op][len(b["t"][op]) :] for op in ops} for seed, r, b in zip(by_seed, timed, base)
    }
    times = {op: sum((w[op] for w in window.values()), []) for op in ops}
    by_node_p50 = {
        node: {
            op: pcts(sum((w[op] for s, w in window.items() if TWO_NODE_PLACEMENT[s] == node), []))["p50_us"]
            for op in ops
        }
        for node in ("node_a", "node_b")
    }
    net = cross_node_bytes(tally, procs)
    by_node = {"node_a": prompts.nbytes * args.steps, "node_b": 0}  # the driver's prompt puts: node_a
    for seed, r, b in zip(by_seed, timed, base):  # by_seed is in the order of [*stream, update]
        by_node[TWO_NODE_PLACEMENT[seed]] += r["bytes"] - b["bytes"]
    return {
        "case": "two_nodes_grpo",
        "system": system,
        "rep": rep,
        "steps": args.steps,
        "rows_per_step": capacity,
        "wall_s": round(wall, 3),
        "samples_per_s": round(capacity * args.steps / wall, 1),
        "payload_bytes_moved": int(sum(by_node.values())),
        "payload_bytes_by_client_node": by_node,
        **net,
        "cross_node_bytes_per_sample": round(net["tcp_bytes_cross_node"] / (capacity * args.steps), 1),
        "claim": pcts(times["claim"]),
        "fetch": pcts(times["fetch"]),
        "put": pcts(times["put"]),
        "p50_us_by_client_node": by_node_p50,
        "uncontended_by_client_node": probe,
        "verified": {"timed_steps_exactly_once": bool(steps_exact), **ver},
        "placement": where,
        "loadavg_1m_before_after": [round(load0[0], 2), round(load1[0], 2)],
    }


def summarize(rows: list[dict]) -> dict:
    by = {s: [r for r in rows if r["system"] == s] for s in SYSTEMS}
    med = {s: statistics.median(r["samples_per_s"] for r in rs) for s, rs in by.items() if rs}
    xb = {s: statistics.median(r["tcp_bytes_cross_node"] for r in rs) for s, rs in by.items() if rs}
    dock_by_rep = {r["rep"]: r["samples_per_s"] for r in by["dock"]}
    ratios: dict[str, dict] = {}
    for c in CENTRAL_NODE:
        if "dock" in med and c in med:
            ratios[c] = {
                "dock_over_it_samples_per_s": round(med["dock"] / med[c], 3),
                "per_rep": [
                    round(dock_by_rep[r["rep"]] / r["samples_per_s"], 3)
                    for r in sorted(by[c], key=lambda r: r["rep"])
                    if r["rep"] in dock_by_rep
                ],
                "dock_over_it_cross_node_bytes": round(xb["dock"] / xb[c], 3) if xb[c] else None,
            }
    ok = all(
        r["verified"]["timed_steps_exactly_once"]
        and r["verified"]["ids_exactly_once"]
        and not r["verified"]["mismatched_columns"]
        for r in rows
    )
    return {
        "case": "two_nodes_summary",
        "runs": {s: len(rs) for s, rs in by.items()},
        "samples_per_s_median": med,
        "tcp_bytes_cross_node_median": xb,
        "ratios": ratios,
        "all_verified": ok,
        "statistic": "median over repetitions of samples/s (rows through update / wall of the timed steps)",
    }


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=10,
        ).stdout.strip()
    except Exception:
        return "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--systems",
        default="dock,central",
        help=f"comma-separated, from {','.join(SYSTEMS)} (central-b: the buffer's actor on node_b)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--ss-interval", type=float, default=1.0)
    ap.add_argument(
        "--probe-rounds", type=int, default=12, help="uncontended ops per node after the stream (0: none)"
    )
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    for name in ("reps", "steps", "prompts", "group"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.probe_rounds * 64 > args.prompts * args.group:
        ap.error(
            f"--probe-rounds x 64 rows must fit in one step's {args.prompts * args.group} rows, "
            f"got {args.probe_rounds}"
        )
    systems = args.systems.split(",")
    if not systems or any(s not in SYSTEMS for s in systems) or len(set(systems)) != len(systems):
        ap.error(f"--systems must name distinct systems from {', '.join(SYSTEMS)}, got {args.systems!r}")
    if args.warmup < 0 or args.probe_rounds < 0 or args.ss_interval <= 0:
        ap.error(
            "--warmup and --probe-rounds must be >= 0 and --ss-interval > 0, got "
            f"{args.warmup}, {args.probe_rounds}, {args.ss_interval}"
        )
    import json

    import ray

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(line + "\n")

    emit(
        {
            "case": "two_nodes_env",
            "commit": commit(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
            "ray": ray.__version__,
            "numpy": np.__version__,
            "python": sys.version.split()[0],
            "args": vars(args),
            "note": "two raylets on one VM: shared memory and loopback; cross-node bytes pay no network",
        }
    )
    rows: list[dict] = []
    start_two_nodes(os.cpu_count() or 2)
    cluster = _CLUSTERS[0]
    try:
        for rep in range(args.reps):
            k = rep % len(systems)  # rotate the order: each system runs first in turn
            order = systems[k:] + systems[:k]
            for system in order:
                try:
                    row = run_once(system, args, cluster, rep)
                except Exception as e:  # report and go on: the other runs still count
                    emit(
                        {
                            "case": "two_nodes_grpo",
                            "system": system,
                            "rep": rep,
                            "error": f"{type(e).__name__}: {e}",
                        }
                    )
                    continue
                rows.append(row)
                emit(row)
        emit(summarize(rows))
    finally:
        stop_ray()


if __name__ == "__main__":
    main()
