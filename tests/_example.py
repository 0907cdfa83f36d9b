"""The main example, ``examples/async_grpo.py``, loaded as a module for the tests that run it
(the example's own tests and the config tests that compare with its defaults)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "async_grpo.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_grpo_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


example = load_example()
