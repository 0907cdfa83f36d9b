"""A same-host control transport without ZMQ's I/O threads: a Unix stream socket.

A request over ZMQ crosses six thread wake-ups on this path: client loop -> client I/O
thread -> kernel -> service I/O thread -> service loop, and back. Profiled in process mode
(``benchmarks/RESULTS.md``), the service spent ~30% of its wall time inside ``Socket.send``
(waking its I/O thread on a 2-core box) and both loops idled most of the time. Over a plain
Unix socket read and written from the event loops themselves, a round trip wakes two threads.

The wire: each message is ``u32 length`` + ``u32 n_frames`` + ``n_frames x u32 frame length``
+ the frames. A connection's first message is ``[b"TQU1", identity]``: like a ZMQ DEALER
identity, it stays the same across reconnects, so the service recognises retried requests.
The address is an abstract socket (``uds://@name``: no file, gone with its process).

`UnixSocket` mimics the few ``zmq.Socket`` calls the reader in
`tq_async._transport._router`
and `tq_async._transport._dealer` make, so a connection reuses the request machinery unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import os
import resource
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from .._logging import get_logger
from ._endpoints import READS, LogThrottle
from ._inherited import serving, stopped_serving

__all__ = ["HELLO", "MessageStream", "UnixListener", "UnixSocket", "abstract_name"]

log = get_logger(__name__)

HELLO = b"TQU1"
_U32 = struct.Struct("<I")
_POLLIN = int(zmq.POLLIN)  # a plain int: the reader's ``events & POLLIN`` stays cheap
#: the largest message the wire's ``u32 length`` can say (ZMQ carries any size: so does this,
#: but for what a u32 holds)
MAX_MESSAGE = 0xFFFFFFFF
#: a client's first message (its hello) larger than this is refused (the connection is
#: dropped): garbage from something that is no tq_async client costs no big buffer
HELLO_MAX = 1024
#: read size for small messages; a larger message's body is received into its own buffer
_CHUNK = 1 << 16
#: a Unix socket's kernel buffer limits (bytes queued per direction before a writer waits).
#: The kernel allocates them only for bytes in flight, so an idle connection costs none of
#: it; set on purpose rather than inherited from ``net.core.wmem_default`` (208 KiB on most
#: hosts): control messages are small, and large columns travel through shared memory or,
#: when they do not, simply wait for the reader (the writer keeps views, never copies)
SOCKET_BUFFER = 256 << 10
#: connections waiting to be accepted. Thousands of clients start at once (a job's ranks
#: and DataLoader workers); the kernel caps it at ``net.core.somaxconn`` (4,096 by default)
BACKLOG = 4096


class _Scratch(threading.local):
    """The read buffer of one thread: every connection read on it shares one.

    A buffer per connection cost 64 KiB of the service's memory per idle client (four units
    on one serve: 256 KiB). Reads copy what arrived out of it at once (into the stream's
    pending bytes), so one per thread suffices.
    """

    def __init__(self) -> None:
        self.chunk = memoryview(bytearray(_CHUNK))


_scratch = _Scratch()

#: accepted connections after which the listener gives freed heap back (see trim_heap)
_TRIM_AFTER = 128
#: seconds after such a burst of connections (coalesced: one trim per burst)
_TRIM_DELAY = 2.0
_malloc_trim: Any = None


def trim_heap() -> None:
    """Return the heap's free pages to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    A same-host client first reaches a service over TCP, then moves to its Unix socket and
    closes the TCP connection. ZMQ's buffers for those short-lived connections are freed but
    stay resident in its I/O thread's heap: measured with 400 clients, 40 KB of the
    services' RSS per client, 5 KB once trimmed. So after a burst of new connections the
    listener trims once, on the loop: ~50 ms with 150 MB freed in 50,000 holes, microseconds
    when there is nothing to give back; at most once per burst of connections.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
        except (OSError, AttributeError, TypeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def abstract_name(address: str) -> str:
    """``uds://@name`` -> the socket address of the abstract name."""
    if not address.startswith("uds://@"):
        raise ValueError(f"not an abstract Unix socket address: {address!r}")
    return "\0" + address[len("uds://@") :]


class Frame:
    """A received frame's header view, shaped like ``zmq.Frame`` (``.buffer``, ``.bytes``)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer

    @property
    def bytes(self) -> bytes:
        return self.buffer.tobytes()


def encode(frames: Sequence[Any]) -> list[Any]:
    """Buffers to write for one message (no copy of the frames)."""
    views = [memoryview(f).cast("B") for f in frames]
    sizes = [v.nbytes for v in views]
    size = 4 + 4 * len(sizes) + sum(sizes)
    if size > MAX_MESSAGE:  # (the wire says it in 32 bits; ZMQ's has no such limit)
        raise zmq.ZMQError(
            zmq.EMSGSIZE,
            f"a message of {size} bytes is over the same-host socket's limit "
            f"({MAX_MESSAGE} bytes, 4 GiB)",
        )
    head = struct.pack(f"<II{len(sizes)}I", size, len(sizes), *sizes)
    return [head, *views]


#: a peer that is gone fails the write (EPIPE) without SIGPIPE, which kills a process that
#: does not ignore it (Python does; a program may set it back to its default)
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


class MessageStream:
    """Non-blocking message I/O on a connected stream socket.

    Small messages are read in chunks and split; the body of a large one is received straight
    into a buffer of its own (one copy, as ZMQ does). Writes hand the frames to ``sendmsg``
    without joining them; what the socket does not take at once waits as views.
    """

    __slots__ = ("_big", "_got", "_in", "_out", "eof", "limit", "messages", "sock")

    def __init__(self, sock: socket.socket, first_limit: int = MAX_MESSAGE) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        self.sock = sock
        self._in = bytearray()
        self._big: bytearray | None = None  # the body of a large message being received
        self._got = 0
        self._out: deque[memoryview] = deque()  # not written yet (the socket was full)
        self.messages: deque[list[Any]] = deque()
        self.eof = False
        #: the largest message taken (``first_limit`` until the first one arrived)
        self.limit = first_limit

    def fill(self) -> None:
        """Read what the socket has and split it into messages."""
        chunk = _scratch.chunk
        while not self.eof:
            try:
                if self._big is not None:
                    n = self.sock.recv_into(memoryview(self._big)[self._got :])
                    if n == 0:
                        self.eof = True
                        break
                    self._got += n
                    if self._got == len(self._big):
                        self._message(self._big)
                        self._big = None
                    continue
                got = self.sock.recv_into(chunk)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.eof = True
                break
            if not got:
                self.eof = True
                break
            self._in += chunk[:got]
            self._parse()
            if got < _CHUNK:  # the socket had no more: no second recv to find out
                break  # (its FD stays readable, level-triggered, if more arrives meanwhile)

    def _parse(self) -> None:
        buf = self._in
        pos = 0
        while len(buf) - pos >= 4 and not self.eof:
            (size,) = _U32.unpack_from(buf, pos)
            if size > self.limit or size < 4:
                log.warning("dropped a connection that sent a malformed frame", size=size)
                self.eof = True
                break
            have = len(buf) - pos - 4
            if have < size:
                if size > _CHUNK:  # receive the rest straight into its own buffer
                    self._big = bytearray(size)
                    self._big[:have] = buf[pos + 4 :]
                    self._got = have
                    pos = len(buf)
                break
            msg = buf[pos + 4 : pos + 4 + size]  # a buffer of its own (writable)
            pos += 4 + size
            self._message(msg)
        if pos:
            del buf[:pos]

    def _message(self, msg: bytearray) -> None:
        frames = _split(msg)
        if frames is None:
            log.warning("dropped a connection that sent a malformed message")
            self.eof = True
            return
        self.messages.append(frames)
        self.limit = MAX_MESSAGE

    def write(self, frames: Sequence[Any], on_blocked: Callable[[], None]) -> None:
        """Write one message; what does not fit now waits for `flush`."""
        parts = [memoryview(p).cast("B") for p in encode(frames)]
        if self._out:
            self._out.extend(parts)
            return
        try:
            sent = self.sock.sendmsg(parts, (), _NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, f"the peer went away: {exc}") from exc
        for p in parts:
            if sent >= p.nbytes:
                sent -= p.nbytes
                continue
            self._out.append(p[sent:])
            sent = 0
        if self._out:
            on_blocked()

    @property
    def blocked(self) -> bool:
        """Bytes of an earlier write still wait for room in the socket."""
        return bool(self._out)

    def flush(self) -> bool:
        """Write pending bytes; True when nothing is left."""
        out = self._out
        while out:
            try:
                sent = self.sock.sendmsg(list(itertools.islice(out, 64)), (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                self.eof = True
                out.clear()
                return True
            while sent and out:
                if sent >= out[0].nbytes:
                    sent -= out.popleft().nbytes
                else:
                    out[0] = out[0][sent:]
                    sent = 0
        return True


def _split(msg: bytearray) -> list[Any] | None:
    if len(msg) < 4:
        return None
    (n,) = _U32.unpack_from(msg, 0)
    if n < 1 or 4 + 4 * n > len(msg):
        return None
    sizes = struct.unpack_from(f"<{n}I", msg, 4)
    view = memoryview(msg)
    pos = 4 + 4 * n
    if pos + sum(sizes) != len(msg):
        return None
    frames: list[Any] = []
    for size in sizes:
        frames.append(view[pos : pos + size])
        pos += size
    frames[0] = Frame(frames[0])
    return frames


class UnixSocket:
    """A client's connected socket, answering the ``zmq.Socket`` calls the reader makes.

    ``getsockopt(zmq.EVENTS)`` reads what arrived and reports ``POLLIN`` while a whole
    message waits; the end of the stream calls ``on_eof`` once (a broken connection).
    """

    #: its FD is readable while bytes wait (a reader need not look again after a send)
    level_triggered = True

    def __init__(self, address: str, identity: bytes, on_eof: Callable[[], None]) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Non-blocking before connecting: a Unix socket's connect completes at once while
        # the listener's queue has room, and blocks -- the whole event loop -- when it is
        # full; then it fails with EAGAIN instead and the caller uses the socket it has.
        sock.setblocking(False)
        try:
            sock.connect(abstract_name(address))
        except BlockingIOError as exc:
            sock.close()
            raise OSError(exc.errno, "the service's listen queue is full") from exc
        except OSError:
            sock.close()
            raise
        self._loop = asyncio.get_running_loop()
        self._stream = MessageStream(sock)
        self._on_eof: Callable[[], None] | None = on_eof
        self._writing = False
        self._stream.write([HELLO, identity], self._blocked)

    def _blocked(self) -> None:
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self.fileno(), self._flush)

    def _flush(self) -> None:
        if self._stream.flush():
            self._writing = False
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self.fileno())

    def fileno(self) -> int:
        return self._stream.sock.fileno()

    def getsockopt(self, option: int) -> int:
        if option == zmq.FD:
            return self.fileno()
        if option == zmq.EVENTS:
            self._stream.fill()
            if self._stream.eof and not self._stream.messages and self._on_eof is not None:
                on_eof, self._on_eof = self._on_eof, None
                on_eof()
            return _POLLIN if self._stream.messages else 0
        raise ValueError(f"unsupported option {option}")

    def take_messages(self) -> list[list[Any]]:
        """Every whole message that arrived, in one read (a reader that takes them this way
        does not read the socket again to learn that nothing more waits: its FD is
        level-triggered); the end of the stream calls ``on_eof`` as `getsockopt` does."""
        stream = self._stream
        stream.fill()
        messages = stream.messages
        if messages:
            taken = list(messages)
            messages.clear()
            return taken
        if stream.eof and self._on_eof is not None:
            on_eof, self._on_eof = self._on_eof, None
            on_eof()
        return []

    def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        if not self._stream.messages:
            raise zmq.Again()
        return self._stream.messages.popleft()

    def send_multipart(self, frames: Sequence[Any], flags: int = 0, copy: bool = True) -> None:
        if self._stream.eof:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, "the connection is closed")
        self._stream.write(frames, self._blocked)

    def close(self, linger: int | None = None) -> None:
        self._on_eof = None
        if self._writing:
            self._writing = False
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self.fileno())
        self._stream.sock.close()


class UnixListener:
    """A service's listening socket: accepts clients and hands their messages on.

    Args:
        name: the abstract socket name (without the leading ``@``).
        loop: the service's event loop.
        on_message: ``on_message(identity, frames)`` for every request.
        on_gone: ``on_gone(identity)`` when a client's connection ends (its process exited or
            was killed, or it closed it; not when another connection took its identity
            over, nor when the listener closes): its requests still waiting failed on its
            side, so nobody will read their replies.
    """

    def __init__(
        self,
        name: str,
        loop: Any,
        on_message: Callable[[bytes, list[Any]], None],
        on_gone: Callable[[bytes], None] | None = None,
    ) -> None:
        self.address = f"uds://@{name}"
        self._loop = loop
        self._on_message = on_message
        self._on_gone = on_gone
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + name)
            self._sock.listen(BACKLOG)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        serving(self.address)  # a forked child closes its copies of the socket and clients
        self._peers: dict[bytes, _Peer] = {}
        self._all: set[_Peer] = set()
        self._accepted = 0  # since the last heap trim
        #: a descriptor kept in reserve to refuse clients once the limit is reached
        self._spare: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._refused = 0
        self._throttle = LogThrottle()
        self._trim: asyncio.TimerHandle | None = None
        loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._refuse_one():
                    continue
                log.warning("accept failed", error=str(exc))
                break
            self._all.add(_Peer(self, conn))
            self._accepted += 1
        if self._accepted >= _TRIM_AFTER:
            if self._trim is not None:
                self._trim.cancel()
            self._trim = self._loop.call_later(_TRIM_DELAY, self._trim_heap)

    def _refuse_one(self) -> bool:
        """Out of file descriptors: accept one waiting client on the spare descriptor and
        close it at once, so that it learns now (its connection ends) instead of waiting for
        a reply that cannot come; a same-host client then stays on TCP. Without this the
        queued connection stays readable and the loop retries the accept forever."""
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            conn, _ = self._sock.accept()
            conn.close()
            refused = True
        except OSError:
            refused = False
        with contextlib.suppress(OSError):
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._refused += 1
        self._throttle.warning(
            "out of file descriptors: refused a client's Unix-socket connection; raise the "
            "service's RLIMIT_NOFILE (docs/deployment.md, 'Many clients')",
            refused=self._refused,
            limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        )
        return refused

    def _trim_heap(self) -> None:
        self._trim = None
        self._accepted = 0
        t0 = time.perf_counter()
        trim_heap()
        ms = (time.perf_counter() - t0) * 1e3
        log.debug("trimmed the heap after a burst of connections", ms=ms)

    def has(self, identity: bytes) -> bool:
        return identity in self._peers

    def send(self, identity: bytes, frames: Sequence[Any]) -> None:
        peer = self._peers.get(identity)
        if peer is None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH, "no such peer")
        try:
            peer.send(frames)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EMSGSIZE:
                # a reply this socket cannot carry: the client learns now (its connection
                # ends) rather than at its timeout, and may ask again over TCP
                log.warning("dropped a client: its reply is too big for its socket", error=str(exc))
                peer.close()
            raise

    def close(self) -> None:
        self._on_gone = None  # the service is going: its own clients are not gone
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._sock.fileno())
        if self._sock.fileno() >= 0:
            stopped_serving(self.address)
        self._sock.close()
        for peer in list(self._all):
            peer.close()


class _Peer:
    def __init__(self, listener: UnixListener, sock: socket.socket) -> None:
        self._listener = listener
        self._stream = MessageStream(sock, first_limit=HELLO_MAX)
        self._fd = sock.fileno()
        self.identity: bytes | None = None
        self._writing = False
        listener._loop.add_reader(self._fd, self._read)

    def _read(self) -> None:
        READS.read(self._take)

    def _take(self) -> None:
        stream = self._stream
        stream.fill()
        while stream.messages:
            frames = stream.messages.popleft()
            if self.identity is None:
                if len(frames) != 2 or frames[0].bytes != HELLO:
                    self.close()
                    return
                self.identity = bytes(frames[1])
                # a client that reconnects with its identity takes it over (retries)
                self._listener._peers[self.identity] = self
                continue
            try:
                self._listener._on_message(self.identity, frames)
            except Exception:  # a handler bug must not kill the reader
                log.exception("message handler failed")
        if stream.eof:
            self.close()

    def send(self, frames: Sequence[Any]) -> None:
        self._stream.write(frames, self._blocked)

    def _blocked(self) -> None:
        if not self._writing:
            self._writing = True
            self._listener._loop.add_writer(self._fd, self._flush)

    def _flush(self) -> None:
        if self._stream.flush():
            self._writing = False
            with contextlib.suppress(Exception):
                self._listener._loop.remove_writer(self._fd)

    def close(self) -> None:
        listener = self._listener
        listener._all.discard(self)
        if self.identity is not None and listener._peers.get(self.identity) is self:
            del listener._peers[self.identity]
            if listener._on_gone is not None:
                listener._on_gone(self.identity)
        with contextlib.suppress(Exception):
            listener._loop.remove_reader(self._fd)
        if self._writing:
            with contextlib.suppress(Exception):
                listener._loop.remove_writer(self._fd)
        self._stream.sock.close()
