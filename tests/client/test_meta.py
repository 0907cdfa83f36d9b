"""BatchMeta: explicit chunk names, the deprecated ``chunk``, own copies, ``extra_info``."""

from __future__ import annotations

import pickle

import msgspec
import pytest

import tq_async as tq


def _meta(n: int = 10, **kw: object) -> tq.BatchMeta:
    return tq.BatchMeta(
        partition_id="p",
        global_indexes=list(range(n)),
        field_names=["f"],
        units=[0] * n,
        tags=[{"score": i} for i in range(n)],
        **kw,  # type: ignore[arg-type]
    )


def test_chunk_every_and_chunk_into_name_both_meanings() -> None:
    m = _meta(10)
    assert [len(c) for c in m.chunk_every(3)] == [3, 3, 3, 1]
    assert [len(c) for c in m.chunk_into(3)] == [4, 3, 3]  # TransferQueue's chunk(3)
    assert next(c.global_indexes for c in m.chunk_into(3)) == [0, 1, 2, 3]
    assert [len(c) for c in _meta(2).chunk_into(3)] == [1, 1, 0]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(tq.InvalidRequestError, match="chunk_every"):
            m.chunk_every(bad)  # type: ignore[arg-type]
        with pytest.raises(tq.InvalidRequestError, match="chunk_into"):
            m.chunk_into(bad)  # type: ignore[arg-type]


def test_chunk_is_deprecated_and_names_both_replacements() -> None:
    with pytest.warns(DeprecationWarning, match=r"chunk_every\(size\).*chunk_into\(n\)"):
        pieces = _meta(10).chunk(3)
    assert [len(c) for c in pieces] == [3, 3, 3, 1]  # its meaning did not change silently


def test_batch_meta_copies_what_it_is_given() -> None:
    rows, units, tags = [0, 1, 2], [0, 0, 0], [{"a": 1}, {"a": 2}, {"a": 3}]
    extra = {"step": [1]}
    m = tq.BatchMeta(
        partition_id="p", global_indexes=rows, field_names=[], units=units, tags=tags,
        extra_info=extra,
    )  # fmt: skip
    rows.append(99)
    units.append(0)
    tags[0]["a"] = -1
    extra["step"].append(2)
    assert m.global_indexes == [0, 1, 2]
    assert m.units == [0, 0, 0]
    assert m.tags[0] == {"a": 1}
    assert m.extra_info == {"step": [1]}


@pytest.mark.parametrize(
    "select",
    [
        lambda m: m.select_fields(["f"]),
        lambda m: m.select_rows([0, 1]),
        lambda m: m.chunk_every(2)[0],
        lambda m: m.chunk_into(2)[0],
        lambda m: tq.BatchMeta.concat([m]),
    ],
)
def test_selections_do_not_share_tag_dicts(select: object) -> None:
    m = _meta_with_extra()
    sel = select(m)  # type: ignore[operator]
    sel.tags[0]["score"] = -1
    sel.extra_info["x"] = 1
    assert m.tags[0] == {"score": 0}
    assert m.extra_info == {"step": 3}


def _meta_with_extra() -> tq.BatchMeta:
    return _meta(4, extra_info={"step": 3})


def test_extra_info_survives_chunk_concat_select_and_the_wire() -> None:
    m = _meta(6, extra_info={"step": 3, "tag": "x"})
    for piece in [*m.chunk_every(4), *m.chunk_into(3), m.select_rows([1]), m.select_fields([])]:
        assert piece.extra_info == {"step": 3, "tag": "x"}
    joined = tq.BatchMeta.concat(m.chunk_into(2))
    assert joined.extra_info == {"step": 3, "tag": "x"}
    assert joined.global_indexes == m.global_indexes
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=tq.BatchMeta)
    assert again == m
    assert pickle.loads(pickle.dumps(m)) == m
    other = _meta(2, extra_info={"step": 4})
    with pytest.raises(tq.InvalidRequestError, match="extra_info\\['step'\\]"):
        tq.BatchMeta.concat([m, other])


def test_keys_follow_rows() -> None:
    m = tq.BatchMeta(
        partition_id="p", global_indexes=[4, 5, 6], field_names=[], units=[0, 0, 0],
        keys=["a", None, "c"],
    )  # fmt: skip
    assert m.select_rows([2, 0]).keys == ["c", "a"]
    assert tq.BatchMeta.concat([m, _meta(1)]).keys == ["a", None, "c", None]
    with pytest.raises(ValueError, match="one key per row"):
        tq.BatchMeta(
            partition_id="p", global_indexes=[1], field_names=[], units=[0], keys=["a", "b"]
        )


def test_a_batch_meta_built_from_tensors_or_arrays_holds_ints() -> None:
    """Row ids and units kept in a tensor or an array (``torch.arange(n)``, ``np.nonzero``)
    are what a hand-built BatchMeta is most often given: it kept the tensor's items, which
    no request can carry (`get_data` failed with msgspec's ``NotImplementedError``). They
    become ints; what is no row id, and one field name given as a string (read letter by
    letter), is an `InvalidRequestError` at once."""
    import numpy as np
    import torch

    m = tq.BatchMeta(
        partition_id="p", global_indexes=torch.arange(3), field_names=("f",),
        units=np.zeros(3, dtype=np.int64),
    )  # fmt: skip
    assert m.global_indexes == [0, 1, 2]
    assert m.units == [0, 0, 0]
    assert all(type(v) is int for v in [*m.global_indexes, *m.units])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=tq.BatchMeta) == m
    assert tq.BatchMeta(
        partition_id="p", global_indexes=range(2), field_names=[], units=(1, 1)
    ).units == [1, 1]
    for bad in ({"global_indexes": torch.tensor([0.5])}, {"units": ("0",)}, {"field_names": "f"}):
        args: dict[str, object] = {"global_indexes": [0], "field_names": ["f"], "units": [0]}
        with pytest.raises(tq.InvalidRequestError, match=next(iter(bad))):
            tq.BatchMeta(partition_id="p", **{**args, **bad})  # type: ignore[arg-type]
