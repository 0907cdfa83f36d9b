"""Optional CURVE encryption and authentication for every tq_async socket.

Set-up (one keypair for the services of a deployment, one per client identity):

    server_public, server_secret = tq.curve_keypair()
    client_public, client_secret = tq.curve_keypair()

    server = tq.CurveServer(server_public, server_secret, allowed_clients=[client_public])
    async with tq.local_cluster(curve=server) as cluster: ...
    client = tq.AsyncClient.connect(
        cluster.address, curve=tq.CurveClient(server_public, client_public, client_secret)
    )

Keys are Z85 text (40 characters), as ``zmq.curve_keypair()`` makes them; keep secret keys out
of source control (files readable by the service user only, or a secret store). With
``allowed_clients=None`` any client that knows the server's public key may connect (the
traffic is still encrypted); otherwise a ZAP handler admits only the listed public keys (one
handler per process: services of one process share the union of their allow-lists). A
client with a wrong or missing key never completes the handshake: opening it fails with
`AuthenticationError` (a `BrokenError`) saying which key
to check.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq
from zmq.auth.thread import ThreadAuthenticator

from .._errors import InvalidRequestError
from .._logging import get_logger

__all__ = ["CurveClient", "CurveServer", "curve_keypair"]

log = get_logger(__name__)

_DOMAIN = "tq_async"
#: Once a ZAP handler runs in a context, libzmq asks it about every CURVE socket, so servers
#: without an allow-list get a domain of their own that admits any key.
_DOMAIN_ANY = "tq_async_any"


def curve_keypair() -> tuple[bytes, bytes]:
    """A new ``(public, secret)`` CURVE keypair in Z85 text form."""
    if not zmq.has("curve"):  # pragma: no cover - libzmq built without libsodium
        raise InvalidRequestError("this libzmq has no CURVE support; install pyzmq wheels")
    public, secret = zmq.curve_keypair()
    return public, secret


def _key(value: bytes | str, what: str) -> bytes:
    key = value.encode() if isinstance(value, str) else bytes(value)
    if len(key) != 40:
        raise InvalidRequestError(f"{what} must be a 40-character Z85 CURVE key, got {len(key)}")
    return key


@dataclass(frozen=True)
class CurveClient:
    """What a client (or the controller, towards the units) needs to reach CURVE services.

    Attributes:
        server_public_key: the services' public key (40-character Z85 text).
        public_key: this client's public key; with an allow-list it must be on it.
        secret_key: this client's secret key.
    """

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "server_public_key", _key(self.server_public_key, "server key"))
        object.__setattr__(self, "public_key", _key(self.public_key, "client public key"))
        object.__setattr__(self, "secret_key", _key(self.secret_key, "client secret key"))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Configure a connecting socket."""
        sock.curve_serverkey = self.server_public_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key


@dataclass(frozen=True)
class CurveServer:
    """A service keypair and, optionally, the client public keys allowed in.

    Attributes:
        public_key: the services' public key (40-character Z85 text), which clients pass
            as ``server_public_key``; every service of a cluster uses the same keypair.
        secret_key: the services' secret key.
        allowed_clients: the public keys of the clients let in (None: any client that
            knows ``public_key``; the traffic is still encrypted).
    """

    public_key: bytes
    secret_key: bytes
    allowed_clients: Sequence[bytes] | None = None
    _allowed: frozenset[bytes] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _key(self.public_key, "server public key"))
        object.__setattr__(self, "secret_key", _key(self.secret_key, "server secret key"))
        if self.allowed_clients is not None:
            allowed = {_key(k, "allowed client key") for k in self.allowed_clients}
            allowed.add(self.public_key)  # the controller talks to units with the service key
            object.__setattr__(self, "_allowed", frozenset(allowed))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Configure a binding socket (and the process's ZAP handler, if clients are listed)."""
        sock.curve_server = True
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        _Zap.allow(sock.context, self._allowed)
        sock.zap_domain = (_DOMAIN if self.allowed_clients is not None else _DOMAIN_ANY).encode()

    def as_client(self) -> CurveClient:
        """The identity services use to talk to each other (the service keypair itself)."""
        return CurveClient(self.public_key, self.public_key, self.secret_key)


class _Zap:
    """One ZAP authenticator per ZMQ context, admitting the union of allowed keys."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _by_context: ClassVar[dict[int, tuple[ThreadAuthenticator, set[bytes]]]] = {}

    @classmethod
    def allow(cls, context: zmq.Context[Any], keys: frozenset[bytes]) -> None:
        with cls._lock:
            entry = cls._by_context.get(id(context))
            if entry is None:
                auth = ThreadAuthenticator(context)
                auth.start()
                allowed: set[bytes] = set()

                def check(domain: str, key: bytes) -> bool:
                    ok = key in allowed  # pyzmq passes the client key in Z85 form
                    if not ok:
                        log.warning("rejected a client key", domain=domain)
                    return ok

                auth.configure_curve_callback(_DOMAIN, credentials_provider=_Provider(check))
                auth.configure_curve_callback(
                    _DOMAIN_ANY, credentials_provider=_Provider(lambda _d, _k: True)
                )
                entry = cls._by_context[id(context)] = (auth, allowed)
            entry[1].update(keys)


class _Provider:
    """pyzmq's credentials-provider protocol: ``callback(domain, key) -> bool``."""

    def __init__(self, check: Any) -> None:
        self._check = check

    def callback(self, domain: str, key: bytes) -> bool:
        return bool(self._check(domain, key))
