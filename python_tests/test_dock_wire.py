"""The same-node wire (msrl_core.dock._wire): fixed binary encoding, same-uid peers only, bounded frames
and connections. In-process servers here; the Ray actors' servers are attacked in test_dock_ray.py."""

from __future__ import annotations

import json
import os
import pickle
import pwd
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from msrl_core.dock import _wire
from msrl_core.errors import InvalidArgument, MsrlError, Unavailable

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_PEERCRED, memfd: Linux")


class Marker:
    """Unpickling this creates a file: the proof that a frame ran code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def pickled_frames(marker: str) -> list[bytes]:
    data = pickle.dumps(Marker(marker))
    return [
        struct.pack("!I", len(data)) + data,  # the old wire format: length + pickle
        _wire.HEADER.pack(_wire.MAGIC, _wire.REQUEST, len(data)) + data,  # a pickle in a new-format frame
    ]


def raw_connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    return s


def closed_by_peer(s: socket.socket) -> bool:
    """True when the server closed the connection (EOF or reset), without sending a reply frame."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture()
def server():
    fd = os.memfd_create("wire-test") if hasattr(os, "memfd_create") else -1
    calls: list[tuple] = []

    def echo(*args):
        calls.append(args)
        return list(args)

    def boom(msg):
        raise InvalidArgument(f"bad: {msg}")

    srv = _wire.Server(
        {"echo": echo, "boom": boom, "fail": lambda: 1 / 0},
        "test",
        {"fds": lambda: ([7], [fd])},
        max_conns=4,
        idle_timeout=60.0,
    )
    srv.calls = calls  # type: ignore[attr-defined]
    yield srv
    srv.close()
    if fd >= 0:
        os.close(fd)


def test_encoding_round_trips_the_values_the_dock_sends():
    rows = np.arange(5, dtype=np.int64)
    nested = [1, [2.0, "x"]]
    value = [None, True, False, -(2**63), 2**63 - 1, 1.5, "élan", nested, rows, rows.astype(np.int32)]
    got = _wire.decode(_wire.encode(value))
    assert got[:8] == [None, True, False, -(2**63), 2**63 - 1, 1.5, "élan", [1, [2.0, "x"]]]
    assert got[8].dtype == np.int64 and got[8].tolist() == [0, 1, 2, 3, 4]
    assert got[9].dtype == np.int32 and got[9].tolist() == [0, 1, 2, 3, 4]
    assert _wire.decode(_wire.encode((1, 2))) == [1, 2]  # tuples travel as lists


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"X",  # unknown tag
        b"i\x00\x00",  # truncated int
        b"s\xff\xff\xff\xffabc",  # string longer than the frame
        b"l\xff\xff\xff\xff",  # list longer than the frame
        b"a\x00" + struct.pack("!Q", 2**61),  # array longer than the frame (no overflow, no allocation)
        b"a\x09" + struct.pack("!Q", 0),  # unknown dtype code
        b"NN",  # trailing bytes
        b"l\x00\x00\x00\x01" * 20 + b"N",  # nested too deep
        b"s\x00\x00\x00\x02\xff\xfe",  # not UTF-8
    ],
)
def test_decoding_rejects_what_does_not_follow_the_encoding(body):
    with pytest.raises(_wire.WireError):
        _wire.decode(body)


def test_encoding_refuses_objects_it_cannot_carry():
    for bad in [object(), {"a": 1}, np.zeros((2, 2)), np.zeros(2, dtype=object), 2**64]:
        with pytest.raises((_wire.WireError, struct.error)):
            _wire.encode([bad])


@linux
def test_calls_replies_and_errors(server):
    conn = _wire.Connection(server.path, "test server", 60.0)
    got = conn.call("echo", (np.arange(3), "a", 2))
    assert got[0].tolist() == [0, 1, 2] and got[1:] == ["a", 2]
    with pytest.raises(InvalidArgument, match="bad: x") as e:
        conn.call("boom", ("x",))
    assert str(e.value) == "bad: x"
    with pytest.raises(MsrlError, match="ZeroDivisionError"):
        conn.call("fail", ())
    with pytest.raises(InvalidArgument, match="unknown operation 'nope'"):
        conn.call("nope", ())
    value, fds = conn.call("fds", (), fds=True)
    assert value == [7] and len(fds) == 1
    os.close(fds[0])
    assert conn.call("echo", (1,)) == [1]  # the connection survived every error
    conn.close()


@linux
def test_pickled_frames_run_no_code_and_the_server_keeps_serving(server, tmp_path):
    marker = tmp_path / "pwned"
    for frame in pickled_frames(str(marker)):
        s = raw_connect(server.path)
        s.sendall(frame)
        assert closed_by_peer(s)
        s.close()
    assert not marker.exists()
    assert server.calls == []
    assert server.stats()["malformed"] == 2
    assert _wire.Connection(server.path, "t", 60.0).call("echo", (5,)) == [5]


@linux
@pytest.mark.parametrize("case", ["malformed", "truncated", "4GiB-length", "bad-request-shape", "reply-kind"])
def test_bad_frames_close_only_their_connection(server, case):
    other = _wire.Connection(server.path, "t", 60.0)
    assert other.call("echo", (1,)) == [1]
    s = raw_connect(server.path)
    if case == "malformed":
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    elif case == "truncated":
        body = _wire.encode(["echo", [1]])
        s.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.REQUEST, len(body) + 10) + body)
        s.shutdown(socket.SHUT_WR)  # the rest never comes
    elif case == "4GiB-length":
        s.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.REQUEST, 4 << 30))
    elif case == "bad-request-shape":
        body = _wire.encode([1, 2, 3])
        s.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.REQUEST, len(body)) + body)
    else:
        body = _wire.encode(["echo", [1]])
        s.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.OK, len(body)) + body)
    assert closed_by_peer(s)
    s.close()
    if case != "truncated":
        assert server.stats()["malformed"] == 1
    assert server.calls == [(1,)]  # nothing of the bad frame was run
    assert other.call("echo", (2,)) == [2]  # the other client is still served
    assert server.stats()["open"] == 1


@linux
def test_connections_are_bounded_and_idle_ones_time_out():
    srv = _wire.Server({"echo": lambda x: x}, "bounded", max_conns=2, idle_timeout=0.5)
    try:
        a = _wire.Connection(srv.path, "a", 60.0)
        b = _wire.Connection(srv.path, "b", 60.0)
        assert a.call("echo", (1,)) == 1 and b.call("echo", (2,)) == 2
        c = _wire.Connection(srv.path, "c", 60.0)
        with pytest.raises(Unavailable, match="more than 2 connections"):
            c.call("echo", (3,))
        deadline = time.monotonic() + 30
        while srv.stats()["open"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.stats()["open"] == 0 and srv.stats()["idle_closed"] == 2
        # A client reconnects before reusing a connection idle longer than its own limit.
        d = _wire.Connection(srv.path, "d", 0.1)
        assert d.call("echo", (4,)) == 4
        time.sleep(1.0)
        assert d.call("echo", (5,)) == 5
    finally:
        srv.close()


_OTHER_USER_CLIENT = r"""
import json, os, pickle, socket, struct, sys
path, marker, uid = bytes.fromhex(sys.argv[1]).decode(), sys.argv[2], int(sys.argv[3])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
assert os.getuid() == uid
out = {"uid": os.getuid()}
for name, frame in [
    ("fds", bytes.fromhex(sys.argv[4])),
    ("pickle", struct.pack("!I", int(sys.argv[5])) + bytes.fromhex(sys.argv[6])),
]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    try:
        s.connect(path)
        s.sendall(frame)
        data, fds, _, _ = socket.recv_fds(s, 1 << 16, 16)
        out[name] = {"connected": True, "reply_bytes": len(data), "fds": len(fds)}
    except OSError as e:
        out[name] = {"connected": False, "error": str(e), "fds": 0, "reply_bytes": 0}
    s.close()
print(json.dumps(out))
"""


def other_user_attack(path: str, marker: str) -> dict:
    """Runs a client as `nobody`: asks for the arena fds and sends a pickle. Returns what it got."""
    nobody = pwd.getpwnam("nobody").pw_uid
    req = _wire.encode(["arena_fds", []])
    fds_frame = _wire.HEADER.pack(_wire.MAGIC, _wire.REQUEST, len(req)) + req
    data = pickle.dumps(Marker(marker))
    proc = subprocess.run(
        [sys.executable, "-c", _OTHER_USER_CLIENT, path.encode().hex(), marker, str(nobody), fds_frame.hex()]
        + [str(len(data)), data.hex()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def can_switch_user() -> bool:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return False
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not can_switch_user(), reason="switching to `nobody` needs root and the user")


@linux
@needs_root
def test_another_user_is_refused_and_gets_no_fd(server, tmp_path):
    marker = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)  # `nobody` could create the marker if its code ran
    got = other_user_attack(server.path, str(marker))
    assert got["uid"] == pwd.getpwnam("nobody").pw_uid
    for case in ("fds", "pickle"):
        assert got[case]["fds"] == 0 and got[case]["reply_bytes"] == 0, got
    assert not marker.exists()
    assert server.calls == [] and server.stats()["refused_uid"] == 2
    assert _wire.Connection(server.path, "t", 60.0).call("echo", (1,)) == [1]  # our uid is still served


@linux
def test_many_threads_leave_no_connections_behind():
    server = _wire.Server({"echo": lambda *a: list(a)}, "threads", max_conns=64)
    errors: list[BaseException] = []

    def worker():
        try:
            conn = _wire.Connection(server.path, "t", 60.0)
            assert conn.call("echo", (1,)) == [1]
            conn.close()
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    try:
        for _ in range(3):
            threads = [threading.Thread(target=worker) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        assert errors == []
        deadline = time.monotonic() + 30
        while server.stats()["open"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.stats()["open"] == 0 and server.stats()["accepted"] == 12
    finally:
        server.close()
