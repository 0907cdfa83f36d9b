"""``tq_async._datasets._handoff``: micro-batches packed into one buffer (the DataLoader paths are
in
``tests/datasets/test_dataset.py`` and ``tests/datasets/test_torch_dataset.py``)."""

from __future__ import annotations

import pytest
import torch

from tq_async._datasets import _handoff


def test_a_jagged_tensors_fields_read_directly_are_its_accessors() -> None:
    t = torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged)
    parts = _handoff._jagged_parts(t)
    assert parts is not None
    values, offsets = parts
    assert values is t._values  # the fields themselves, no copy
    assert torch.equal(values, t.values())
    assert torch.equal(offsets, t.offsets())
    # holes (lengths) or a ragged dimension other than the first: not packed
    holes = torch.nested.nested_tensor_from_jagged(
        torch.arange(6.0), torch.tensor([0, 3, 6]), lengths=torch.tensor([2, 3])
    )
    assert _handoff._jagged_parts(holes) is None
    assert _handoff._jagged_parts(torch.zeros(2, 3)) is None


def test_the_public_accessors_serve_when_the_class_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_handoff, "_NJT", None)
    t = torch.nested.nested_tensor([torch.arange(2), torch.arange(4)], layout=torch.jagged)
    parts = _handoff._jagged_parts(t)
    assert parts is not None
    assert torch.equal(parts[0], t.values())
    assert torch.equal(parts[1], t.offsets())


def test_shared_bytes_are_shared_memory() -> None:
    t = _handoff._shared_bytes(1000)
    assert t.shape == (1000,)
    assert t.dtype == torch.uint8
    assert t.is_shared()
