"""The blocking faces stay in step with the async ones (httpcore's ``unasync --check`` idea).

Every public coroutine method of ``AsyncClient`` has a blocking twin on ``Client`` with the
same parameters (names, kinds, defaults) whose docstring points at the async one, so a new
argument or method added to one side fails here until the other side has it too. The torch
dataset takes exactly the async dataset's constructor arguments.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import tq_async as tq

#: async name -> blocking name, where they differ on purpose
RENAMED = {"aclose": "close"}


def _coroutine_methods(cls: type) -> list[str]:
    return sorted(
        name
        for name, fn in inspect.getmembers(cls)
        if not name.startswith("_") and inspect.iscoroutinefunction(fn)
    )


def _parameters(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", _coroutine_methods(tq.AsyncClient))
def test_every_async_method_has_a_blocking_twin(name: str) -> None:
    twin = getattr(tq.Client, RENAMED.get(name, name), None)
    assert twin is not None, f"Client has no blocking twin of AsyncClient.{name}"
    assert not inspect.iscoroutinefunction(twin), f"Client.{name} must block, not be async"
    assert _parameters(twin) == _parameters(getattr(tq.AsyncClient, name)), (
        f"Client.{name} and AsyncClient.{name} take different parameters"
    )
    doc = inspect.getdoc(twin) or ""
    if name not in RENAMED and name != "open":
        assert f"AsyncClient.{name}`" in doc, (
            f"Client.{name}'s docstring should point at :meth:`AsyncClient.{name}`"
        )


def test_the_torch_dataset_takes_the_async_datasets_arguments() -> None:
    a = _parameters(tq.AsyncStreamingDataset.__init__)
    s = _parameters(tq.StreamingDataset.__init__)
    assert a == s


@pytest.mark.parametrize(
    "face",
    [tq.AsyncClient.connect, tq.Client.__init__, tq.Client.connect],
    ids=["AsyncClient.connect", "Client.__init__", "Client.connect"],
)
def test_every_way_to_make_a_client_takes_the_same_options(face: Any) -> None:
    def options(fn: Any) -> list[tuple[str, Any, Any]]:
        return [p for p in _parameters(fn) if p[0] not in ("self", "cls")]

    assert options(face) == options(tq.AsyncClient.__init__)


def test_the_blocking_client_hands_every_option_to_its_async_client() -> None:
    names = [p[0] for p in _parameters(tq.AsyncClient.__init__)[2:]]  # after self, address
    client = tq.Client("tcp://127.0.0.1:1")
    assert sorted(client._kwargs) == sorted(names)
