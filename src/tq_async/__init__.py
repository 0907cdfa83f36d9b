"""tq_async: an asyncio-native streaming data plane for RL post-training.

Producers ``put`` fields of samples into partitions, a controller tracks which fields each
sample has and which task consumed it, samplers decide what each consumer gets, and
consumers stream ready batches. See the README for a tour.

Layers, lowest first, one folder each (a module imports its own layer and the ones below,
never above; ``tests/project/test_layering.py`` checks it, and that no modules import each other
in a circle):

1. **vocabulary**: errors (``_errors``), logging (``_logging``), the services' loop registry
   and portal (``_portal``), the clients' concurrency primitives (``_primitives``, blocking
   ``_sync_primitives``), ``BatchMeta`` (``_meta``), the wire's vocabulary in ``_wire/``
   (control messages ``_protocol``, columns as bytes ``_columns``, tensors <-> columns
   ``_codec``: pure functions and msgspec records, no I/O) and the samplers (``samplers/``).
2. **core**: ``_core/``, the controller's state (``_state``, ready sets ``_ready``) and its
   pure state machine (``_transitions``, composing the get path ``_gets`` with its leases
   ``_leases`` and sampler calls ``_sampling``, ``_put_leases``, ``_admission``,
   ``_liveness`` and ``_catalog``; records in ``_effects``): every transition takes ``now``
   and returns effects; no loop, socket or clock.
3. **transport**: moving frames, ``_transport/`` (addresses ``_endpoints``, the services'
   ROUTER ``_router``, the clients' connection core ``_connection`` (no I/O) under the DEALER
   connection ``_dealer`` and the blocking client's ``_sync_dealer``, with what both do alike
   in ``_shell``, in-process ``_routes``,
   Unix sockets ``_unix``, CURVE ``_security``),
   and the data paths, ``_paths/`` (shared memory ``_shm``, NIXL ``_nixl``, device arenas
   ``_device`` and device copies ``_device_copy``).
4. **services and clients**: what both services share, ``_service/`` (the request loop
   ``_loop``, the ``_parking`` lot for requests that wait, ``_metrics`` and, imported when
   they are on, their ``_exposition``, one ``Config`` ``_config``, one service on its own
   ``_serve``); the controller, ``_controller/`` (a thin
   shell around the core); the storage units, ``_storage/``; the clients, ``_client/``
   (``_async/``, and ``_sync/``, the blocking twins generated from it by
   ``scripts/unasync.py``; their ``_options``).
5. **faces**: what users start: ``_deploy/`` (``local_cluster``, ``background_cluster``, the
   ``tq-async`` CLI), ``_datasets/`` (the streaming datasets and the PyTorch adapter),
   ``tq_async.ray``, ``tq_async.events`` (what ``watch`` yields), ``tq_async.compat`` (with
   TransferQueue's ``BatchMeta``), the
   ``tq_async.transfer_queue`` alias and `tq_async.lowlevel`, the internals for tools
   and custom deployments.

Every public name but the errors is imported on first use (``_LAZY``), so that a process
imports only the modules it runs: the services (``tq-async serve``, Ray actors) never import
the clients, the datasets or torch (~0.3 s and ~60 MB instead of ~3 s and ~330 MB), and a
``tq-async serve`` imports neither the clients' nor the in-process clusters' code. The
clients import tensordict only when a program hands one in or reads one
(``_wire._tensordicts``): a producer that puts dicts of tensors saves its ~2 s of CPU.
"""

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._errors import AuthenticationError as AuthenticationError
from ._errors import BrokenError as BrokenError
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import ClosedError as ClosedError
from ._errors import ConfigError as ConfigError
from ._errors import DeviceError as DeviceError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import KeyNotFound as KeyNotFound
from ._errors import PartitionNotFound as PartitionNotFound
from ._errors import ProtocolError as ProtocolError
from ._errors import RowsNotFound as RowsNotFound
from ._errors import SchemaError as SchemaError
from ._errors import SessionLostError as SessionLostError
from ._errors import StateLostError as StateLostError
from ._errors import StorageFullError as StorageFullError
from ._errors import TQError as TQError
from ._errors import TQTimeoutError as TQTimeoutError
from ._errors import UnsupportedTypeError as UnsupportedTypeError
from ._errors import WouldBlock as WouldBlock

if TYPE_CHECKING:
    from ._client._async._checkpoint import checkpoint_metadata as checkpoint_metadata
    from ._client._async._client import AsyncClient as AsyncClient
    from ._client._options import ClientOptions as ClientOptions
    from ._client._sync._client import Client as Client
    from ._core._settings import AdmissionConfig as AdmissionConfig
    from ._core._settings import Deadlines as Deadlines
    from ._datasets._async import AsyncStreamingDataset as AsyncStreamingDataset
    from ._datasets._async import chunk_batch_fn as chunk_batch_fn
    from ._datasets._async import default_fetch_batch_fn as default_fetch_batch_fn
    from ._datasets._torch import StreamingDataLoader as StreamingDataLoader
    from ._datasets._torch import StreamingDataset as StreamingDataset
    from ._deploy._background import BackgroundCluster as BackgroundCluster
    from ._deploy._background import background_cluster as background_cluster
    from ._deploy._cluster import LocalCluster as LocalCluster
    from ._deploy._cluster import local_cluster as local_cluster
    from ._logging import configure_logging as configure_logging
    from ._meta import BatchMeta as BatchMeta
    from ._service._config import AdmissionSection as AdmissionSection
    from ._service._config import Config as Config
    from ._service._config import CurveSection as CurveSection
    from ._service._config import SamplerSpec as SamplerSpec
    from ._transport._security import CurveClient as CurveClient
    from ._transport._security import CurveServer as CurveServer
    from ._transport._security import curve_keypair as curve_keypair
    from ._wire._listing import KVListing as KVListing
    from .samplers import BaseSampler as BaseSampler
    from .samplers import GRPOGroupNSampler as GRPOGroupNSampler
    from .samplers import RankAwareSampler as RankAwareSampler
    from .samplers import SeqlenBalancedSampler as SeqlenBalancedSampler
    from .samplers import SequentialSampler as SequentialSampler
    from .samplers import StalenessSampler as StalenessSampler
    from .samplers import StaleRows as StaleRows
    from .samplers import get_seqlen_balanced_partitions as get_seqlen_balanced_partitions
    from .samplers import karmarkar_karp as karmarkar_karp

#: public name -> module, imported on first access (PEP 562): the services (``tq-async serve``,
#: the Ray actors) import only the modules they run, the clients' and clusters' never
_LAZY = {
    "AdmissionConfig": "._core._settings",
    "AdmissionSection": "._service._config",
    "AsyncClient": "._client._async._client",
    "AsyncStreamingDataset": "._datasets._async",
    "background_cluster": "._deploy._background",
    "BackgroundCluster": "._deploy._background",
    "BaseSampler": ".samplers",
    "BatchMeta": "._meta",
    "checkpoint_metadata": "._client._async._checkpoint",
    "chunk_batch_fn": "._datasets._async",
    "Client": "._client._sync._client",
    "ClientOptions": "._client._options",
    "Config": "._service._config",
    "configure_logging": "._logging",
    "curve_keypair": "._transport._security",
    "CurveClient": "._transport._security",
    "CurveSection": "._service._config",
    "CurveServer": "._transport._security",
    "Deadlines": "._core._settings",
    "default_fetch_batch_fn": "._datasets._async",
    "get_seqlen_balanced_partitions": ".samplers",
    "GRPOGroupNSampler": ".samplers",
    "karmarkar_karp": ".samplers",
    "KVListing": "._wire._listing",
    "local_cluster": "._deploy._cluster",
    "LocalCluster": "._deploy._cluster",
    "RankAwareSampler": ".samplers",
    "SamplerSpec": "._service._config",
    "SeqlenBalancedSampler": ".samplers",
    "SequentialSampler": ".samplers",
    "StalenessSampler": ".samplers",
    "StaleRows": ".samplers",
    "StreamingDataLoader": "._datasets._torch",
    "StreamingDataset": "._datasets._torch",
}


#: names that moved to `tq_async.lowlevel` (still found here, with a warning)
_MOVED = {"ColumnHeader", "ControllerServer", "ControllerState", "StorageServer"}


def _version() -> str:
    """The installed distribution's version (``pyproject.toml``'s when it was installed);
    ``0+unknown`` for a source tree on ``sys.path`` that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tq_async")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":  # looked up on first use: importlib.metadata costs ~15-60 ms
        value = globals()[name] = _version()
        return value
    if name in _MOVED:
        warnings.warn(
            f"tq_async.{name} moved to tq_async.lowlevel: use "
            f"`from tq_async.lowlevel import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(".lowlevel", __name__), name)
    if name == "samplers":  # a public subpackage (`import tq_async.samplers` is not needed)
        return importlib.import_module(".samplers", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))


#: ``tq_async.__version__`` (see `_version`) is looked up on first use, in ``__getattr__``
__version__: str

__all__ = [
    "AdmissionConfig",
    "AdmissionSection",
    "AsyncClient",
    "ClientOptions",
    "AuthenticationError",
    "AsyncStreamingDataset",
    "BackgroundCluster",
    "BaseSampler",
    "BatchMeta",
    "BrokenError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Client",
    "ClosedError",
    "Config",
    "ConfigError",
    "DeviceError",
    "CurveClient",
    "CurveSection",
    "CurveServer",
    "Deadlines",
    "GRPOGroupNSampler",
    "InvalidRequestError",
    "KeyNotFound",
    "KVListing",
    "LocalCluster",
    "PartitionNotFound",
    "ProtocolError",
    "RankAwareSampler",
    "RowsNotFound",
    "SamplerSpec",
    "SchemaError",
    "StorageFullError",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StaleRows",
    "StateLostError",
    "SessionLostError",
    "StreamingDataLoader",
    "StreamingDataset",
    "StalenessSampler",
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
