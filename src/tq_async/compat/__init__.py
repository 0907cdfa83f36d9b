"""TransferQueue 0.1.11's top-level API, served by tq_async: migrate by changing one import:

    import tq_async.compat as tq          # was: import transfer_queue as tq

    tq.init()                                             # attach, or start a cluster
    meta = tq.kv_batch_put(keys, partition_id="train@0", fields=rollouts, tags=tags)
    td = tq.kv_batch_get(keys=keys, partition_id="train@0", select_fields=["responses"])
    tq.kv_clear(keys=keys, partition_id="train@0")
    tq.close()

Names, argument names and argument order follow TransferQueue 0.1.11 (``transfer_queue``'s
``__all__``): ``init``, ``close``, ``get_metrics_endpoint``, the KV functions and their
``async_`` forms, ``KVBatchMeta``, ``save_checkpoint`` / ``load_checkpoint``,
``StreamingDataset`` / ``StreamingDataLoader``, ``get_client`` / ``TransferQueueClient``,
``BatchMeta``, ``StorageKeyNotFoundError`` and the samplers.

Rendezvous: `init` attaches to the address in its config (``address`` or
``controller.zmq_info``) or in the ``TQ_ADDRESS`` environment variable. When Ray is
initialised, every process of the job finds the services by name as Ray actors
(``TransferQueueController`` in namespace ``transfer_queue``, TransferQueue's names); a driver
that finds none launches them with `tq_async.ray.launch`, a Ray worker that finds none
raises `ClosedError`. Without Ray it starts a
`background_cluster` and publishes its address in ``TQ_ADDRESS``, so child
processes that call ``init()`` attach to it. ``python -m tq_async.transfer_queue program.py``
runs a TransferQueue program unchanged. Every remaining difference is listed, with its reason,
in ``docs/migrating.md``.

This module holds the process's lifecycle (``init`` / ``close``, the fork handling) and the KV
functions; the rest lives in its parts: ``_client`` (`TransferQueueClient`, the
partitions' first global indexes), ``_columns`` (what is put and read, as plain columns),
``_kv_meta`` (`KVBatchMeta`), ``_batch_meta`` (`BatchMeta`), ``_dataset`` (the
streaming dataset and loader) and ``_config`` (the config's shape).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict, TensorDictBase

from .._core._gone import cleared_under_read
from .._deploy._background import BackgroundCluster, background_cluster
from .._errors import (
    ClosedError,
    InvalidRequestError,
    KeyNotFound,
    PartitionNotFound,
    RowsNotFound,
)
from .._errors import SchemaError as SchemaError
from .._errors import UnsupportedTypeError as UnsupportedTypeError
from .._logging import get_logger
from .._wire._checks import integral
from ..samplers import BaseSampler as BaseSampler
from ..samplers import GRPOGroupNSampler as GRPOGroupNSampler
from ..samplers import RankAwareSampler as RankAwareSampler
from ..samplers import SeqlenBalancedSampler as SeqlenBalancedSampler
from ..samplers import SequentialSampler as SequentialSampler
from ._batch_meta import GLOBAL_INDEX_STRIDE as GLOBAL_INDEX_STRIDE
from ._batch_meta import BatchMeta as BatchMeta
from ._client import POLLING_WAIT as POLLING_WAIT
from ._client import REGISTRY as _REGISTRY
from ._client import TransferQueueClient as TransferQueueClient
from ._client import as_list as _as_list
from ._client import first_indexes as _first_indexes
from ._client import get_client as get_client
from ._client import install_lookup as _install_lookup
from ._client import stored_dtypes as _stored_dtypes
from ._client import to_thread as _to_thread
from ._columns import one_row as _one_row
from ._columns import parsed as _parsed
from ._columns import plain_columns as _plain_columns
from ._columns import put_ragged as _put_ragged
from ._columns import put_retrying_dtypes as _put_retrying_dtypes
from ._columns import read as _read
from ._config import HONOURED as _HONOURED
from ._config import address_in as _address_in
from ._config import as_config as _as_config
from ._config import flatten as _flatten
from ._dataset import StreamingDataLoader as StreamingDataLoader
from ._dataset import StreamingDataset as StreamingDataset
from ._dataset import chunk_batch_fn as chunk_batch_fn
from ._kv_meta import KVBatchMeta as KVBatchMeta
from ._kv_meta import kv_meta_of as _kv_meta_of

if TYPE_CHECKING:
    from .._wire._listing import KVListing

__all__ = [
    "init",
    "close",
    "get_metrics_endpoint",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "KVBatchMeta",
    "save_checkpoint",
    "load_checkpoint",
    "StreamingDataset",
    "StreamingDataLoader",
    "get_client",
    "BatchMeta",
    "TransferQueueClient",
    "StorageKeyNotFoundError",
    "BaseSampler",
    "GRPOGroupNSampler",
    "SequentialSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
]

_log = get_logger(__name__)

#: TransferQueue's name for a missing key; here the same class as ``tq_async.KeyNotFound``.
StorageKeyNotFoundError = KeyNotFound

_SAMPLERS: dict[str, type[BaseSampler]] = {
    "SequentialSampler": SequentialSampler,
    "GRPOGroupNSampler": GRPOGroupNSampler,
    "RankAwareSampler": RankAwareSampler,
    "SeqlenBalancedSampler": SeqlenBalancedSampler,
}

# ---- init / close ----------------------------------------------------------------------------


_lock = threading.Lock()
_state: dict[str, Any] = {}
#: a forked child's copies of what its parent's init() made (client, cluster): never used,
#: closed or freed here (their sockets and threads are the parent's)
_inherited: list[Any] = []


def _after_fork_in_child() -> None:
    # another thread of the parent may have held the lock (in init or close) at the fork: the
    # child's copy stays held forever, as the thread that would release it is not copied
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _forget_parents_state() -> None:
    """In a forked child (``_lock`` held): keep the parent's objects out of reach, clear."""
    _inherited.extend(_state[k] for k in ("client", "cluster", "ray_cluster") if _state.get(k))
    _state.clear()


def _attached() -> TransferQueueClient | None:
    """This process's compat client; None when `init` was not called.

    A child forked from an initialised process (a DataLoader worker, a ``worker_init_fn``,
    a helper process) gets a client of its own for the parent's cluster on first use: the
    parent's sockets are left untouched, and the cluster stays the parent's to stop.
    """
    if _state.get("pid") == os.getpid():
        return _state.get("client")
    with _lock:
        parent: TransferQueueClient | None = _state.get("client")
        if parent is None or _state.get("pid") == os.getpid():
            return parent
        client = TransferQueueClient(f"TransferQueueClient_{os.getpid()}", parent.address)
        client.polling_mode = parent.polling_mode
        config = _state.get("config")
        _forget_parents_state()
        _state.update(client=client, config=config, pid=os.getpid())
        _log.info("tq_async.compat attached a forked child", address=parent.address)
        return client


_install_lookup(_attached)


def _resolve_sampler(sampler: Any) -> BaseSampler | None:
    if sampler is None or isinstance(sampler, BaseSampler):
        return sampler
    if isinstance(sampler, type) and issubclass(sampler, BaseSampler):
        return sampler()
    if isinstance(sampler, str) and sampler in _SAMPLERS:
        return _SAMPLERS[sampler]()
    raise InvalidRequestError(
        f"controller.sampler must be a sampler instance, a BaseSampler subclass or one of "
        f"{sorted(_SAMPLERS)}, got {sampler!r}"
    )


#: TransferQueue's, so ``ray.get_actor(RAY_CONTROLLER, namespace=RAY_NAMESPACE)`` finds it
RAY_CONTROLLER = "TransferQueueController"
RAY_NAMESPACE = "transfer_queue"


def _ray() -> Any:
    """The ``ray`` module when Ray is initialised in this process (else None)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray


def _ray_session() -> tuple[str, str] | None:
    """This process's Ray session (its node and job), None when Ray is not initialised: a
    session ended by ``ray.shutdown()`` ended the actors compat launched or found in it."""
    ray = _ray()
    if ray is None:
        return None
    context = ray.get_runtime_context()
    return str(context.get_node_id()), str(context.get_job_id())


def _in_ray_worker(ray: Any) -> bool:
    """True in a Ray task or actor (False in a driver)."""
    worker = getattr(ray.get_runtime_context(), "worker", None)
    return getattr(worker, "mode", None) == getattr(ray, "WORKER_MODE", 1)


def _ray_attach() -> Any:
    """The compat cluster of this Ray cluster, or one launched with ``tq_async.ray.launch``'s
    default name; None when there is neither."""
    from ..ray import attach

    for name, namespace in ((RAY_CONTROLLER, RAY_NAMESPACE), ("tq_async", "tq_async")):
        try:
            return attach(name, namespace, timeout=30.0)
        except InvalidRequestError:
            continue
    return None


def _ray_cluster(flat: Mapping[str, Any]) -> tuple[Any, bool]:
    """``(RayCluster, launched here)`` when Ray is initialised, else ``(None, False)``.

    Every process of a Ray job finds the services by name; only a driver launches them, so
    one job can never split over two clusters.

    Raises:
        ClosedError: a Ray worker found no services (the driver did not call ``init()``).
    """
    ray = _ray()
    if ray is None:
        return None, False
    found = _ray_attach()
    if found is not None:
        return found, False
    if _in_ray_worker(ray):
        raise ClosedError(
            f"tq_async.compat.init() in a Ray worker found no TransferQueue services (no Ray "
            f"actor {RAY_CONTROLLER!r} in namespace {RAY_NAMESPACE!r}): call tq.init() in the "
            "driver, after ray.init() and before starting workers, or give init() the "
            "cluster's address"
        )
    from ..ray import launch

    options = _cluster_options(flat)
    try:
        return launch(
            options["num_storage_units"],
            name=RAY_CONTROLLER,
            namespace=RAY_NAMESPACE,
            sampler=options["sampler"],
            allow_pickle=options["allow_pickle"],
            # one node: loopback only; several: each service on its node's address
            host="127.0.0.1" if len([n for n in ray.nodes() if n.get("Alive")]) == 1 else None,
        ), True
    except InvalidRequestError:  # another driver launched it in the meantime
        found = _ray_attach()
        if found is None:
            raise
        return found, False


def init(conf: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """Attach this process to a cluster, starting one if there is none; idempotent (until a
    ``ray.shutdown()`` ends the Ray session whose services it found or launched: the next
    call attaches again, in the session Ray runs then).

    Where it attaches: the config's address or ``TQ_ADDRESS``; with Ray initialised, the
    job's services found by name (launched here when this is the driver and there are none;
    a Ray worker that finds none raises ``ClosedError``); otherwise a cluster started in this
    process. It logs where it attached.

    Args:
        conf: TransferQueue's config shape (a dict or an OmegaConf ``DictConfig``). Honoured:
            ``address`` (or ``controller.zmq_info`` as a string), ``controller.sampler`` (an
            instance, a class or a built-in sampler's name), ``controller.polling_mode``,
            ``backend.SimpleStorage.num_data_storage_units`` (default 2),
            ``backend.SimpleStorage.total_storage_size`` (a global row capacity),
            ``metrics.enabled``, ``metrics.port`` and ``allow_pickle`` (accept values that
            travel only with pickle). Other keys are ignored with a warning. The cluster
            settings apply only when this call starts the cluster.

    Returns:
        The effective config; ``config.controller.zmq_info`` and ``config.address`` hold the
        controller's address (give it to `StreamingDataset`).

    Raises:
        InvalidRequestError: an honoured key has a bad value.
        BrokenError: the cluster's address could not be bound.
        ClosedError: a Ray worker found no services of its job (call ``init()`` in the
            driver first).
    """
    with _lock:
        if _state.get("pid") not in (None, os.getpid()):
            _forget_parents_state()  # inherited through fork: this process needs its own
        if "client" in _state and _state.get("ray_session") not in (None, _ray_session()):
            _close()  # found in a Ray session since shut down: its services went with it
        if "client" in _state:
            return _state["config"]  # type: ignore[no-any-return]
        flat = _flatten(conf) if conf is not None else {}
        ignored = sorted(k for k in flat if k not in _HONOURED)
        if ignored:
            warnings.warn(
                f"tq_async.compat.init ignores the config keys {ignored} (see "
                "docs/migrating.md for what each maps to)",
                UserWarning,
                stacklevel=2,
            )
        if os.environ.get("TQ_PRE_ALLOC_SAMPLE_NUM"):
            _log.warning(
                "TQ_PRE_ALLOC_SAMPLE_NUM is ignored: rows exist from their put; consumers learn "
                "that production is over from seal() / end of stream (see docs/migrating.md)"
            )
        backend = flat.get("backend.storage_backend", "SimpleStorage")
        if backend != "SimpleStorage":
            raise InvalidRequestError(
                f"backend.storage_backend {backend!r} is not available in tq_async: its storage "
                "units hold the data (remove the key or set it to 'SimpleStorage')"
            )
        address, cluster, ray_cluster, where = _locate(flat)
        metrics_endpoint = os.environ.get("TQ_METRICS_ENDPOINT")
        if cluster is not None and cluster.cluster.metrics_url is not None:
            metrics_endpoint = cluster.cluster.metrics_url.split("//")[1].split("/")[0]
            os.environ["TQ_METRICS_ENDPOINT"] = metrics_endpoint
        try:
            client = TransferQueueClient(f"TransferQueueClient_{os.getpid()}", address)
        except BaseException:
            _stop_owned(cluster, ray_cluster)
            raise
        client.polling_mode = bool(flat.get("controller.polling_mode", False))
        sampler = flat.get("controller.sampler", "SequentialSampler")
        config = _as_config(
            {
                "address": address,
                "controller": {
                    "sampler": sampler if isinstance(sampler, str) else type(sampler).__name__,
                    "polling_mode": client.polling_mode,
                    "zmq_info": address,
                },
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {
                        "num_data_storage_units": flat.get(
                            "backend.SimpleStorage.num_data_storage_units", 2
                        ),
                        "total_storage_size": flat.get("backend.SimpleStorage.total_storage_size"),
                        "zmq_info": address,
                    },
                },
                "metrics": {
                    "enabled": metrics_endpoint is not None,
                    "port": flat.get("metrics.port", 0),
                    "endpoint": metrics_endpoint,
                },
            }
        )
        _state.update(
            client=client, cluster=cluster, ray_cluster=ray_cluster, config=config, pid=os.getpid()
        )
        _log.info("tq_async.compat initialised", address=address, attached_to=where)
        return config  # type: ignore[no-any-return]


def _cluster_options(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a cluster ``init`` starts: storage units, sampler, pickle."""
    units = integral(flat.get("backend.SimpleStorage.num_data_storage_units", 2))  # numpy's
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise InvalidRequestError(
            f"backend.SimpleStorage.num_data_storage_units must be an int >= 1, got {units!r}"
        )
    allow_pickle = flat.get("allow_pickle", False)
    if not isinstance(allow_pickle, bool):
        raise InvalidRequestError(f"allow_pickle must be True or False, got {allow_pickle!r}")
    return {
        "num_storage_units": units,
        "sampler": _resolve_sampler(flat.get("controller.sampler")),
        "allow_pickle": allow_pickle,
    }


def _start_cluster(flat: Mapping[str, Any]) -> BackgroundCluster:
    kwargs = _cluster_options(flat)
    capacity = flat.get("backend.SimpleStorage.total_storage_size")
    if capacity is not None:
        kwargs |= {"capacity": capacity, "capacity_scope": "global"}
    if flat.get("metrics.enabled", False):
        from prometheus_client import CollectorRegistry

        port = flat.get("metrics.port", 0)
        kwargs |= {
            "metrics_registry": CollectorRegistry(),
            "serve_metrics_on": f"127.0.0.1:{port or 0}",
        }
    return background_cluster(**kwargs)


def _locate(flat: Mapping[str, Any]) -> tuple[str, BackgroundCluster | None, Any, str]:
    """``(address, cluster started here, Ray cluster launched here, where)`` for ``init``.

    An address in the config or ``TQ_ADDRESS`` wins; with Ray initialised the job's Ray
    services (found by name, or launched by a driver); otherwise a private cluster in this
    process, whose address goes to ``TQ_ADDRESS`` for the processes it starts.
    """
    address = _address_in(flat)
    settings = [k for k in flat if k.startswith(("controller.sampler", "backend.", "metrics."))]
    settings += [k for k in flat if k == "allow_pickle"]
    if address is not None:
        if settings:
            _log.warning("attaching to a running cluster: its own settings stay", ignored=settings)
        return address, None, None, "the given address"
    ray_cluster, launched = _ray_cluster(flat)
    if ray_cluster is not None:
        # Ray workers are handed the driver's config: its settings are the cluster's already
        how = "launched" if launched else "found"
        where = f"Ray actor {ray_cluster.name!r} in namespace {ray_cluster.namespace!r} ({how})"
        # for the processes this one starts (close() takes it back)
        os.environ["TQ_ADDRESS"] = ray_cluster.address
        _state["published"] = ray_cluster.address
        _state["ray_session"] = _ray_session()  # its services live as long as the session
        return ray_cluster.address, None, ray_cluster if launched else None, where
    cluster = _start_cluster(flat)
    os.environ["TQ_ADDRESS"] = cluster.address
    return cluster.address, cluster, None, "a private cluster started in this process"


def _stop(cluster: BackgroundCluster) -> None:
    cluster.close()
    if os.environ.get("TQ_ADDRESS") == cluster.address:
        del os.environ["TQ_ADDRESS"]
    os.environ.pop("TQ_METRICS_ENDPOINT", None)


def _stop_owned(
    cluster: BackgroundCluster | None, ray_cluster: Any, session: tuple[str, str] | None = None
) -> None:
    if cluster is not None:
        _stop(cluster)
    # launched in this Ray session (a later session may run others of the same name)
    if ray_cluster is not None and session in (None, _ray_session()):
        ray_cluster.shutdown()


def close() -> None:
    """Close this process's client and stop the cluster if `init` started it here.

    Idempotent. Processes that attached keep running against nothing once the owner closes:
    close them first.
    """
    with _lock:
        _close()


def _close() -> None:
    """`close` (``_lock`` held)."""
    client: TransferQueueClient | None = _state.pop("client", None)
    cluster: BackgroundCluster | None = _state.pop("cluster", None)
    ray_cluster = _state.pop("ray_cluster", None)
    session = _state.pop("ray_session", None)
    published = _state.pop("published", None)
    pid = _state.pop("pid", None)
    _state.clear()
    _first_indexes.clear()
    if published is not None and os.environ.get("TQ_ADDRESS") == published:
        del os.environ["TQ_ADDRESS"]
    if pid != os.getpid():
        return  # inherited through fork: the parent owns both
    if client is not None:
        client.close()
    _stop_owned(cluster, ray_cluster, session)


def get_metrics_endpoint() -> str | None:
    """``host:port`` of the Prometheus endpoint, or None when metrics are off."""
    if "config" in _state:
        endpoint = _state["config"]["metrics"]["endpoint"]
        return endpoint if isinstance(endpoint, str) else None
    return os.environ.get("TQ_METRICS_ENDPOINT")


# ---- KV functions ----------------------------------------------------------------------------


def kv_put(
    key: str,
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tag: Mapping[str, Any] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Write one key's ``fields`` and/or merge ``tag``.

    ``fields`` is a ``TensorDict`` of batch size ``[]`` or ``[1]``, or a dict whose values are
    the key's row: a tensor (one row), a ``NonTensorStack`` / ``NonTensorData`` (the row holds
    its values, as in TransferQueue), or a plain value. ``data_parser`` runs here, on the
    fields, before they travel (see `kv_batch_put`).

    Raises:
        InvalidRequestError: neither ``fields`` nor ``tag`` is given.
    """
    if not isinstance(key, str):
        raise InvalidRequestError(f"key must be a string, got {type(key).__name__}")
    if fields is not None:
        fields = _parsed(_one_row(fields), data_parser)
    client = get_client().client
    if fields is None:
        meta = client.kv_put(key, partition_id, None, tag)
    else:
        meta = _put_retrying_dtypes(
            partition_id,
            fields,
            lambda f: client.kv_batch_put([key], partition_id, f, [tag]),
            _stored_dtypes,
        )
    return _kv_meta_of(meta, [key])


def kv_batch_put(
    keys: Sequence[str],
    partition_id: str,
    fields: TensorDictBase | Mapping[str, Any] | None = None,
    tags: Sequence[Mapping[str, Any]] | None = None,
    data_parser: Callable[[Any], Any] | None = None,
) -> KVBatchMeta:
    """Write ``fields`` (row ``i`` for ``keys[i]``) and/or merge ``tags`` into the keys.

    ``data_parser`` (TransferQueue's hook) gets ``{field: column}`` (a ``NonTensorStack``
    column as a list) and returns it with values replaced; it runs in this process before the
    put, not in a storage unit. A tensor field put with another dtype than it has in the
    partition is cast to the partition's dtype (see docs/migrating.md).

    Raises:
        InvalidRequestError: neither ``fields`` nor ``tags`` is given, or their lengths do not
            match ``keys``.
    """
    key_list = _as_list(keys, "keys")
    client = get_client().client
    if fields is None:
        meta = client.kv_batch_put(key_list, partition_id, None, tags)
    else:
        fields = _parsed(_plain_columns(fields), data_parser)
        meta = _put_ragged(
            fields,
            lambda f: _put_retrying_dtypes(
                partition_id,
                f,
                lambda g: client.kv_batch_put(key_list, partition_id, g, tags),
                _stored_dtypes,
            ),
            lambda _, rows, f: _put_retrying_dtypes(
                partition_id,
                f,
                lambda g: client.kv_batch_put([key_list[i] for i in rows], partition_id, g),
                _stored_dtypes,
            ),
        )
    return _kv_meta_of(meta, key_list)


def kv_batch_get(
    keys: str | Sequence[str],
    partition_id: str,
    select_fields: str | Sequence[str] | None = None,
) -> TensorDict:
    """The fields of ``keys``, row ``i`` for ``keys[i]``.

    Without ``select_fields``: every field all the keys have. With it: the selected fields
    all the keys have (a field some key lacks is left out, as in TransferQueue). Tensor
    fields come back as jagged nested tensors (TransferQueue's shape), rows with no
    dimension as a dense ``[n]`` tensor.

    Raises:
        StorageKeyNotFoundError: a key is missing.
        RowsNotFound: a key was removed (kv_clear, a clear) while this call read its cells:
            call it again.
        InvalidRequestError: the keys share no field (one has none written yet): a
            ``ValueError``, as in TransferQueue.
    """
    return _kv_batch_get(keys, partition_id, select_fields, "kv_batch_get")


def _kv_batch_get(
    keys: str | Sequence[str],
    partition_id: str,
    select_fields: str | Sequence[str] | None,
    call: str,
) -> TensorDict:
    """`kv_batch_get`, for the compat function ``call`` (named by the error of keys removed
    while it reads them)."""
    key_list = _as_list(keys, "keys")
    client = get_client().client
    meta = client.kv_retrieve_meta(key_list, partition_id)
    if not meta.field_names:
        raise _no_common_field(client, meta.global_indexes, key_list, partition_id)
    present = sorted(meta.field_names)  # TransferQueue's order
    if select_fields is not None:
        wanted = _as_list(select_fields, "select_fields")
        present = sorted(f for f in set(wanted) if f in meta.field_names)
    if not present:
        return TensorDict({}, batch_size=[len(key_list)])
    try:
        return _read(client, meta, present)
    except RowsNotFound as exc:  # removed after the look-up
        raise RowsNotFound(cleared_under_read(partition_id, call)) from exc


def _no_common_field(
    client: Any, rows: Sequence[int], keys: list[str], partition_id: str
) -> InvalidRequestError:
    """The error of a read of keys that share no field, naming those with none written."""
    masks = client.production_status(partition_id).values()
    written = {r for m in masks for r in m.nonzero().flatten().tolist()}
    bare = [k for k, r in zip(keys, rows, strict=True) if r not in written]
    if bare:
        return InvalidRequestError(
            f"keys {bare[:8]} of partition {partition_id!r} have no field written yet (only "
            "tags): put their fields before reading them"
        )
    return InvalidRequestError(
        f"keys {keys[:8]} of partition {partition_id!r} have no field in common: read them "
        "in groups that share the fields to read"
    )


def kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: str | Sequence[str] | None = None
) -> TensorDict:
    """The fields of ``meta``'s keys (``meta.fields``, or ``select_fields`` among them).

    Raises:
        InvalidRequestError: ``meta`` has no partition, or ``select_fields`` names a field
            not in ``meta.fields``.
    """
    if not isinstance(meta, KVBatchMeta) or meta.partition_id is None:
        raise InvalidRequestError("meta must be a KVBatchMeta with a partition_id")
    if select_fields is None:
        return _kv_batch_get(meta.keys, meta.partition_id, meta.fields, "kv_batch_get_by_meta")
    wanted = _as_list(select_fields, "select_fields")
    unknown = [f for f in wanted if meta.fields is None or f not in meta.fields]
    if unknown:
        raise InvalidRequestError(
            f"select_fields {unknown} are not in the KVBatchMeta's fields {meta.fields}"
        )
    return _kv_batch_get(meta.keys, meta.partition_id, wanted, "kv_batch_get_by_meta")


def kv_list(partition_id: str | None = None) -> dict[str, KVListing]:
    """``{partition_id: {key: tags}}`` for one partition (``{}`` when it does not exist yet,
    as in TransferQueue), or for all when None. Each ``{key: tags}`` is a
    `tq_async.KVListing`, a dict decoded when first read (``dict(...)`` gives the plain one)."""
    return get_client().kv_list(partition_id)


def kv_clear(keys: str | Sequence[str], partition_id: str) -> None:
    """Remove ``keys`` (keys that do not exist are skipped, as in TransferQueue)."""
    key_list = _as_list(keys, "keys")
    client = get_client().client
    try:
        client.kv_clear(key_list, partition_id)
    except (KeyNotFound, PartitionNotFound):
        try:
            existing: Mapping[str, Any] = client.kv_list(partition_id).get(partition_id, {})
        except PartitionNotFound:
            return
        present = [k for k in key_list if k in existing]
        if present:
            client.kv_clear(present, partition_id)


async_kv_put = _to_thread(kv_put)
async_kv_batch_put = _to_thread(kv_batch_put)
async_kv_batch_get = _to_thread(kv_batch_get)
async_kv_batch_get_by_meta = _to_thread(kv_batch_get_by_meta)
async_kv_list = _to_thread(kv_list)
async_kv_clear = _to_thread(kv_clear)


# ---- checkpoints -----------------------------------------------------------------------------


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    include_storage: bool = True,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Save every partition (state and cells) to ``checkpoint_dir``, atomically.

    ``include_storage=False`` is ignored (cells live in memory: a checkpoint without them
    would lose data), as in TransferQueue with SimpleStorage. ``metadata`` (JSON values) is
    stored with it; read it back with `tq_async.checkpoint_metadata`.
    """
    if not include_storage:
        _log.warning("include_storage=False is ignored: the cells are always saved")
    client = get_client().client
    # compat's numbering of partitions stays out: a restore goes into a cluster that has its own
    partitions = [p for p in client.list_partitions() if p != _REGISTRY]
    client.save_checkpoint(checkpoint_dir, partitions, metadata=metadata)


def load_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Restore a checkpoint written by `save_checkpoint`.

    Raises:
        CheckpointNotFoundError: ``checkpoint_dir`` does not exist (a ``FileNotFoundError``,
            as in TransferQueue, and a ``CheckpointError``).
        CheckpointError: the checkpoint is partial or corrupt.
        InvalidRequestError: one of its partitions exists already (clear it first).
    """
    get_client().client.load_checkpoint(checkpoint_dir)


def __dir__() -> list[str]:
    # the public names are TransferQueue's (``__all__``); imports stay out of sight
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))
