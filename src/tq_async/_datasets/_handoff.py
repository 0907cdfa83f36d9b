"""Micro-batches from a DataLoader worker to the loader, packed into one buffer.

A DataLoader worker pickles what it yields onto a queue, and torch's reductions move every
tensor to shared memory of its own and pass its file descriptor over a fresh, authenticated
connection: half a millisecond and more per tensor on a VM, on both sides. A micro-batch of
jagged fields is two tensors per field (values and offsets), so a verl-shaped batch (6 jagged
fields, cut into 4 micro-batches: 7 MB) paid for 32 of them: 14 ms to pickle and unpickle one,
against 5 ms in one buffer (``benchmarks/RESULTS.md``). Here every tensor of a
`BatchSlice` is copied into one buffer: bytes inside the pickle
up to
``inline_bytes``, one shared-memory tensor beyond (one descriptor). The loader's side rebuilds
the micro-batches as views of that buffer (writable; the worker lets go of it once sent; it
lives as long as any micro-batch of the slice does).
Jagged fields keep what they had: the bounds of their rows' lengths, and one ragged dimension
for the fields that shared an offsets tensor.

Only plain batches are packed: a ``TensorDict`` without names, device or lock, whose fields
are contiguous-or-not dense CPU tensors, jagged CPU nested tensors (no holes, ragged in their
first dimension) or ``NonTensorStack``s (pickled as they are). Anything else returns None and
travels as torch sends it.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from .._wire._nested import SharedOffsets, tensordict_of

__all__ = ["pack", "unpack"]

#: a micro-batch's data: the TensorDict and whatever rides with it (its BatchMeta)
Packed: TypeAlias = tuple[Any, list[tuple[list[int], list[tuple[Any, ...]], Any]]]

_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _bytes_tensor(buffer: bytearray) -> torch.Tensor:
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


_NJT: type[Any] | None
try:  # torch's class of jagged tensors (private), to read their fields directly
    from torch.nested._internal.nested_tensor import NestedTensor as _NJT
except ImportError:  # pragma: no cover - another torch
    _NJT = None


def _shared_bytes(n: int) -> torch.Tensor:
    """``n`` bytes of shared memory as a ``uint8`` tensor. torch's own collate allocates its
    batches this way (``_new_shared``: private, hence the fallback, which copies ``n`` bytes
    of fresh memory into shared memory)."""
    out = torch.empty(0, dtype=torch.uint8)
    try:
        storage = torch.UntypedStorage._new_shared(n)  # type: ignore[no-untyped-call]
    except Exception:  # pragma: no cover - another torch
        return out.new_empty(n).share_memory_()  # type: ignore[no-untyped-call,no-any-return]
    return out.set_(storage)


def _plain(t: Any) -> bool:
    return (
        type(t) is torch.Tensor
        and t.layout is torch.strided
        and not t.is_nested
        and not t.is_quantized
        and t.device.type == "cpu"
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


def _jagged_parts(t: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(values, offsets)`` of a jagged CPU tensor we can rebuild exactly, else None."""
    if type(t) is _NJT:  # its fields read directly: each public accessor of a jagged
        # tensor goes through __torch_function__ (~30 us; 4 of them per field)
        if t._lengths is not None or t._ragged_idx != 1:
            return None
        values, offsets = t._values, t._offsets
    elif isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged:
        if getattr(t, "_lengths", None) is not None or getattr(t, "_ragged_idx", 1) != 1:
            return None
        if t.requires_grad:
            return None
        values, offsets = t.values(), t.offsets()  # type: ignore[attr-defined]
    else:
        return None
    if not (_plain(values) and _plain(offsets) and offsets.dtype == torch.int64):
        return None
    return values, offsets


class _Layout:
    """Where each tensor goes in the buffer (offsets tensors once per micro-batch)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.size = 0

    def place(self, t: torch.Tensor) -> tuple[int, int]:
        t = t.contiguous()
        n = t.numel() * t.element_size()
        at = self.size
        self.tensors.append(t)
        self.size = _align(at + n)
        return at, n


def pack(micro_batches: list[tuple[Any, Any]], inline_bytes: int) -> Packed | None:
    """``micro_batches`` as one buffer and a description of each column, or None when one of
    them is not a plain batch (see the module's docstring)."""
    layout = _Layout()
    out: list[tuple[list[int], list[tuple[Any, ...]], Any]] = []
    for td, meta in micro_batches:
        if type(td) is not TensorDict or td.device is not None or td.is_locked:
            return None
        if any(name is not None for name in td.names):
            return None
        columns: list[tuple[Any, ...]] = []
        ragged: dict[int, tuple[int, int, int, int]] = {}  # id(offsets) -> span, bounds
        for name, value in td.items():
            if isinstance(value, NonTensorStack):
                columns.append((name, "object", value))
                continue
            if isinstance(value, torch.Tensor) and _plain(value):
                span = layout.place(value)
                columns.append((name, "dense", value.dtype, tuple(value.shape), span))
                continue
            parts = _jagged_parts(value)
            if parts is None:
                return None
            values, offsets = parts
            dim = ragged.get(id(offsets))
            if dim is None:
                lengths = np.diff(offsets.numpy())
                lo, hi = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
                dim = ragged[id(offsets)] = (*layout.place(offsets), lo, hi)
            span = layout.place(values)
            columns.append((name, "jagged", values.dtype, tuple(values.shape), span, dim))
        out.append((list(td.batch_size), columns, meta))
    buffer: Any
    if layout.size <= inline_bytes:  # inside the pickle; unpickled, a bytearray of its own
        buffer = bytearray(layout.size)
        flat = _bytes_tensor(buffer)
    else:
        # shared memory from the start: torch sends it as one descriptor, without a copy
        flat = buffer = _shared_bytes(layout.size)
    at = 0
    for t in layout.tensors:
        n = t.numel() * t.element_size()
        if n:
            flat[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
        at = _align(at + n)
    return buffer, out


def unpack(buffer: Any, packed: list[tuple[list[int], list[tuple[Any, ...]], Any]]) -> list[Any]:
    """The micro-batches `pack` described, as views of ``buffer`` (a ``bytearray`` or a
    ``uint8`` tensor, this process's own)."""
    flat = _bytes_tensor(buffer) if isinstance(buffer, bytearray) else buffer

    def view(span: tuple[int, int], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        at, n = span
        return flat[at : at + n].view(dtype).view(shape)

    micro_batches = []
    for batch_size, columns, meta in packed:
        data: dict[str, Any] = {}
        tensors_only = all(kind != "object" for _, kind, *_ in columns)
        dims: dict[tuple[int, int, int, int], SharedOffsets] = {}
        for name, kind, *rest in columns:
            if kind == "object":
                data[name] = rest[0]
            elif kind == "dense":
                dtype, shape, span = rest
                data[name] = view(span, dtype, shape)
            else:
                dtype, shape, span, dim = rest
                shared = dims.get(dim)
                if shared is None:
                    at, n, lo, hi = dim
                    offsets = view((at, n), torch.int64, (n // 8,))
                    shared = dims[dim] = SharedOffsets(offsets, lo, hi)
                data[name] = shared.jagged(view(span, dtype, shape))
        (n,) = batch_size
        micro_batches.append((tensordict_of(data, n, cpu_tensors=tensors_only), meta))
    return micro_batches
