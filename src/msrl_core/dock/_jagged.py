"""Jagged tensors in and out of the dock: torch NestedTensors (jagged layout) and TensorDicts.

In: a ``torch.jagged`` NestedTensor ``[n, j, *inner]`` becomes the dock's ragged column input
``(values [total, *inner], lengths [n])`` — its own ``values()`` without a copy when the rows are back
to back, one vectorised gather when they are not (a NestedTensor made by ``narrow``). A TensorDict with
batch size ``[n]`` becomes ``{column: value}``: dense tensors as they are, jagged NestedTensors as
``Ragged``, nested TensorDicts flattened (``"a.b"``), ``NonTensorStack`` / ``NonTensorData`` as
``ObjectValues`` (a numpy object array, one Python value per row, for an object column).

Out: ragged rows as ``Ragged`` (packed), ``Padded`` (values + lengths, with ``mask``) or a jagged
NestedTensor over the fetched values (no copy); columns back into a TensorDict (NestedTensor or padded +
``<name>_mask`` for ragged columns, ``NonTensorStack`` for object columns, nested keys unflattened).

A strided NestedTensor (``torch.nested.nested_tensor(rows)`` without ``layout=torch.jagged``) is
refused with InvalidArgument naming the column and what is allowed. Works with tensordict 0.10.0 and
later (only ``TensorDict``, ``NonTensorData``, ``NonTensorStack``, ``is_tensor_collection``,
``is_non_tensor`` and ``tolist()`` are used). No per-row Python loops except over object values.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from msrl_core.dock._types import Padded, Ragged, is_torch_tensor
from msrl_core.errors import InvalidArgument

ALLOWED_RAGGED = (
    "a torch.jagged NestedTensor (torch.nested.nested_tensor(rows, layout=torch.jagged) or "
    "torch.nested.nested_tensor_from_jagged(values, offsets)), a list of per-row tensors, a Ragged, "
    "or (values, offsets)"
)
LAYOUTS = ("packed", "padded", "nested")


class ObjectValues(np.ndarray):
    """One Python value per row: the values of an object column (from a NonTensorStack/NonTensorData).
    A 1-D numpy object array, like verl's ``non_tensor_batch`` entries, so that the dock declares an
    object column for it whatever the values are (a list of ints would declare an int64 column)."""

    @classmethod
    def of(cls, values: Any) -> ObjectValues:
        arr = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):  # item by item: np.array would stack equal-length list values
            arr[i] = v
        return arr.view(cls)


def _torch() -> Any:
    import torch

    return torch


def is_nested(x: Any) -> bool:
    return is_torch_tensor(x) and bool(getattr(x, "is_nested", False))


def from_nested(nt: Any, name: str = "column") -> tuple[Any, np.ndarray]:
    """A jagged NestedTensor ``[n, j, *inner]`` -> (values ``[total, *inner]`` torch tensor, lengths
    int64 numpy ``[n]``). Zero-copy when the rows are contiguous from offset 0."""
    torch = _torch()
    if not is_nested(nt):
        raise InvalidArgument(f"column '{name}': expected a NestedTensor, got {type(nt).__name__}")
    if nt.layout != torch.jagged:
        raise InvalidArgument(
            f"column '{name}': a nested tensor of layout {nt.layout} (strided NestedTensor) cannot be "
            f"stored; allowed: {ALLOWED_RAGGED}"
        )
    ragged_idx = int(getattr(nt, "_ragged_idx", 1))
    if ragged_idx != 1:
        raise InvalidArgument(
            f"column '{name}': the NestedTensor's ragged dimension is {ragged_idx}, shape "
            f"{tuple(nt.shape)}; allowed: ragged dimension 1 ([rows, ragged, *inner]), e.g. transpose back"
        )
    offsets = nt.offsets()
    values = nt.values()
    given = nt.lengths()
    if given is None:  # rows back to back: row i is values[offsets[i]:offsets[i + 1]]
        lengths = torch.diff(offsets)
        start, end = int(offsets[0]), int(offsets[-1])
        if start != 0 or end != values.shape[0]:
            values = values[start:end]
    else:  # rows with holes between them (narrow): one gather of every row's items
        lengths = given.to(torch.int64)
        total = int(lengths.sum())
        starts = offsets[:-1].to(torch.int64)
        row_begin = torch.cumsum(lengths, 0) - lengths  # where each row starts in the packed output
        index = torch.repeat_interleave(starts - row_begin, lengths, output_size=total)
        index += torch.arange(total, device=index.device)
        values = values.index_select(0, index)
    return values.contiguous(), lengths.to("cpu", torch.int64).numpy()


def _offsets(lengths: Any) -> np.ndarray:
    lens = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return offsets


def _as_tensor(values: Any) -> Any:
    torch = _torch()
    if is_torch_tensor(values):
        return values
    arr = np.asarray(values)
    if not arr.flags.writeable:  # a zero-copy view of the dock: torch has no read-only tensors
        arr = arr.copy()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def to_nested(values: Any, lengths: Any) -> Any:
    """Packed rows (values ``[total, *inner]`` numpy or torch, lengths ``[n]``) -> a jagged NestedTensor
    over the same values (no copy of a torch tensor or a writable numpy array)."""
    torch = _torch()
    vals = _as_tensor(values)
    lens = np.asarray(lengths, dtype=np.int64)
    offs = _offsets(lens)
    if int(offs[-1]) != vals.shape[0]:
        raise InvalidArgument(f"lengths add up to {int(offs[-1])} items but values have {vals.shape[0]}")
    # The row-length bounds are given: without them to_padded_tensor() pads every row to the total.
    bounds = {"min_seqlen": int(lens.min()), "max_seqlen": int(lens.max())} if len(lens) else {}
    offsets = torch.from_numpy(offs).to(vals.device)
    return torch.nested.nested_tensor_from_jagged(vals, offsets=offsets, **bounds)


def pad(values: Any, lengths: Any, value: Any = 0) -> Padded:
    """Packed rows -> Padded ``[n, width, *inner]`` (one vectorised scatter; numpy or torch as given)."""
    lens = np.asarray(lengths, dtype=np.int64)
    width = int(lens.max()) if len(lens) else 0
    mask = np.arange(width)[None, :] < lens[:, None]
    if is_torch_tensor(values):
        torch = _torch()
        out = torch.full(
            (len(lens), width, *values.shape[1:]), value, dtype=values.dtype, device=values.device
        )
        out[torch.from_numpy(mask).to(values.device)] = values
    else:
        vals = np.asarray(values)
        out = np.full((len(lens), width, *vals.shape[1:]), value, dtype=vals.dtype)
        out[mask] = vals
    return Padded(out, lens)


def ragged_output(values: Any, lengths: Any, layout: str = "packed") -> Any:
    """Fetched packed rows in the layout asked for: Ragged (``packed``), Padded (``padded``) or a jagged
    NestedTensor (``nested``)."""
    if layout == "packed":
        return Ragged.from_lengths(values, lengths)
    if layout == "padded":
        return pad(values, lengths)
    if layout == "nested":
        return to_nested(values, lengths)
    raise InvalidArgument(f"layout must be one of {LAYOUTS}, got {layout!r}")


# ---- TensorDict ---------------------------------------------------------------------------------


def _td() -> Any:
    try:
        import tensordict
    except ImportError:
        raise InvalidArgument(
            "TensorDict in or out of the dock needs the tensordict package installed"
        ) from None
    return tensordict


def _non_tensor_rows(value: Any, n: int, name: str) -> ObjectValues:
    rows = value.tolist()  # NonTensorData: n copies of its value; NonTensorStack: one value per row
    if not isinstance(rows, list) or len(rows) != n:
        raise InvalidArgument(f"column '{name}': non-tensor entry gives {type(rows).__name__} for {n} rows")
    return ObjectValues.of(rows)


def tensordict_to_columns(td: Any, sep: str = ".") -> dict[str, Any]:
    """A TensorDict with batch size ``[n]`` -> ``{column: value}`` for a put (see the module docstring).
    Refuses (InvalidArgument, naming the key) other batch sizes, strided NestedTensors and key clashes."""
    tensordict = _td()
    if len(td.batch_size) != 1:
        raise InvalidArgument(
            f"a TensorDict put needs batch_size [rows], got {list(td.batch_size)}; "
            "reshape it so the only batch dim is the rows"
        )
    n = int(td.batch_size[0])
    out: dict[str, Any] = {}

    def walk(sub: Any, prefix: str) -> None:
        for key in sub.keys():  # noqa: SIM118 (iterating a TensorDict walks its batch dim)
            if sep in str(key):
                raise InvalidArgument(f"TensorDict key {key!r} contains the separator {sep!r} of nested keys")
            name = f"{prefix}{key}"
            value = sub.get(key)
            if tensordict.is_non_tensor(value):
                out[name] = _non_tensor_rows(value, n, name)
            elif tensordict.is_tensor_collection(value):
                walk(value, f"{name}{sep}")
            elif is_nested(value):
                vals, lengths = from_nested(value, name)
                out[name] = Ragged.from_lengths(vals, lengths)
            elif is_torch_tensor(value):
                out[name] = value
            else:
                raise InvalidArgument(f"column '{name}': unsupported TensorDict entry {type(value).__name__}")

    walk(td, "")
    if not out:
        raise InvalidArgument("put of an empty TensorDict")
    return out


def columns_to_tensordict(data: Mapping[str, Any], n: int, ragged: str = "nested", sep: str = ".") -> Any:
    """Fetched columns -> ``TensorDict(batch_size=[n])``. Dense tensors as they are; ``Ragged`` as a
    jagged NestedTensor (``ragged="nested"``) or padded values plus a bool ``<name>_mask``
    (``ragged="padded"``); ``Padded`` as padded + mask; a list (object column) as a NonTensorStack;
    names with ``sep`` become nested TensorDicts."""
    tensordict = _td()
    torch = _torch()
    if ragged not in ("nested", "padded"):
        raise InvalidArgument(f"ragged must be 'nested' or 'padded', got {ragged!r}")
    flat: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, Ragged):
            if ragged == "nested":
                flat[name] = to_nested(value.values, value.lengths)
                continue
            value = pad(_as_tensor(value.values), value.lengths)
        if isinstance(value, Padded):
            if f"{name}_mask" in data:
                raise InvalidArgument(
                    f"the mask of ragged column '{name}' would be stored as '{name}_mask', which is also a "
                    "column; fetch them separately"
                )
            flat[name] = _as_tensor(value.values)
            flat[f"{name}_mask"] = torch.from_numpy(np.asarray(value.mask))
        elif isinstance(value, list) or (isinstance(value, np.ndarray) and value.dtype == object):
            # An object column: a NonTensorStack of one value per row.
            value = list(value)
            if any(type(v) is list for v in value):  # from_list would stack a list value into a batch dim
                rows = [tensordict.NonTensorData(v) for v in value]
                flat[name] = tensordict.NonTensorStack(*rows, stack_dim=0)
            else:
                flat[name] = tensordict.NonTensorStack.from_list(value)
        else:
            flat[name] = _as_tensor(value)
    nested: dict[str, Any] = {}
    for name in sorted(flat, key=len):  # parents before their children
        parts = name.split(sep)
        node = nested
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise InvalidArgument(f"column '{name}': '{p}' is also a column; nested keys would clash")
            node = child
        if parts[-1] in node:
            raise InvalidArgument(f"column '{name}' clashes with another column (or a ragged column's mask)")
        node[parts[-1]] = flat[name]
    return tensordict.TensorDict(nested, batch_size=[n])
