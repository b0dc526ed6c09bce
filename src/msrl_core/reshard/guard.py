"""Read guard for swapped-out training parameters.

Between the switch and ``Swap.wait()`` a training parameter keeps its shape but its storage holds no bytes;
reading it (``p.sum()``, ``p.clone()``, a forward) would read freed memory: on the CPU that is a SIGSEGV.
While swapped out, every guarded tensor's class is a subclass of its own class whose ``__torch_function__``
raises :class:`SwapStateError` naming the parameter, for every torch function and method that would read
its data. Metadata stays readable (shape, dtype, device, ``untyped_storage()``, ``data_ptr()``, ``.grad``),
and ``isinstance(p, torch.nn.Parameter)`` still holds.

Limits: only the tensor objects the switch was given are guarded; other views of the same storage (a
flat buffer the parameters are views of) and C++ code that reads the data without going through Python
(a custom extension) are not.
"""

from __future__ import annotations

from typing import Any

from .errors import SwapStateError

_META_METHODS = frozenset(
    {"untyped_storage", "data_ptr", "size", "dim", "numel", "element_size", "is_contiguous", "stride"}
)
_META_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "grad_fn", "layout", "is_cuda"}
)


class ReadGuard:
    """Installs and removes the guard on a set of tensors; one per switch."""

    def __init__(self) -> None:
        self._orig: list[tuple[Any, type]] = []
        self._classes: dict[type, type] = {}
        self._names: dict[int, str] = {}

    def install(self, named: dict[str, Any]) -> None:
        seen: set[int] = set()
        for name, t in named.items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            cls = type(t)
            self._names[id(t)] = name
            try:
                t.__class__ = self._guarded(cls)
            except TypeError:  # a tensor subclass that refuses class assignment: left unguarded
                continue
            self._orig.append((t, cls))

    def remove(self) -> None:
        while self._orig:
            t, cls = self._orig.pop()
            t.__class__ = cls
        self._names.clear()

    def _name_in(self, args: Any, kwargs: Any) -> str:
        from torch.utils._pytree import tree_flatten

        for a in tree_flatten((args, kwargs))[0]:
            if id(a) in self._names:
                return self._names[id(a)]
        return "?"

    def _guarded(self, cls: type) -> type:
        guard = self

        def __torch_function__(c, func, types, args=(), kwargs=None):
            import torch

            fname = getattr(func, "__name__", "")
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if (
                fname in _META_METHODS
                or (fname == "__get__" and prop in _META_PROPERTIES)
                or (fname == "__set__" and prop == "grad")
            ):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
            what = f"{fname}" + (f" ({prop})" if prop else "")
            raise SwapStateError(
                f"{what} reads training parameter {guard._name_in(args, kwargs)!r}, which allgather_swap "
                "swapped out: its storage holds no bytes until swap.swap_back() and swap.wait()"
            )

        # one guarded subclass per original class and switch
        if cls not in self._classes:
            self._classes[cls] = type(
                f"SwappedOut{cls.__name__}", (cls,), {"__torch_function__": classmethod(__torch_function__)}
            )
        return self._classes[cls]
