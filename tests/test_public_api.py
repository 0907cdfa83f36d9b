"""Every public name is exported once, documented, and every error pickles (DataLoader)."""

from __future__ import annotations

import inspect
import pickle

import pytest

import tq_async
import tq_async.compat
import tq_async.lowlevel
import tq_async.samplers


@pytest.mark.parametrize(
    "module",
    [tq_async, tq_async.samplers, tq_async.compat, tq_async.lowlevel],
    ids=lambda m: m.__name__,
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


def test_the_public_names_are_pinned() -> None:
    """Adding or removing a public name is a decision: change this list with the CHANGELOG."""
    assert sorted(tq_async.__all__) == [
        "AdmissionConfig",
        "AdmissionSection",
        "AsyncClient",
        "AsyncStreamingDataset",
        "AuthenticationError",
        "BackgroundCluster",
        "BaseSampler",
        "BatchMeta",
        "BrokenError",
        "CheckpointError",
        "Client",
        "ClosedError",
        "Config",
        "ConfigError",
        "CurveClient",
        "CurveSection",
        "CurveServer",
        "Deadlines",
        "GRPOGroupNSampler",
        "InvalidRequestError",
        "KeyNotFound",
        "LocalCluster",
        "PartitionNotFound",
        "ProtocolError",
        "RankAwareSampler",
        "RowsNotFound",
        "SamplerSpec",
        "SchemaError",
        "SeqlenBalancedSampler",
        "SequentialSampler",
        "StaleRows",
        "StalenessSampler",
        "StreamingDataLoader",
        "StreamingDataset",
        "TQError",
        "TQTimeoutError",
        "UnsupportedTypeError",
        "WouldBlock",
        "background_cluster",
        "checkpoint_metadata",
        "chunk_batch_fn",
        "configure_logging",
        "curve_keypair",
        "default_fetch_batch_fn",
        "get_seqlen_balanced_partitions",
        "karmarkar_karp",
        "local_cluster",
    ]
    assert sorted(tq_async.lowlevel.__all__) == [
        "ColumnHeader",
        "ControllerCore",
        "ControllerServer",
        "ControllerState",
        "StorageServer",
        "serve_controller",
        "serve_storage",
    ]
    for name in tq_async.lowlevel.__all__:
        assert inspect.getdoc(getattr(tq_async.lowlevel, name)), f"{name} has no docstring"


@pytest.mark.parametrize("name", ["ColumnHeader", "ControllerServer", "ControllerState"])
def test_moved_names_still_resolve_with_a_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"from tq_async.lowlevel import {name}"):
        value = getattr(tq_async, name)
    assert value is getattr(tq_async.lowlevel, name)
    assert name not in dir(tq_async)
