"""The ``transfer_queue`` package (TransferQueue 0.1.11's layout) served by
`tq_async.compat`, so that a TransferQueue program runs without editing a line:

    python -m tq_async.transfer_queue tutorial/02_kv_interface.py [args...]

runs the script with ``import transfer_queue`` (and ``transfer_queue.metadata``,
``transfer_queue.sampler``, ``transfer_queue.dataloader``, ``transfer_queue.utils``,
``resources.files("transfer_queue") / "config.yaml"``) resolving here. The same from Python:
`install`. It refuses to shadow an installed TransferQueue unless told to.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

from .. import compat as _compat
from .._errors import InvalidRequestError
from .._logging import get_logger

__all__ = [*_compat.__all__, "install"]

_log = get_logger(__name__)

#: the submodules a TransferQueue program imports, registered under ``transfer_queue.``
_SUBMODULES = ("metadata", "sampler", "dataloader", "utils", "utils.logging_utils")


def install(*, replace_installed: bool = False) -> ModuleType:
    """Make ``import transfer_queue`` (and its submodules) resolve to this package in this
    process; idempotent.

    Args:
        replace_installed: serve ``transfer_queue`` from here even though TransferQueue itself
            is installed (a warning names it). Without it, an installed TransferQueue is an
            error: its programs would silently run on something else.

    Returns:
        This package.

    Raises:
        InvalidRequestError: TransferQueue is installed (or already imported) and
            ``replace_installed`` is False.
    """
    me = sys.modules[__name__]
    current = sys.modules.get("transfer_queue")
    if current is me:
        return me
    real = current.__spec__ if current is not None else importlib.util.find_spec("transfer_queue")
    if real is not None:
        where = getattr(real, "origin", None) or repr(real)
        if not replace_installed:
            raise InvalidRequestError(
                f"TransferQueue is installed ({where}): `import transfer_queue` would load it. "
                "Uninstall it (pip uninstall transferqueue) to run its programs on tq_async, or "
                "pass replace_installed=True to serve transfer_queue from tq_async.compat here"
            )
        _log.warning("serving `import transfer_queue` from tq_async.compat", installed=where)
    sys.modules["transfer_queue"] = me
    for sub in _SUBMODULES:
        sys.modules[f"transfer_queue.{sub}"] = importlib.import_module(f"{__name__}.{sub}")
    return me


def __getattr__(name: str) -> Any:
    # every name of transfer_queue's __all__ is tq_async.compat's
    if name in _compat.__all__:
        return getattr(_compat, name)
    if name in ("metadata", "sampler", "dataloader", "utils"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'transfer_queue' (tq_async.compat) has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
