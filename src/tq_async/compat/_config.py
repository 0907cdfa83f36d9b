"""TransferQueue's config shape: the keys `tq_async.compat.init` honours, the config
it returns (a nested dict with attribute access), and where a config names the cluster."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._errors import InvalidRequestError

#: config keys ``init`` honours (dotted paths); any other key is ignored with a warning
HONOURED = frozenset(
    {
        "address",
        "allow_pickle",
        "controller.sampler",
        "controller.polling_mode",
        "controller.zmq_info",
        "backend.storage_backend",
        "backend.SimpleStorage.num_data_storage_units",
        "backend.SimpleStorage.total_storage_size",
        "backend.SimpleStorage.zmq_info",
        "metrics.enabled",
        "metrics.port",
        "metrics.endpoint",
    }
)


class Config(dict[str, Any]):
    """A nested dict whose keys are also attributes (``config.controller.zmq_info``), as with
    TransferQueue's OmegaConf config."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def as_config(value: Any) -> Any:
    """``value`` with every mapping in it a `Config`."""
    if isinstance(value, Mapping):
        return Config({str(k): as_config(v) for k, v in value.items()})
    return value


def flatten(conf: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"controller.sampler": value, ...}``: the leaves of ``conf`` by dotted path (an
    honoured key's mapping value stays whole)."""
    out: dict[str, Any] = {}
    for key, value in conf.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and path not in HONOURED:
            out |= flatten(value, path + ".")
        else:
            out[path] = value
    return out


def address_in(flat: Mapping[str, Any]) -> str | None:
    """The cluster's address in a flattened config, else ``TQ_ADDRESS`` (None: neither).

    Raises:
        InvalidRequestError: ``address`` is set to something else than a string
            (``controller.zmq_info`` may hold TransferQueue's own object: skipped).
    """
    address = flat.get("address")
    if address is not None and not isinstance(address, str):
        raise InvalidRequestError(
            "address must be the cluster's address, a string such as 'tcp://10.0.0.1:5555' "
            f"(the TQ_ADDRESS=... line tq-async serve prints), got {address!r}"
        )
    for key in ("address", "controller.zmq_info"):
        value = flat.get(key)
        if isinstance(value, str) and value:
            return value
    return os.environ.get("TQ_ADDRESS") or None
