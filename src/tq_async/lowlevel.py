"""The building blocks under the public API, for tools, tests and custom deployments.

An RL job needs only `tq_async` (clients, datasets, ``local_cluster``, ``Config``,
samplers, errors). This module holds what those are made of, for code that assembles its own
deployment or inspects the services' state:

* `ControllerCore`: the controller's pure state machine (no loop, no socket, no
  clock: every transition takes ``now`` and returns its effects);
* `ControllerState`: the per-partition bookkeeping the core keeps;
* `ControllerServer` and `StorageServer`: the two services, each a thin shell
  around its state, served on an event loop; `serve_controller` and
  `serve_storage` run them as ``tq-async serve`` does;
* `ColumnHeader`: how a column travels (name, kind, dtype, shape);
* `transfer_collector`: ``tq_transfer_fallbacks_total{reason}``, the NIXL transfers of
  this process's clients that fell back to the socket (register it in a Prometheus registry).

These names are stable within a minor version, like the rest of the public API, but they
expose more of the design and change more often between minor versions.
"""

from ._controller._server import ControllerServer as ControllerServer
from ._core._state import ControllerState as ControllerState
from ._core._transitions import ControllerCore as ControllerCore
from ._service._exposition import transfer_collector as transfer_collector
from ._service._serve import serve_controller as serve_controller
from ._service._serve import serve_storage as serve_storage
from ._storage._server import StorageServer as StorageServer
from ._wire._columns import ColumnHeader as ColumnHeader

__all__ = [
    "ColumnHeader",
    "ControllerCore",
    "ControllerServer",
    "ControllerState",
    "StorageServer",
    "serve_controller",
    "serve_storage",
    "transfer_collector",
]
