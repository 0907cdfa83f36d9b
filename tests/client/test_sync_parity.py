"""The blocking faces stay in step with the async ones (httpcore's ``unasync --check``).

``Client`` is generated from ``AsyncClient``'s code (``scripts/unasync.py``): the generated
modules must be what the async sources give today, and every public coroutine method of
``AsyncClient`` has a blocking twin on ``Client`` with the same parameters (names, kinds,
defaults) and the same docstring (rewritten for blocking calls). The torch dataset takes
exactly the async dataset's constructor arguments.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import re
import sys
import typing
from typing import Any

import pytest

import tq_async as tq

#: async name -> blocking name, where they differ on purpose
RENAMED = {"aclose": "close"}

_spec = importlib.util.spec_from_file_location(
    "unasync", pathlib.Path(__file__).parents[2] / "scripts" / "unasync.py"
)
assert _spec is not None
assert _spec.loader is not None
unasync = importlib.util.module_from_spec(_spec)
sys.modules["unasync"] = unasync
_spec.loader.exec_module(unasync)


def test_the_generated_blocking_client_is_current() -> None:
    stale = [
        target
        for source, target in unasync.FILES.items()
        if (unasync.PACKAGE / target).read_text() != unasync.generate(source, target)
    ]
    assert not stale, f"run `python scripts/unasync.py`: {stale} are out of date"


def _unasynced(doc: str) -> str:
    for pattern, repl in unasync.REPLACEMENTS:
        doc = re.sub(pattern, repl, doc)
    return doc


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
    assert doc, f"Client.{name} has no docstring"
    assert doc == _unasynced(inspect.getdoc(getattr(tq.AsyncClient, name)) or ""), (
        f"Client.{name}'s docstring is not AsyncClient.{name}'s"
    )


def test_the_torch_dataset_takes_the_async_datasets_arguments() -> None:
    a = _parameters(tq.AsyncStreamingDataset.__init__)
    s = _parameters(tq.StreamingDataset.__init__)
    assert a == s


@pytest.mark.parametrize("cls", [tq.AsyncClient, tq.Client], ids=lambda c: c.__name__)
def test_the_connection_options_are_one_typed_object(cls: type) -> None:
    # the constructor spells each option once, with its default; ClientOptions types the
    # same names the same way, and connect() takes exactly those (Unpack)
    init = inspect.signature(cls.__init__).parameters
    options = {n: p for n, p in init.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    hints = typing.get_type_hints(cls.__init__)
    typed = typing.get_type_hints(tq.ClientOptions)
    assert list(typed) == list(options)
    assert all(typed[n] == hints[n] for n in options)
    (kwargs,) = [
        p
        for p in inspect.signature(cls.connect).parameters.values()
        if p.kind is inspect.Parameter.VAR_KEYWORD
    ]
    connect_hints = typing.get_type_hints(cls.connect)
    assert connect_hints[kwargs.name] == typing.Unpack[tq.ClientOptions]


@pytest.mark.parametrize("cls", [tq.AsyncClient, tq.Client], ids=lambda c: c.__name__)
def test_the_clients_docstring_gives_each_options_default(cls: type) -> None:
    """`ClientOptions` sends readers to "the client's docstring" for "each one's meaning and
    default": every option's entry there says its default."""
    doc = inspect.getdoc(cls) or ""
    args = doc[doc.index("Args:") : doc.index("Attributes:")]
    entries = dict(re.findall(r"^    (\w+): (.*?)(?=^    \w+: |\Z)", args, re.M | re.S))
    options = typing.get_type_hints(tq.ClientOptions)
    assert [n for n in options if "default" not in entries.get(n, "").lower()] == []


def test_the_blocking_client_is_the_async_clients_code_not_a_wrapper() -> None:
    # one source of truth: the twin's classes are generated, not a portal around AsyncClient
    client = tq.Client("tcp://127.0.0.1:1")
    assert not hasattr(client, "_async")
    assert [c.__name__ for c in type(client).__mro__] == [
        c.__name__.replace("AsyncClient", "Client") for c in tq.AsyncClient.__mro__
    ]
