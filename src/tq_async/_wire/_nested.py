"""Jagged nested tensors, built in bulk.

A batch of verl's shape (256 rows x 6 fields read back jagged) spent most of its assembly in
torch's per-tensor Python machinery, not in moving bytes (W5, benchmarks/RESULTS.md):
``nested_tensor_from_jagged`` ~70 us a field (its op dispatch and schema normalisation
around a ~20 us constructor), ~15 us more for a fresh offsets tensor (a new ragged
"nested int"), and ~12 us a field for ``TensorDict``'s shape check (every ``size(i)`` of a
jagged tensor goes through ``__torch_function__``). Fields of one batch whose rows have the
same lengths share one offsets tensor, hence one nested int: they combine as dense tensors
do (``ids + mask``). The two private constructors here are used only after a probe showed
they give what the public ones give on this torch / tensordict; otherwise the public ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported by the first batch built (see `_tensordicts`)
    from tensordict import TensorDict

__all__ = ["Ragged", "RowWindows", "SharedOffsets", "jagged_tensor", "tensordict_of"]


@dataclass(slots=True, eq=False)
class Ragged:
    """One ragged dimension of a batch: the offsets its fields share, the bounds of their rows'
    lengths, and those bounds as the direct constructor stores them (made on first use)."""

    offsets: torch.Tensor
    lo: int
    hi: int
    stored: dict[str, torch.Tensor] | None = None
    #: the direct constructor's sizes and strides, by the values' row shape and strides
    layouts: dict[tuple[Any, ...], tuple[tuple[Any, ...], tuple[Any, ...]]] | None = None


_NJTMaker = Callable[[torch.Tensor, Ragged], torch.Tensor]


#: torch's logger of the notice below
_FX_LOG = logging.getLogger("torch.fx._symbolic_trace")


class _NoFxTracingNotice:
    """While entered, torch's notice "is_fx_tracing will return true for both fx.symbolic_trace
    and torch.export ..." (logged once per process by ``nested_tensor_from_jagged``: advice for
    tracing code, nothing a reader can act on) is dropped; torch's logger is left as found.

    A filter of that logger, added and removed around the call: ~0.6 us on a 2-vCPU VM,
    where the call costs ~125 us (the direct constructor, the usual path, ~15 us, never
    calls it). The notice is a ``logging`` record, not a warning: ``warnings.catch_warnings``
    would not reach it (and costs ~4.5 us). An instance per use: threads do not remove each
    other's filter.
    """

    __slots__ = ()

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")

    def __enter__(self) -> None:
        _FX_LOG.addFilter(self)

    def __exit__(self, *exc: object) -> None:
        _FX_LOG.removeFilter(self)


def jagged_from_values(
    values: torch.Tensor, offsets: torch.Tensor, lo: int | None, hi: int | None
) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=lo,
    max_seqlen=hi)``, without torch's tracing notice (`_NoFxTracingNotice`)."""
    with _NoFxTracingNotice():
        return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=lo, max_seqlen=hi)


def _public_njt(values: torch.Tensor, dim: Ragged) -> torch.Tensor:
    # the lengths' bounds, given: without them to_padded_tensor() pads every row to the
    # length of all values together
    return jagged_from_values(values, dim.offsets, dim.lo, dim.hi)


def _direct_njt_maker() -> _NJTMaker | None:
    """torch's jagged-tensor constructor (private: ``torch.nested._internal``), or None.

    What it builds differs from ``nested_tensor_from_jagged``'s in one respect only: it is
    not registered as an autograd view of ``values`` (``_is_view()`` is False), which no one
    can observe here, since ``values`` is a buffer of the read that nothing else holds.

    ``NestedTensor.__new__`` is done here, minus its argument checks, with the sizes and
    strides computed once per ragged dimension and row layout: they are symbolic ("nested
    int") arithmetic, a third of the constructor's time when every field of a batch pays it
    (W5's compat ``kv_batch_get``). ``NestedTensor.__init__`` runs as torch wrote it.
    """
    try:
        from torch._C import DispatchKey, DispatchKeySet
        from torch.nested._internal.nested_tensor import (
            NestedTensor,
            _store_val_in_tensor,
            get_tensor_symint,
        )
    except ImportError:  # pragma: no cover - another torch
        return None
    keys = DispatchKeySet(DispatchKey.NestedTensor).add(DispatchKey.AutogradNestedTensor)
    wrapper = torch.Tensor._make_wrapper_subclass
    init = NestedTensor.__init__
    bounds: dict[int, torch.Tensor] = {}

    def bound(n: int) -> torch.Tensor:
        """A row-length bound as torch stores it (an empty tensor of shape ``(0, n)``): one
        per value, shared like torch's ops share them (they carry their value in their
        shape, nothing else), a few thousand at most."""
        t = bounds.get(n)
        if t is None:
            if len(bounds) >= 4096:
                bounds.clear()
            t = bounds[n] = _store_val_in_tensor(n)
        return t

    def make(values: torch.Tensor, dim: Ragged) -> torch.Tensor:
        if dim.stored is None:  # the bounds as the public factory stores them
            dim.stored = {"min_seqlen": bound(dim.lo), "max_seqlen": bound(dim.hi)}
            dim.layouts = {}
        assert dim.layouts is not None
        stride = values.stride()
        layout = dim.layouts.get((values.shape, stride))
        if layout is None:  # ragged in the values' first dimension, as the public factory
            ragged = get_tensor_symint(dim.offsets, coeff=1)  # type: ignore[no-untyped-call]
            layout = dim.layouts[values.shape, stride] = (
                (len(dim.offsets) - 1, ragged, *values.shape[1:]),
                (ragged * stride[0], *stride),
            )
        size, strides = layout
        nt = wrapper(  # what NestedTensor.__new__ asks for
            NestedTensor,
            size,
            strides,
            0,
            torch.contiguous_format,
            values.dtype,
            torch.jagged,
            values.device,
            False,
            False,
            "sizes",
            False,
            True,
            keys,
            storage_size=values.untyped_storage().size(),
        )
        nt._ragged_idx = 1
        nt._size = size
        nt._strides = strides
        # a dict of its own (torch may add to it), the bounds' tensors shared as torch's ops
        # share them between a jagged tensor and what they compute from it
        init(nt, values, dim.offsets, _metadata_cache=dict(dim.stored))
        return nt

    return make


def _same_njt(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are jagged tensors alike in everything a reader can see."""
    return (
        type(a) is type(b)
        and sorted(vars(a)) == sorted(vars(b))
        and a._size == b._size
        and a._strides == b._strides
        and a.layout == b.layout == torch.jagged
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.requires_grad == b.requires_grad
        and a.offsets() is b.offsets()
        and a.lengths() is None is b.lengths()
        and a.values().data_ptr() == b.values().data_ptr()
        and a._ragged_idx == b._ragged_idx
        and sorted(a._metadata_cache) == sorted(b._metadata_cache)
        and a._min_seqlen == b._min_seqlen
        and a._max_seqlen == b._max_seqlen
        and torch.equal(a.to_padded_tensor(0), b.to_padded_tensor(0))
    )


def _probed_njt_maker() -> _NJTMaker:
    """The direct constructor when it builds what the public factory builds, else the
    public factory."""
    make = _direct_njt_maker()
    if make is None:
        return _public_njt
    try:
        dim = Ragged(torch.tensor([0, 2, 2, 5]), 0, 3)
        for values in (torch.arange(5.0), torch.arange(10).view(5, 2)):
            if not _same_njt(make(values, dim), _public_njt(values, dim)):
                return _public_njt
    except Exception:  # any surprise: the public path
        return _public_njt
    return make


def _probed_tensordict_maker() -> Callable[[dict[str, torch.Tensor], int], TensorDict]:
    """tensordict's unchecked constructor (private: ``TensorDict._new_unsafe``) when it builds
    what ``TensorDict(fields, batch_size=[n])`` builds, else the public constructor."""
    from tensordict import TensorDict

    def public(fields: dict[str, torch.Tensor], n: int) -> TensorDict:
        return TensorDict(fields, batch_size=[n])

    unsafe = getattr(TensorDict, "_new_unsafe", None)
    if unsafe is None:  # pragma: no cover - another tensordict
        return public

    def make(fields: dict[str, torch.Tensor], n: int) -> TensorDict:
        return unsafe(fields, batch_size=torch.Size([n]), nested=False)  # type: ignore[no-any-return]

    try:
        sample = {
            "a": torch.zeros(2, 3),
            "b": _public_njt(torch.zeros(3), Ragged(torch.tensor([0, 1, 3]), 1, 2)),
        }
        a, b = make(sample, 2), public(sample, 2)
        same = (
            type(a) is type(b)
            and a.batch_size == b.batch_size
            and a.device == b.device
            and a.names == b.names
            and a.is_locked == b.is_locked
            and list(a.keys()) == list(b.keys())
            and all(a.get(k) is b.get(k) for k in sample)
        )
    except Exception:  # any surprise: the public path
        return public
    return make if same else public


_njt: _NJTMaker | None = None
_new_tensordict: Callable[[dict[str, torch.Tensor], int], TensorDict] | None = None


def jagged_tensor(values: torch.Tensor, dim: Ragged) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged(values, dim.offsets, min_seqlen=dim.lo,
    max_seqlen=dim.hi)``, cheaper where the probe allows."""
    global _njt
    if _njt is None:
        _njt = _probed_njt_maker()
    return _njt(values, dim)


def _tensordict(fields: dict[str, torch.Tensor], n: int) -> TensorDict:
    """``TensorDict(fields, batch_size=[n])`` for tensors built here (each ``n`` rows, on the
    CPU), without re-checking their shapes where the probe allows."""
    global _new_tensordict
    if _new_tensordict is None:
        _new_tensordict = _probed_tensordict_maker()
    return _new_tensordict(fields, n)


def tensordict_of(fields: dict[str, Any], n: int, *, cpu_tensors: bool) -> TensorDict:
    """``TensorDict(fields, batch_size=[n])``. With ``cpu_tensors`` (the caller knows every
    field is a CPU tensor of ``n`` rows that it built) the shapes are not checked again, where
    the probe allows."""
    if cpu_tensors:
        return _tensordict(fields, n)
    from tensordict import TensorDict

    return TensorDict(fields, batch_size=[n])


class SharedOffsets:
    """Jagged tensors on one offsets tensor (one ragged dimension: they combine), with the
    bounds of its rows' lengths (``to_padded_tensor()`` pads to the longest row)."""

    __slots__ = ("_dim",)

    def __init__(self, offsets: torch.Tensor, shortest: int, longest: int) -> None:
        self._dim = Ragged(offsets, shortest, longest)

    def jagged(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (rows one after another) as a jagged tensor on these offsets."""
        if values.device.type != "cpu":  # the direct constructor was probed on the CPU
            return _public_njt(values, self._dim)
        return jagged_tensor(values, self._dim)


class RowWindows:
    """Rows ``[a, b)`` of a batch's jagged tensors as jagged tensors of their own (views of
    their values), e.g. for a micro-batch.

    Each window keeps the bounds of its rows' lengths (without them ``to_padded_tensor()``
    pads every row to the length of all the window's values), and the windows of fields whose
    source tensors share an offsets tensor share one too: one ragged dimension, as in the
    batch (``ids + mask`` works). Offsets are cut on their own device.
    """

    __slots__ = ("_a", "_b", "_dims")

    def __init__(self, a: int, b: int) -> None:
        self._a, self._b = a, b
        self._dims: dict[int, SharedOffsets] = {}

    def cut(self, values: torch.Tensor, offsets: torch.Tensor, host: Sequence[int]) -> torch.Tensor:
        """The window of the jagged tensor ``(values, offsets)``; ``host`` is ``offsets`` as
        Python ints. The caller keeps ``offsets`` alive while this object is used (windows
        are keyed by its identity)."""
        a, b = self._a, self._b
        dim = self._dims.get(id(offsets))
        if dim is None:
            lengths = [host[i + 1] - host[i] for i in range(a, b)] or [0]
            dim = SharedOffsets(offsets[a : b + 1] - host[a], min(lengths), max(lengths))
            self._dims[id(offsets)] = dim
        return dim.jagged(values[host[a] : host[b]])
