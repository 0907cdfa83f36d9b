"""tq_async: an asyncio-native streaming data plane for RL post-training.

Producers ``put`` fields of samples into partitions, a controller tracks which fields each
sample has and which task consumed it, samplers decide what each consumer gets, and
consumers stream ready batches. See the README for a tour.

Layers, lowest first; a module imports its own layer and the ones below, never above
(``tests/test_layering.py`` checks it, and that no modules import each other in a circle):

1. **vocabulary**: errors (``_errors``), logging, recycled buffers, the services' loop registry
   and portal (``_portal``), the clients' concurrency primitives (``_primitives``, blocking
   ``_sync_primitives``),
   columns and their codec (``_columns``, ``_codec``: pure functions), ``BatchMeta``
   (``_meta``), the wire messages (``_protocol``: msgspec records, no I/O) and the samplers.
2. **core**: the controller's state (``_state``) and its pure state machine (``_core``,
   composing ``_put_leases``, ``_admission`` and ``_liveness``; records in ``_effects``):
   every transition takes ``now`` and returns effects; no loop, socket or clock.
3. **wire**: moving frames: addresses (``_endpoints``), the services' ROUTER endpoint
   (``_router``), the clients' DEALER connection (``_dealer``; the blocking client's,
   driven by the calling thread, ``_sync_dealer``), in-process routes
   (``_routes``), Unix sockets (``_unix``), shared memory (``_shm``), device arenas over
   the CUDA driver (``_gpu``), NIXL transfers (``_nixl``), CURVE keys (``_security``).
4. **services and clients**: the controller and storage services (``_controller``,
   ``_storage``: tables of small handlers on one request loop, ``_service``, that decode,
   call their state and answer; requests that wait park in one ``_parking`` lot), the
   clients (``_client`` and its modules; the blocking ``_sync*`` twins generated from them by
   ``scripts/unasync.py``; their options, ``_options``; NIXL links, ``_client_nixl``; device
   arena links, ``_client_gpu``; device copies, ``_devices``), checkpoints, metrics,
   ``_serve``, ``_config``.
5. **faces**: what users start: ``local_cluster``, ``background_cluster``, the streaming
   datasets, the ``tq-async`` CLI, ``tq_async.ray``, ``tq_async.compat`` (with
   ``_compat_meta``, TransferQueue's ``BatchMeta``), and
   :mod:`tq_async.lowlevel`, the internals for tools and custom deployments.

The names that need torch (clients, datasets) are imported on first use, so that the services
(``tq-async serve``, Ray actors), which never touch a tensor, start without importing torch:
~0.3 s and ~60 MB instead of ~3 s and ~330 MB.
"""

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._background import BackgroundCluster as BackgroundCluster
from ._background import background_cluster as background_cluster
from ._checkpoint import checkpoint_metadata as checkpoint_metadata
from ._cluster import LocalCluster as LocalCluster
from ._cluster import local_cluster as local_cluster
from ._config import AdmissionSection as AdmissionSection
from ._config import Config as Config
from ._config import CurveSection as CurveSection
from ._config import SamplerSpec as SamplerSpec
from ._core import AdmissionConfig as AdmissionConfig
from ._core import Deadlines as Deadlines
from ._errors import AuthenticationError as AuthenticationError
from ._errors import BrokenError as BrokenError
from ._errors import CheckpointError as CheckpointError
from ._errors import ClosedError as ClosedError
from ._errors import ConfigError as ConfigError
from ._errors import DeviceError as DeviceError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import KeyNotFound as KeyNotFound
from ._errors import PartitionNotFound as PartitionNotFound
from ._errors import ProtocolError as ProtocolError
from ._errors import RowsNotFound as RowsNotFound
from ._errors import SchemaError as SchemaError
from ._errors import TQError as TQError
from ._errors import TQTimeoutError as TQTimeoutError
from ._errors import UnsupportedTypeError as UnsupportedTypeError
from ._errors import WouldBlock as WouldBlock
from ._logging import configure_logging as configure_logging
from ._meta import BatchMeta as BatchMeta
from ._options import ClientOptions as ClientOptions
from ._security import CurveClient as CurveClient
from ._security import CurveServer as CurveServer
from ._security import curve_keypair as curve_keypair
from .samplers import BaseSampler as BaseSampler
from .samplers import GRPOGroupNSampler as GRPOGroupNSampler
from .samplers import RankAwareSampler as RankAwareSampler
from .samplers import SeqlenBalancedSampler as SeqlenBalancedSampler
from .samplers import SequentialSampler as SequentialSampler
from .samplers import StalenessSampler as StalenessSampler
from .samplers import StaleRows as StaleRows
from .samplers import get_seqlen_balanced_partitions as get_seqlen_balanced_partitions
from .samplers import karmarkar_karp as karmarkar_karp

if TYPE_CHECKING:
    from ._client import AsyncClient as AsyncClient
    from ._dataset import AsyncStreamingDataset as AsyncStreamingDataset
    from ._dataset import chunk_batch_fn as chunk_batch_fn
    from ._dataset import default_fetch_batch_fn as default_fetch_batch_fn
    from ._sync import Client as Client
    from ._torch_dataset import StreamingDataLoader as StreamingDataLoader
    from ._torch_dataset import StreamingDataset as StreamingDataset

#: public name -> module, imported on first access (PEP 562)
_LAZY = {
    "AsyncClient": "._client",
    "AsyncStreamingDataset": "._dataset",
    "chunk_batch_fn": "._dataset",
    "default_fetch_batch_fn": "._dataset",
    "Client": "._sync",
    "StreamingDataLoader": "._torch_dataset",
    "StreamingDataset": "._torch_dataset",
}


#: names that moved to :mod:`tq_async.lowlevel` (still found here, with a warning)
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
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))


#: ``tq_async.__version__`` (see :func:`_version`) is looked up on first use, in ``__getattr__``
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
