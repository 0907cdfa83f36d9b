"""Every public name is exported once, documented, and every error pickles (DataLoader)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pickle
import re
from pathlib import Path

import msgspec
import pytest

import tq_async
import tq_async.compat
import tq_async.events
import tq_async.lowlevel
import tq_async.samplers


@pytest.mark.parametrize(
    "module",
    [tq_async, tq_async.samplers, tq_async.compat, tq_async.lowlevel, tq_async.events],
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


@pytest.mark.parametrize("module", [tq_async, tq_async.compat], ids=lambda m: m.__name__)
def test_public_records_document_every_field(module: object) -> None:
    """The API reference shows a record's fields from its docstring's ``Attributes``: one
    left out there is invisible to readers (``LocalCluster.metrics_url``, the CURVE keys)."""
    undocumented = {}
    for name in module.__all__:  # type: ignore[attr-defined]
        cls = getattr(module, name)
        if dataclasses.is_dataclass(cls):
            fields = [f.name for f in dataclasses.fields(cls)]
        elif inspect.isclass(cls) and issubclass(cls, msgspec.Struct):
            fields = list(cls.__struct_fields__)
        else:
            continue
        doc = inspect.getdoc(cls) or ""
        missing = [f for f in fields if not f.startswith("_") and not re.search(rf"\b{f}\b", doc)]
        if missing:
            undocumented[name] = missing
    assert undocumented == {}


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
        "CheckpointNotFoundError",
        "Client",
        "ClientOptions",
        "ClosedError",
        "Config",
        "ConfigError",
        "CurveClient",
        "CurveSection",
        "CurveServer",
        "Deadlines",
        "DeviceError",
        "GRPOGroupNSampler",
        "InvalidRequestError",
        "KVListing",
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
        "SessionLostError",
        "StaleRows",
        "StalenessSampler",
        "StateLostError",
        "StorageFullError",
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
        "transfer_collector",
    ]
    for name in tq_async.lowlevel.__all__:
        assert inspect.getdoc(getattr(tq_async.lowlevel, name)), f"{name} has no docstring"


def test_the_lazy_names_are_the_type_checkers_names() -> None:
    """``tq_async`` imports its names but the errors on first use (``_LAZY``), and shows them
    to type checkers and the API reference under ``if TYPE_CHECKING:``: both say the same
    module for the same names, and every public name is one or the other."""
    tree = ast.parse(Path(tq_async.__file__).read_text())
    checked = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    declared = {
        alias.name: "." * node.level + (node.module or "")
        for node in checked.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert declared == tq_async._LAZY
    eager = {n for n in tq_async.__all__ if n in vars(tq_async) and n not in tq_async._LAZY}
    assert eager | set(tq_async._LAZY) == set(tq_async.__all__)
    assert all(issubclass(getattr(tq_async, n), tq_async.TQError) for n in eager)


@pytest.mark.parametrize("name", ["ColumnHeader", "ControllerServer", "ControllerState"])
def test_moved_names_still_resolve_with_a_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"from tq_async.lowlevel import {name}"):
        value = getattr(tq_async, name)
    assert value is getattr(tq_async.lowlevel, name)
    assert name not in dir(tq_async)


def _all_errors(cls: type[tq_async.TQError]) -> list[type[tq_async.TQError]]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _all_errors(sub))]


@pytest.mark.parametrize("cls", _all_errors(tq_async.TQError), ids=lambda c: c.__name__)
def test_every_error_crosses_the_wire_as_itself(cls: type[tq_async.TQError]) -> None:
    from tq_async._errors import error_from_wire
    from tq_async._wire._protocol import Reply, decode_error_payload, error_reply

    reply = msgspec.msgpack.decode(error_reply(7, cls("what happened; what to do")), type=Reply)
    again = error_from_wire(*decode_error_payload(reply.payload))
    assert type(again) is cls
    assert str(again) == "what happened; what to do"
    assert type(pickle.loads(pickle.dumps(again))) is cls


def test_an_unknown_error_kind_becomes_a_tq_error_naming_it() -> None:
    from tq_async._errors import error_from_wire

    err = error_from_wire("MysteryError", "boom")
    assert type(err) is tq_async.TQError
    assert str(err) == "MysteryError: boom"


def test_the_api_reference_page_shows_every_public_name() -> None:
    """docs/api.md promises "every public name, from its docstring": each of
    ``tq_async.__all__`` has its ``::: tq_async.NAME`` entry there."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    shown = set(re.findall(r"^::: tq_async\.(\w+)\s*$", page, re.MULTILINE))
    assert sorted(set(tq_async.__all__) - shown) == []
