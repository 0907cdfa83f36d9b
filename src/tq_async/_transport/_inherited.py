"""What a forked child must not keep of its parent's services: their sockets and dir locks.

A child made by ``fork`` (multiprocessing's default on Linux, DataLoader workers, a pool of
rollout workers) gets a copy of every descriptor of its parent. A copy of a service's
listening socket keeps its address taken after the service stopped, even after its process
was killed: a service started there again cannot bind, and clients connect to a socket that
nobody serves and wait for their timeouts instead of hearing at once that nothing listens. A
copy of a client's connection keeps it open after the service closed its end: the client
hears nothing and waits. A copy of a directory's lock (``flock``) keeps the directory "in
use by another running" one. So the child closes its copies at once, before any of its own
code runs: closing a copy neither closes the parent's socket nor releases the parent's lock.

ZMQ does not show the descriptors of its listeners and connections: the child finds them
among its own, as the sockets whose local address is one a service of this process bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import stat
from typing import Any

__all__ = ["close_in_children", "release", "remove_unheld", "serving", "stopped_serving"]

#: descriptors of this process that a forked child closes (directory locks)
_held: set[int] = set()
#: the local addresses of this process's services (see `_name`), with how many bound each
_served: dict[Any, int] = {}


def close_in_children(fd: int) -> int:
    """Have a child forked from now on close its copy of ``fd``; returns ``fd``."""
    _held.add(fd)
    return fd


def release(fd: int) -> None:
    """Close ``fd`` here; a child forked from now on has no copy to close."""
    _held.discard(fd)  # first: its number may be reused once closed
    os.close(fd)


def remove_unheld(path: str, lock: str) -> bool:
    """Remove directory ``path`` unless a process holds ``lock`` (a file in it, or ``path``
    itself) locked: what a process killed before it removed its own leaves. True if removed;
    a ``lock`` that cannot be opened (none, not ours) leaves ``path`` alone."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its process runs
    else:
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _name(address: str) -> Any:
    """The local address a socket bound at ``address`` (ZMQ's ``LAST_ENDPOINT`` spelling)
    and the connections it accepts report: ``(host, port)`` (host ``""`` for a wildcard),
    or a Unix socket's path (bytes that start with NUL for an abstract one)."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        return ("" if host in ("0.0.0.0", "::", "*") else host, int(port))
    if address.startswith(("ipc://@", "uds://@")):
        return b"\0" + address[len("ipc://@") :].encode()
    return address[len("ipc://") :]


def serving(address: str) -> None:
    """A service of this process bound ``address`` (``tcp://``, ``ipc://``, ``uds://``)."""
    if address.startswith(("tcp://", "ipc://", "uds://")):
        name = _name(address)
        _served[name] = _served.get(name, 0) + 1


def stopped_serving(address: str) -> None:
    """Undo one `serving` (before the socket is closed)."""
    if address.startswith(("tcp://", "ipc://", "uds://")):
        name = _name(address)
        left = _served.get(name, 0) - 1
        if left > 0:
            _served[name] = left
        else:
            _served.pop(name, None)


def _ours(sock: socket.socket) -> bool:
    local = sock.getsockname()
    if isinstance(local, tuple):
        return (local[0], local[1]) in _served or ("", local[1]) in _served
    return bool(local) and local in _served


def _close_services_sockets() -> None:
    """Close every socket whose local address is a service's (listeners and the
    connections they accepted; none where ``/proc`` is not there)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):
            continue
        try:
            ours = _ours(sock)
        except OSError:
            ours = False
        sock.detach()
        if ours:
            os.close(fd)


def _after_fork_in_child() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    if _served:
        _close_services_sockets()
        _served.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
