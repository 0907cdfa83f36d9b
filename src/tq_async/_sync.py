"""``Client``: the blocking twin of :class:`~tq_async.AsyncClient`.

Every method runs the async implementation on the process's portal loop thread
(:mod:`tq_async._portal`), so there is one implementation. It works from plain threads, from
inside a running event loop (the call blocks that loop; prefer ``AsyncClient`` there), and in
a child process after ``fork`` (connect a new ``Client`` in the child).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from ._dealer import DEFAULT_BUSY_POLL
from ._errors import ClosedError
from ._meta import BatchMeta
from ._portal import check_blocking_allowed, get_portal
from ._security import CurveClient
from ._serve import check_address

if TYPE_CHECKING:  # torch loads with the AsyncClient, in open(): a mistake fails before it
    import torch
    from tensordict import TensorDict, TensorDictBase

    from ._client import AsyncClient

__all__ = ["Client"]

R = TypeVar("R")


class Client:
    """Blocking client; same methods and arguments as :class:`~tq_async.AsyncClient`.

    Use it as a context manager::

        with tq.Client.connect(address) as client:
            meta = client.put(td, partition_id="train@0")
    """

    def __init__(
        self,
        address: str,
        *,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        allow_pickle: bool | None = None,
        curve: CurveClient | None = None,
        retry_after: float | None = 10.0,
        inline_put_bytes: int = 65536,
        inline_get_bytes: int = 1 << 20,
        shared_memory: bool = True,
        same_host: bool = True,
        busy_poll: float = DEFAULT_BUSY_POLL,
        data_path: str = "auto",
    ) -> None:
        check_address(address)
        self.address = address
        #: the portal is found on first use: a Client made (by mistake) on the loop that
        #: runs the services fails at once in open(), before any thread or I/O
        self._async: AsyncClient | None = None
        self._kwargs: dict[str, Any] = {
            "request_timeout": request_timeout,
            "connect_timeout": connect_timeout,
            "allow_pickle": allow_pickle,
            "curve": curve,
            "retry_after": retry_after,
            "inline_put_bytes": inline_put_bytes,
            "inline_get_bytes": inline_get_bytes,
            "shared_memory": shared_memory,
            "same_host": same_host,
            "busy_poll": busy_poll,
            "data_path": data_path,
        }

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        allow_pickle: bool | None = None,
        curve: CurveClient | None = None,
        retry_after: float | None = 10.0,
        inline_put_bytes: int = 65536,
        inline_get_bytes: int = 1 << 20,
        shared_memory: bool = True,
        same_host: bool = True,
        busy_poll: float = DEFAULT_BUSY_POLL,
        data_path: str = "auto",
    ) -> Client:
        """A client for ``address``; enter it with ``with`` (or call :meth:`open`)."""
        return cls(
            address,
            request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            allow_pickle=allow_pickle,
            curve=curve,
            retry_after=retry_after,
            inline_put_bytes=inline_put_bytes,
            inline_get_bytes=inline_get_bytes,
            shared_memory=shared_memory,
            same_host=same_host,
            busy_poll=busy_poll,
            data_path=data_path,
        )

    def open(self) -> Client:
        """Connect (on the portal loop). Returns self."""
        if self._async is None:
            check_blocking_allowed("tq.Client.connect(...)")
            from ._client import AsyncClient

            aclient = AsyncClient(self.address, **self._kwargs)
            get_portal().call(aclient.open)
            self._async = aclient
        return self

    def close(self) -> None:
        """Close the connection; further calls raise :class:`~tq_async.ClosedError`."""
        if self._async is not None:
            aclient, self._async = self._async, None
            get_portal().call(aclient.aclose)

    def __enter__(self) -> Client:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _require(self) -> AsyncClient:
        if self._async is None:
            raise ClosedError("the client is not connected; use `with Client.connect(address)`")
        return self._async

    @property
    def async_client(self) -> AsyncClient:
        """The underlying :class:`AsyncClient` (lives on the portal loop thread)."""
        return self._require()

    def _run(self, fn: Callable[..., Awaitable[R]], *args: Any, **kwargs: Any) -> R:
        check_blocking_allowed(f"tq.Client.{fn.__name__}()")
        return get_portal().call(functools.partial(fn, *args, **kwargs))

    def put(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None = None,
        *,
        meta: BatchMeta | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        policy_version: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> BatchMeta:
        """Blocking :meth:`AsyncClient.put`."""
        return self._run(
            self._require().put,
            data,
            partition_id,
            meta=meta,
            tags=tags,
            policy_version=policy_version,
            timeout=timeout,
        )

    def put_nowait(
        self,
        data: TensorDictBase | Mapping[str, Any],
        partition_id: str | None = None,
        *,
        meta: BatchMeta | None = None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
        policy_version: int | Sequence[int] | None = None,
    ) -> BatchMeta:
        """Blocking :meth:`AsyncClient.put_nowait`."""
        return self._run(
            self._require().put_nowait,
            data,
            partition_id,
            meta=meta,
            tags=tags,
            policy_version=policy_version,
        )

    def lost_rows(self, partition_id: str | None = None) -> dict[str, Any]:
        """Blocking :meth:`AsyncClient.lost_rows`."""
        return self._run(self._require().lost_rows, partition_id)

    def storage_stats(self) -> dict[int, dict[str, Any]]:
        """Blocking :meth:`AsyncClient.storage_stats`."""
        result: dict[int, dict[str, Any]] = self._run(self._require().storage_stats)
        return result

    def register_tasks(self, tasks: Sequence[str], partition_id: str | None = None) -> None:
        """Blocking :meth:`AsyncClient.register_tasks`."""
        self._run(self._require().register_tasks, tasks, partition_id)

    def get_meta(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None = None,
        *,
        mode: str = "fetch",
        timeout: float | None = None,
        stop_when_consumed: bool = False,
        lease: float | None = None,
        ack: BatchMeta | Sequence[BatchMeta] | None = None,
    ) -> BatchMeta:
        """Blocking :meth:`AsyncClient.get_meta`."""
        return self._run(
            self._require().get_meta,
            data_fields,
            batch_size,
            partition_id,
            task_name,
            sampling_config,
            mode=mode,
            timeout=timeout,
            stop_when_consumed=stop_when_consumed,
            lease=lease,
            ack=ack,
        )

    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        nested: bool | Collection[str] = False,
        device: Any = None,
    ) -> TensorDict:
        """Blocking :meth:`AsyncClient.get_data`."""
        return self._run(self._require().get_data, meta, fields, nested=nested, device=device)

    def get(
        self,
        data_fields: Sequence[str],
        batch_size: int,
        partition_id: str,
        task_name: str,
        sampling_config: Mapping[str, Any] | None = None,
        *,
        mode: str = "fetch",
        timeout: float | None = None,
        stop_when_consumed: bool = False,
        lease: float | None = None,
        ack: BatchMeta | Sequence[BatchMeta] | None = None,
        nested: bool | Collection[str] = False,
        device: Any = None,
    ) -> tuple[TensorDict, BatchMeta]:
        """Blocking :meth:`AsyncClient.get`."""
        return self._run(
            self._require().get,
            data_fields,
            batch_size,
            partition_id,
            task_name,
            sampling_config,
            mode=mode,
            timeout=timeout,
            stop_when_consumed=stop_when_consumed,
            lease=lease,
            ack=ack,
            nested=nested,
            device=device,
        )

    def ack(self, metas: BatchMeta | Sequence[BatchMeta]) -> None:
        """Blocking :meth:`AsyncClient.ack`."""
        self._run(self._require().ack, metas)

    def release(self, meta: BatchMeta) -> None:
        """Blocking :meth:`AsyncClient.release`."""
        self._run(self._require().release, meta)

    def seal(self, partition_id: str) -> None:
        """Blocking :meth:`AsyncClient.seal`."""
        self._run(self._require().seal, partition_id)

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        """Blocking :meth:`AsyncClient.reset_consumption`."""
        self._run(self._require().reset_consumption, partition_id, task_name)

    def clear_samples(self, meta: BatchMeta) -> None:
        """Blocking :meth:`AsyncClient.clear_samples`."""
        self._run(self._require().clear_samples, meta)

    def clear_partition(self, partition_id: str) -> None:
        """Blocking :meth:`AsyncClient.clear_partition`."""
        self._run(self._require().clear_partition, partition_id)

    def check_production_status(
        self,
        partition_id: str,
        data_fields: Sequence[str],
        global_indexes: Sequence[int] | None = None,
    ) -> bool:
        """Blocking :meth:`AsyncClient.check_production_status`."""
        return self._run(
            self._require().check_production_status, partition_id, data_fields, global_indexes
        )

    def check_consumption_status(
        self, partition_id: str, task_name: str, global_indexes: Sequence[int] | None = None
    ) -> bool:
        """Blocking :meth:`AsyncClient.check_consumption_status`."""
        return self._run(
            self._require().check_consumption_status, partition_id, task_name, global_indexes
        )

    def production_status(
        self, partition_id: str, data_fields: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Blocking :meth:`AsyncClient.production_status`."""
        return self._run(self._require().production_status, partition_id, data_fields)

    def consumption_status(self, partition_id: str, task_name: str) -> torch.Tensor:
        """Blocking :meth:`AsyncClient.consumption_status`."""
        return self._run(self._require().consumption_status, partition_id, task_name)

    def list_partitions(self) -> list[str]:
        """Blocking :meth:`AsyncClient.list_partitions`."""
        return self._run(self._require().list_partitions)

    def partition_info(self, partition_id: str) -> dict[str, Any]:
        """Blocking :meth:`AsyncClient.partition_info`."""
        return self._run(self._require().partition_info, partition_id)

    def set_tags(self, meta: BatchMeta, tags: Sequence[Mapping[str, Any]]) -> None:
        """Blocking :meth:`AsyncClient.set_tags`."""
        self._run(self._require().set_tags, meta, tags)

    def kv_batch_put(
        self,
        keys: Sequence[str],
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None,
        tags: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> BatchMeta:
        """Blocking :meth:`AsyncClient.kv_batch_put`."""
        return self._run(self._require().kv_batch_put, keys, partition_id, fields, tags)

    def kv_put(
        self,
        key: str,
        partition_id: str,
        fields: TensorDictBase | Mapping[str, Any] | None = None,
        tag: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Blocking :meth:`AsyncClient.kv_put`."""
        return self._run(self._require().kv_put, key, partition_id, fields, tag)

    def kv_batch_get(
        self,
        keys: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str] | None = None,
    ) -> TensorDict:
        """Blocking :meth:`AsyncClient.kv_batch_get`."""
        return self._run(self._require().kv_batch_get, keys, partition_id, select_fields)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        """Blocking :meth:`AsyncClient.kv_list`."""
        return self._run(self._require().kv_list, partition_id)

    def kv_retrieve_meta(
        self, keys: Sequence[str], partition_id: str, create: bool = False
    ) -> BatchMeta:
        """Blocking :meth:`AsyncClient.kv_retrieve_meta`."""
        return self._run(self._require().kv_retrieve_meta, keys, partition_id, create)

    def kv_retrieve_keys(self, global_indexes: Sequence[int], partition_id: str) -> list[str]:
        """Blocking :meth:`AsyncClient.kv_retrieve_keys`."""
        return self._run(self._require().kv_retrieve_keys, global_indexes, partition_id)

    def kv_clear(self, keys: Sequence[str], partition_id: str) -> None:
        """Blocking :meth:`AsyncClient.kv_clear`."""
        self._run(self._require().kv_clear, keys, partition_id)

    def save_checkpoint(
        self,
        path: str | os.PathLike[str],
        partition_ids: Sequence[str] | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Blocking :meth:`AsyncClient.save_checkpoint`."""
        self._run(self._require().save_checkpoint, path, partition_ids, metadata=metadata)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> list[str]:
        """Blocking :meth:`AsyncClient.load_checkpoint`."""
        return self._run(self._require().load_checkpoint, path)

    def set_policy_version(self, version: int) -> None:
        """Blocking :meth:`AsyncClient.set_policy_version`."""
        self._run(self._require().set_policy_version, version)

    def acquire_rollout(
        self, policy_version: int, n: int = 1, *, timeout: float | None = None
    ) -> None:
        """Blocking :meth:`AsyncClient.acquire_rollout`."""
        self._run(self._require().acquire_rollout, policy_version, n, timeout=timeout)

    def release_rollout(self, n: int) -> None:
        """Blocking :meth:`AsyncClient.release_rollout`."""
        self._run(self._require().release_rollout, n)

    def take_recycled(self, max_rows: int = 1024) -> list[BatchMeta]:
        """Blocking :meth:`AsyncClient.take_recycled`."""
        return self._run(self._require().take_recycled, max_rows)

    def staleness_status(self) -> dict[str, int]:
        """Blocking :meth:`AsyncClient.staleness_status`."""
        return self._run(self._require().staleness_status)
