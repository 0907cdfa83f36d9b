"""Every public name is exported once, documented, and every error pickles (DataLoader)."""

from __future__ import annotations

import inspect
import pickle

import pytest

import tq_async
import tq_async.compat
import tq_async.samplers


@pytest.mark.parametrize(
    "module", [tq_async, tq_async.samplers, tq_async.compat], ids=lambda m: m.__name__
)
def test_all_is_complete_unique_and_documented(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert len(names) == len(set(names))
    public = {n for n in dir(module) if not n.startswith("_") and n not in ("annotations",)}
    submodules = {n for n in public if inspect.ismodule(getattr(module, n))}
    assert set(names) == public - submodules
    for name in names:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"


def test_public_methods_are_documented() -> None:
    for cls in (
        tq_async.AsyncClient,
        tq_async.Client,
        tq_async.BatchMeta,
        tq_async.BackgroundCluster,
        tq_async.compat.TransferQueueClient,
        tq_async.compat.BatchMeta,
        tq_async.compat.KVBatchMeta,
    ):
        for name, member in inspect.getmembers(cls):
            if name.startswith("_") or not callable(member):
                continue
            assert inspect.getdoc(member), f"{cls.__name__}.{name} has no docstring"


def test_errors_share_one_root_and_pickle() -> None:
    errors = [
        obj
        for obj in vars(tq_async).values()
        if inspect.isclass(obj) and issubclass(obj, BaseException)
    ]
    assert tq_async.TQError in errors
    for cls in errors:
        assert issubclass(cls, tq_async.TQError)
        exc = cls("what happened; what to do")
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is cls
        assert str(again) == "what happened; what to do"
    assert issubclass(tq_async.TQTimeoutError, TimeoutError)
