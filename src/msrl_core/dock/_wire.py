"""The same-node wire of the Ray backend: a fixed binary encoding over Unix sockets. No pickle.

A frame is a 16-byte header ``magic(4) kind(u32) length(u64)`` and ``length`` bytes of body. The body
is one value in a small tagged encoding that can only build ``None``, bools, 64-bit ints and floats,
strings, lists and 1-D numpy arrays of a few integer/float dtypes (raw bytes): decoding never runs code.
Encoding and decoding are native (csrc/bindings/wire.cpp): one pass per value on each side of a call.
A request body is ``(op, (args...))``; an ok reply carries the result, an error reply ``[class, message]``.

The server (:class:`Server`) accepts only peers of its own uid (``SO_PEERCRED``; others are closed
before a byte is read, so they never get a file descriptor), serves at most ``max_conns`` connections
(one thread each, blocked in ``recv``: nothing polls), closes a connection that stays idle for
``idle_timeout`` seconds, and closes — only — a connection whose frame is malformed, truncated or asks
for more than ``max_frame`` bytes (checked before anything is allocated). File descriptors (the memfd
arenas) go out only as replies to ``fd_ops`` on accepted connections (``SCM_RIGHTS``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from msrl_core import _core
from msrl_core.dock._types import MAX_WAIT_S
from msrl_core.errors import MsrlError, Timeout, Unavailable

MAGIC = b"MSD1"
HEADER = struct.Struct("!4sIQ")
REQUEST, OK, ERROR = 1, 2, 3
MAX_FRAME = 1 << 30  # bytes of one frame's body (rows arrays and offsets; data moves through the arenas)
MAX_DEPTH = 8  # nesting of lists (kMaxDepth in csrc/bindings/wire.cpp)
MAX_FDS = 256
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

WireError = _core.DockWireError  # a frame or value that does not follow the encoding


# ---- encoding (native: csrc/bindings/wire.cpp, one pass per value on each side) ---------------------


def encode(value: Any) -> bytes:
    """The body bytes of `value` (see the module doc for what can travel)."""
    return _core.dock_wire_encode(value)


def decode(body: bytes | bytearray | memoryview) -> Any:
    """The value of a body; WireError on anything that does not follow the encoding exactly."""
    return _core.dock_wire_decode(body)


# ---- framing -----------------------------------------------------------------------------------


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return buf


def send_frame(sock: socket.socket, kind: int, body: bytes, fds: list[int] | None = None) -> None:
    head = HEADER.pack(MAGIC, kind, len(body))
    if fds:
        socket.send_fds(sock, [head], fds)
        sock.sendall(body)
    else:
        sock.sendall(head + body)


def _check_header(head: bytes | bytearray, max_frame: int) -> tuple[int, int]:
    magic, kind, n = HEADER.unpack(bytes(head))
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}")
    if kind not in (REQUEST, OK, ERROR):
        raise WireError(f"unknown frame kind {kind}")
    if n > max_frame:
        raise WireError(f"frame of {n} bytes exceeds the limit of {max_frame}")
    return kind, n


def recv_frame(sock: socket.socket, max_frame: int = MAX_FRAME) -> tuple[int, bytearray]:
    kind, n = _check_header(recv_exact(sock, HEADER.size), max_frame)
    return kind, recv_exact(sock, n)


def recv_frame_fds(sock: socket.socket, max_frame: int = MAX_FRAME) -> tuple[int, bytearray, list[int]]:
    """A frame whose header may carry file descriptors (SCM_RIGHTS)."""
    head, fds, flags, _ = socket.recv_fds(sock, HEADER.size, MAX_FDS)
    try:
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            raise WireError("file descriptors were truncated")
        if not head:
            raise ConnectionError("connection closed")
        if len(head) < HEADER.size:
            head += recv_exact(sock, HEADER.size - len(head))
        kind, n = _check_header(head, max_frame)
        return kind, recv_exact(sock, n), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid


def _error_body(e: BaseException) -> bytes:
    if isinstance(e, MsrlError):
        # The message itself: str() of a KeyError subclass (NotFound) would quote it once more per hop.
        msg = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
        return encode([type(e).__name__, msg])
    return encode(["MsrlError", f"{type(e).__name__}: {e}"])


def raise_error(body: bytearray) -> None:
    """Raises the MsrlError an error reply carries (only classes of msrl_core.errors)."""
    try:
        name, message = decode(body)
    except (WireError, ValueError, TypeError):
        raise WireError("malformed error reply") from None
    from msrl_core import errors

    cls = getattr(errors, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, MsrlError)):
        cls = MsrlError
    raise cls(str(message))


# ---- server ------------------------------------------------------------------------------------


def _socket_path(tag: str) -> str:
    name = f"msrl-dock-{tag}-{uuid.uuid4().hex[:12]}"
    # Linux abstract namespace: no file to leak when the actor is killed (no permissions either: the
    # uid check below is what keeps other users out); elsewhere a file in tmp.
    if sys.platform.startswith("linux"):
        return "\0" + name
    return os.path.join(tempfile.gettempdir(), name + ".sock")


class Server:
    """Serves ``ops`` (name -> callable of the decoded args) on a new Unix socket; see the module doc.
    ``fd_ops`` return ``(value, fds)`` and the fds travel with the reply."""

    def __init__(
        self,
        ops: dict[str, Callable[..., Any]],
        tag: str,
        fd_ops: dict[str, Callable[..., tuple[Any, list[int]]]] | None = None,
        max_conns: int = 512,
        idle_timeout: float = 600.0,
        max_frame: int = MAX_FRAME,
        send_timeout: float = 60.0,
    ):
        self.ops = dict(ops)
        self.fd_ops = dict(fd_ops or {})
        self.max_conns, self.idle_timeout = max_conns, idle_timeout
        self.max_frame, self.send_timeout = max_frame, send_timeout
        self.uid = os.getuid()
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.counters = {"accepted": 0, "refused_uid": 0, "refused_full": 0, "malformed": 0, "idle_closed": 0}
        self.path = _socket_path(tag)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(128)
        self.closed = False
        threading.Thread(target=self._accept_loop, daemon=True, name=f"msrl-wire-{tag}").start()

    def stats(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counters, open=len(self.conns))

    def _count(self, key: str) -> None:
        with self.lock:
            self.counters[key] += 1

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()  # blocks; no polling
            except OSError:
                return
            try:
                uid = peer_uid(conn)
            except OSError:
                uid = -1
            if uid != self.uid:
                self._count("refused_uid")
                conn.close()  # before reading a byte: nothing served, no fd sent
                continue
            with self.lock:
                full = len(self.conns) >= self.max_conns
                if not full:
                    self.conns.add(conn)
                    self.counters["accepted"] += 1
            if full:
                self._count("refused_full")
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    send_frame(
                        conn, ERROR, encode(["Unavailable", f"more than {self.max_conns} connections"])
                    )
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while self._serve_one(conn):
                pass
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Serves one request; False when the connection is to be closed."""
        try:
            conn.settimeout(self.idle_timeout)
            kind, body = recv_frame(conn, self.max_frame)
            if kind != REQUEST:
                raise WireError(f"frame kind {kind} where a request was expected")
            req = decode(body)
            del body
            if not (
                isinstance(req, list)
                and len(req) == 2
                and isinstance(req[0], str)
                and isinstance(req[1], list)
            ):
                raise WireError("a request is [op, [args...]]")
        except TimeoutError:
            self._count("idle_closed")
            return False
        except (WireError, struct.error):
            self._count("malformed")
            return False
        except (ConnectionError, OSError):
            return False
        op, args = req
        fds: list[int] = []
        try:
            if op in self.fd_ops:
                value, fds = self.fd_ops[op](*args)
            elif op in self.ops:
                value = self.ops[op](*args)
            else:
                raise _core.InvalidArgument(f"unknown operation {op!r}")
            kind, reply = OK, encode(value)
        except BaseException as e:  # every error goes back to the caller; the actor keeps serving
            kind, reply, fds = ERROR, _error_body(e), []
        try:
            conn.settimeout(self.send_timeout)
            send_frame(conn, kind, reply, fds)
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


# ---- client ------------------------------------------------------------------------------------

RPC_MARGIN_S = 30.0  # default time allowed for an RPC beyond the wait it asks for (op_timeout)


class Connection:
    """One client connection to a Server; not thread-safe (each client thread keeps its own)."""

    def __init__(self, path: str, what: str, idle_reconnect: float):
        self.path, self.what, self.idle_reconnect = path, what, idle_reconnect
        self.sock: socket.socket | None = None
        self.last_used = 0.0

    def _connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.path)
            if peer_uid(s) != os.getuid():  # the server must be ours too
                raise ConnectionRefusedError("the endpoint belongs to another user")
        except OSError as e:
            s.close()
            raise Unavailable(f"{self.what} endpoint unreachable (actor died?): {e}") from None
        return s

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __del__(self) -> None:
        self.close()

    def call(
        self, op: str, args: tuple | list, wait: float = 0.0, fds: bool = False, margin: float = RPC_MARGIN_S
    ) -> Any:
        """Sends one request and returns the reply value (with `fds`: (value, fds)). The reply must come
        within `wait` (the time the operation may block, e.g. a claim's timeout) + `margin` seconds."""
        now = time.monotonic()
        if self.sock is not None and now - self.last_used > self.idle_reconnect:
            self.close()  # the server may have closed it as idle
        if self.sock is None:
            self.sock = self._connect()
        sock = self.sock
        limit = min(wait, MAX_WAIT_S) + margin
        got_fds: list[int] = []
        body = encode([op, list(args)])
        try:
            sock.settimeout(limit)
            try:
                send_frame(sock, REQUEST, body)
            except OSError:  # a refusing server says why before it closes: read that first
                sock.settimeout(1.0)
            if fds:
                kind, reply, got_fds = recv_frame_fds(sock)
            else:
                kind, reply = recv_frame(sock)
            if kind == ERROR:
                for fd in got_fds:
                    os.close(fd)
                got_fds = []
                raise_error(reply)
            value = decode(reply)
        except MsrlError:  # the server's answer (Timeout is a TimeoutError too: caught here first)
            self.last_used = time.monotonic()
            raise
        except TimeoutError:
            self.close()
            raise Timeout(f"{self.what} did not answer {op} within {limit} s") from None
        except (WireError, struct.error) as e:
            for fd in got_fds:
                os.close(fd)
            self.close()
            raise Unavailable(f"{self.what} sent a malformed reply to {op}: {e}") from None
        except (ConnectionError, OSError) as e:
            self.close()
            raise Unavailable(f"{self.what} connection lost during {op} (actor died?): {e}") from None
        self.last_used = time.monotonic()
        return (value, got_fds) if fds else value
