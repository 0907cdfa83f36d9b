"""``ClientOptions``: the connection options of both clients, typed once."""

from __future__ import annotations

from typing import TypedDict

from .._transport._security import CurveClient

__all__ = ["ClientOptions"]


class ClientOptions(TypedDict, total=False):
    """The connection options `AsyncClient` and `Client`
    take (``connect(address, **options)``), each optional; the client's docstring gives
    each one's meaning and default. Typing a dict of options with it lets a type checker
    check them where they are built:

        options: tq.ClientOptions = {"request_timeout": 5.0, "same_host": False}
        with tq.Client.connect(address, **options) as client: ...
    """

    request_timeout: float
    connect_timeout: float
    allow_pickle: bool | None
    curve: CurveClient | None
    retry_after: float | None
    inline_put_bytes: int
    inline_get_bytes: int
    shared_memory: bool
    same_host: bool
    busy_poll: float
    data_path: str
    host_id: str | None
