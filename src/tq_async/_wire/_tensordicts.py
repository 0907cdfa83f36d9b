"""tensordict, imported only by the programs that use it.

Importing tensordict costs ~2 s of CPU on top of torch (it imports ``torch._dynamo``), in
every producer, DataLoader worker and restarted rank. A batch that *is* a TensorDict can only
exist in a program that imported tensordict already, so the put path asks ``sys.modules``
(a dict lookup) instead of importing it to run an ``isinstance``; the read paths, which build
TensorDicts, import it on their first batch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeGuard

    from tensordict import TensorDictBase

__all__ = ["is_tensordict", "is_tensordict_type"]


def is_tensordict(value: object) -> TypeGuard[TensorDictBase]:
    """Whether ``value`` is a TensorDict (False without importing tensordict when the program
    has not: then no value can be one)."""
    return is_tensordict_type(value, "TensorDictBase")


def is_tensordict_type(value: object, name: str) -> bool:
    """Whether ``value`` is an instance of ``tensordict.<name>`` (``NonTensorStack``,
    ``NonTensorData``, ...), asked as `is_tensordict` asks."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(value, getattr(module, name))
