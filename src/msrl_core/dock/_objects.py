"""Object columns: Python values encoded by the writing client into bytes, decoded only by reading clients.

An object column is stored as a ragged ``uint8`` column, one encoded value per row. The dock's
warehouses, controllers, actors and sockets only ever see those bytes: nothing there decodes them.

Each row starts with one format byte:

``0x03`` **JSON**: values that ``json`` round-trips exactly (str-keyed dicts, lists, str, int, float,
    bool, None — chat-message lists are), as compact ASCII JSON: ``json.loads`` builds only those types.
``0x01`` **tagged**: the other safe values, in a tagged, fixed binary encoding of ``None``, ``bool``,
    ``int`` (any size), ``float`` (all 64 bits, NaN payloads and -0.0 included), ``str``, ``bytes``, and
    ``list`` / ``tuple`` / ``dict`` (any safe keys) of those. Decoding either format builds only those
    types: a crafted row can at worst be refused with ``InvalidArgument`` (bad tag, a length past the
    end, nesting deeper than ``MAX_DEPTH``); it cannot run code.
``0x02`` **pickle**: any other picklable value, only with ``ObjectCodec(allow_pickle=True)``. The row is
    ``0x02 | HMAC-SHA256(secret, pickle) (32 bytes) | pickle``. ``secret`` is 32 random bytes made per
    dock (``ObjectCodec.new``); it travels with the dock handle to the job's processes, never to the
    dock's actors. A reader unpickles a row only when it opted in too *and* the MAC verifies
    (``hmac.compare_digest``) — bytes not made by a client holding the secret (a crafted or altered row,
    a row of another dock) are refused with ``InvalidArgument`` before any unpickling. A reader
    without the opt-in never unpickles, whatever the row says.

Design choice (STYLE "Trust no socket"): an authenticated pickle rather than a restricted unpickler,
because a restricted unpickler cannot load "any picklable value" (user classes) and a blocklist of
dangerous globals is not a boundary. The trust boundary is the secret: whoever holds the dock handle
is part of the job (and, in a Ray job, could already run code there).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pickle
import secrets
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from msrl_core.errors import InvalidArgument

SAFE = 0x01
PICKLED = 0x02
JSON = 0x03
MAC_BYTES = 32
MAX_DEPTH = 128  # nesting of lists/tuples/dicts, both ways (a crafted row cannot blow the stack)
SAFE_TYPES = "None, bool, int, float, str, bytes, and list / tuple / dict of those"

# Tags of the safe encoding. Lengths and counts are u64 little-endian; int64 as i64, other ints as
# a signed little-endian byte string of u64 length; floats as IEEE-754 binary64.
_NONE, _TRUE, _FALSE = b"N", b"T", b"F"
_INT, _BIGINT, _FLOAT = b"i", b"I", b"f"
_STR, _BYTES = b"s", b"b"
_LIST, _TUPLE, _DICT = b"l", b"t", b"d"

_T_NONE, _T_TRUE, _T_FALSE, _T_INT, _T_BIGINT, _T_FLOAT, _T_STR, _T_BYTES, _T_LIST, _T_TUPLE, _T_DICT = (
    ord(t) for t in "NTFiIfsbltd"
)

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_JSON_PREFIX = bytes((JSON,))
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def _is_json(value: Any, depth: int) -> bool:
    """True when ``json`` round-trips the value exactly: str-keyed dicts, lists (no tuples), str, int64,
    float other than NaN (json would lose a NaN's sign and payload bits), bool, None."""
    t = type(value)
    if t is str or t is bool or value is None:
        return True
    if t is int:  # huge ints go tagged: json's int <-> str conversion has a digit limit
        return _I64_MIN <= value <= _I64_MAX
    if t is float:
        return value == value  # repr round-trips every other float exactly, -0.0 and infinities too
    if depth >= MAX_DEPTH:
        return False
    if t is list:
        return all(_is_json(v, depth + 1) for v in value)
    if t is dict:
        return all(type(k) is str and _is_json(v, depth + 1) for k, v in value.items())
    return False


class _NotSafe(Exception):
    """Internal: the value holds something outside the safe types (carries the offending type)."""


def _encode_safe(value: Any, out: bytearray, depth: int, seen: set[int]) -> None:
    t = type(value)
    if value is None:
        out += _NONE
    elif t is bool:
        out += _TRUE if value else _FALSE
    elif t is int:
        if _I64_MIN <= value <= _I64_MAX:
            out += _INT
            out += _I64.pack(value)
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += _BIGINT
            out += _U64.pack(len(raw))
            out += raw
    elif t is float:
        out += _FLOAT
        out += _F64.pack(value)
    elif t is str:
        raw = value.encode("utf-8", "surrogatepass")
        out += _STR
        out += _U64.pack(len(raw))
        out += raw
    elif t is bytes:
        out += _BYTES
        out += _U64.pack(len(value))
        out += value
    elif t is list or t is tuple or t is dict:
        if depth >= MAX_DEPTH:
            raise InvalidArgument(f"object value nests lists/tuples/dicts deeper than {MAX_DEPTH} levels")
        if id(value) in seen:
            raise InvalidArgument("object value contains itself (a reference cycle); it cannot be encoded")
        seen.add(id(value))
        if t is dict:
            out += _DICT
            out += _U64.pack(len(value))
            for k, v in value.items():
                _encode_safe(k, out, depth + 1, seen)
                _encode_safe(v, out, depth + 1, seen)
        else:
            out += _LIST if t is list else _TUPLE
            out += _U64.pack(len(value))
            for v in value:
                _encode_safe(v, out, depth + 1, seen)
        seen.discard(id(value))
    else:
        raise _NotSafe(t)


class _Reader:
    """Decodes one safe row; every length is checked against what is left before it is used."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview, pos: int, end: int):
        self.buf, self.pos, self.end = buf, pos, end

    def _take(self, n: int) -> int:
        p = self.pos
        if n < 0 or n > self.end - p:
            raise InvalidArgument(
                f"object row is corrupt: needs {n} more bytes at offset {p}, {self.end - p} left"
            )
        self.pos = p + n
        return p

    def _u64(self) -> int:
        return int(_U64.unpack_from(self.buf, self._take(8))[0])

    def value(self, depth: int) -> Any:
        tag = self.buf[self._take(1)]
        if tag == _T_STR:
            n = self._u64()
            p = self._take(n)
            try:
                return str(self.buf[p : p + n], "utf-8", "surrogatepass")
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"object row is corrupt: a string is not UTF-8 ({e})") from None
        if tag == _T_INT:
            return _I64.unpack_from(self.buf, self._take(8))[0]
        if tag == _T_FLOAT:
            return _F64.unpack_from(self.buf, self._take(8))[0]
        if tag == _T_NONE:
            return None
        if tag == _T_TRUE:
            return True
        if tag == _T_FALSE:
            return False
        if tag == _T_BYTES:
            n = self._u64()
            p = self._take(n)
            return bytes(self.buf[p : p + n])
        if tag == _T_BIGINT:
            n = self._u64()
            p = self._take(n)
            return int.from_bytes(self.buf[p : p + n], "little", signed=True)
        if tag in (_T_LIST, _T_TUPLE, _T_DICT):
            if depth >= MAX_DEPTH:
                raise InvalidArgument(f"object row is corrupt: nesting deeper than {MAX_DEPTH} levels")
            n = self._u64()
            # Every item takes at least one byte: a count past the end is refused before any allocation.
            if n > self.end - self.pos:
                raise InvalidArgument(
                    f"object row is corrupt: {n} items announced, {self.end - self.pos} bytes left"
                )
            if tag == _T_DICT:
                d = {}
                for _ in range(n):
                    k = self.value(depth + 1)
                    try:
                        d[k] = self.value(depth + 1)
                    except TypeError:
                        raise InvalidArgument(
                            f"object row is corrupt: dict key of type {type(k).__name__} is not hashable"
                        ) from None
                return d
            items = [self.value(depth + 1) for _ in range(n)]
            return items if tag == _T_LIST else tuple(items)
        raise InvalidArgument(f"object row is corrupt: unknown tag {tag:#04x} at offset {self.pos - 1}")


class ObjectCodec:
    """Encodes and decodes the values of object columns (see the module docstring for the format).

    ``ObjectCodec.new(allow_pickle=...)`` makes one per dock, with a fresh secret. The codec is
    picklable so that it travels with a dock handle to the job's workers; keep it out of the dock's
    actors (they store bytes, never values).
    """

    __slots__ = ("allow_pickle", "_secret")

    def __init__(self, secret: bytes, allow_pickle: bool = False):
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise InvalidArgument("ObjectCodec secret must be at least 16 bytes (use ObjectCodec.new())")
        self._secret = secret
        self.allow_pickle = bool(allow_pickle)

    @classmethod
    def new(cls, allow_pickle: bool = False) -> ObjectCodec:
        return cls(secrets.token_bytes(32), allow_pickle)

    def __getstate__(self) -> tuple[bytes, bool]:
        return (self._secret, self.allow_pickle)

    def __setstate__(self, state: tuple[bytes, bool]) -> None:
        self._secret, self.allow_pickle = state

    def __repr__(self) -> str:  # never shows the secret
        return f"ObjectCodec(allow_pickle={self.allow_pickle})"

    def _mac(self, payload: bytes | memoryview) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()

    # ---- one value ---------------------------------------------------------------------------

    def encode_one(self, value: Any, where: str = "object value") -> bytes:
        if _is_json(value, 0):  # a cycle or deeper nesting stops at MAX_DEPTH and goes on below
            return _JSON_PREFIX + json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode()
        out = bytearray((SAFE,))
        try:
            _encode_safe(value, out, 0, set())
            return bytes(out)
        except _NotSafe as e:
            bad = e.args[0]
            if not self.allow_pickle:
                raise InvalidArgument(
                    f"{where}: a {type(value).__name__} holding a {bad.__module__}.{bad.__qualname__} is not "
                    f"one of the safe types ({SAFE_TYPES}); to store other picklable values make the "
                    "object column with allow_pickle=True (authenticated pickle)"
                ) from None
        try:
            payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # pickle raises TypeError, PicklingError, AttributeError, ...
            raise InvalidArgument(
                f"{where}: a {type(value).__name__} cannot be pickled ({type(e).__name__}: {e}); "
                f"object columns hold {SAFE_TYPES}, or picklable values with allow_pickle=True"
            ) from None
        return bytes((PICKLED,)) + self._mac(payload) + payload

    def decode_one(self, raw: bytes | memoryview, where: str = "object row") -> Any:
        buf = memoryview(raw)
        if buf.format != "B" or buf.ndim != 1:
            buf = buf.cast("B")
        return self._decode(buf, 0, len(buf), where)

    def _decode(self, buf: memoryview, start: int, end: int, where: str) -> Any:
        if end <= start:
            raise InvalidArgument(f"{where} is empty: not an encoded object value")
        fmt = buf[start]
        if fmt == SAFE:
            r = _Reader(buf, start + 1, end)
            try:
                value = r.value(0)
            except InvalidArgument as e:
                raise InvalidArgument(f"{where}: {e}") from None
            if r.pos != end:
                raise InvalidArgument(f"{where} is corrupt: {end - r.pos} bytes after the value")
            return value
        if fmt == JSON:
            try:
                return json.loads(bytes(buf[start + 1 : end]))
            except (ValueError, RecursionError) as e:
                raise InvalidArgument(f"{where} is corrupt: not a JSON value ({type(e).__name__})") from None
        if fmt == PICKLED:
            if not self.allow_pickle:
                raise InvalidArgument(
                    f"{where} holds a pickled value and this reader's codec has allow_pickle=False: "
                    "it is not unpickled"
                )
            if end - start < 1 + MAC_BYTES:
                raise InvalidArgument(f"{where} is corrupt: a pickled row shorter than its MAC")
            mac = bytes(buf[start + 1 : start + 1 + MAC_BYTES])
            payload = buf[start + 1 + MAC_BYTES : end]
            if not hmac.compare_digest(mac, self._mac(payload)):
                raise InvalidArgument(
                    f"{where}: the pickled value's MAC does not verify (not written by a client of this "
                    "dock, or altered): it is not unpickled"
                )
            return pickle.loads(payload)
        raise InvalidArgument(
            f"{where}: unknown format byte {fmt:#04x}; allowed: 0x01 (safe), 0x02 (pickle), 0x03 (JSON)"
        )

    # ---- columns -----------------------------------------------------------------------------

    def encode(self, values: Sequence[Any], name: str = "object") -> tuple[np.ndarray, np.ndarray]:
        """Values of one object column -> (uint8 values, int64 lengths) for the dock's ragged put.
        Every value is encoded before anything is returned: an error (naming the row) leaves nothing
        to write."""
        if isinstance(values, np.ndarray) and values.ndim == 1:
            values = list(values)  # a numpy object array (verl's non_tensor_batch): one value per row
        if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
            raise InvalidArgument(
                f"object column '{name}': pass a list with one value per row, got {type(values).__name__}"
            )
        parts = [self.encode_one(v, f"object column '{name}' row {i}") for i, v in enumerate(values)]
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        flat = np.frombuffer(b"".join(parts), dtype=np.uint8)
        return flat, lengths

    def decode(self, values: Any, offsets: Any, name: str = "object") -> list[Any]:
        """(uint8 values, int64 offsets [n + 1]) of fetched rows -> the list of n values."""
        arr = np.ascontiguousarray(np.asarray(values), dtype=np.uint8)
        offs = np.asarray(offsets, dtype=np.int64)
        if (
            offs.ndim != 1
            or len(offs) < 1
            or offs[0] != 0
            or offs[-1] != arr.size
            or (np.diff(offs) < 0).any()
        ):
            raise InvalidArgument(
                f"object column '{name}': offsets must rise from 0 to the {arr.size} value bytes"
            )
        buf = memoryview(arr.data).cast("B")
        bounds = offs.tolist()
        return [
            self._decode(buf, bounds[i], bounds[i + 1], f"object column '{name}' row {i}")
            for i in range(len(bounds) - 1)
        ]


# The codec of docks that do not opt in to pickle: it never signs or unpickles, so its secret is unused.
_SAFE_ONLY = ObjectCodec.new(allow_pickle=False)


def encode(
    values: Sequence[Any], name: str = "object", codec: ObjectCodec | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 values, int64 lengths) of one object column's rows; ``codec`` None: safe types only."""
    return (codec or _SAFE_ONLY).encode(values, name)


def decode(values: Any, lengths: Any, name: str = "object", codec: ObjectCodec | None = None) -> list[Any]:
    """The rows' values from (uint8 values, int64 lengths [n]); ``codec`` None: never unpickles.
    ``values`` packed ``[total]``, or padded ``[n, width]`` (a fetch with layout='padded': the rows are
    taken out of the padding first)."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.ndim != 1 or (lens < 0).any():
        raise InvalidArgument(f"object column '{name}': lengths must be a 1-D array of counts >= 0")
    arr = np.asarray(values)
    if arr.ndim == 2:
        if arr.shape[0] != len(lens) or (len(lens) and int(lens.max()) > arr.shape[1]):
            raise InvalidArgument(
                f"object column '{name}': padded values {arr.shape} do not hold rows of lengths up to "
                f"{int(lens.max()) if len(lens) else 0} for {len(lens)} rows"
            )
        values = arr[np.arange(arr.shape[1])[None, :] < lens[:, None]]  # row-major: rows back to back
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return (codec or _SAFE_ONLY).decode(values, offsets, name)
