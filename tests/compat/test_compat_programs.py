"""TransferQueue programs run unchanged with ``python -m tq_async.transfer_queue`` (the
``import transfer_queue`` alias): a notebook-shaped session, its cells in order, and a
recipe-shaped program (packaged config, ``transfer_queue.utils``). Written for these tests,
in the shape of TransferQueue's ``tutorial/basic.ipynb`` and ``recipe/simple_use_case``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tq_async
import tq_async.transfer_queue as alias

NOTEBOOK = """
import asyncio
from importlib import resources

import torch
import yaml
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorStack

import transfer_queue as tq
from transfer_queue.metadata import BatchMeta
from transfer_queue.sampler import BaseSampler
from transfer_queue.utils.logging_utils import get_logger

log = get_logger("MAIN", default_level="INFO")  # the recipes' call
log.info("a recipe logs like this")
config = yaml.safe_load((resources.files("transfer_queue") / "config.yaml").read_text())
config["controller"]["polling_mode"] = True  # (the recipes merge with OmegaConf)
config["backend"]["SimpleStorage"]["total_storage_size"] = 200
tq.init(config)

# cells: single keys (a tensor row, a TensorDict row), a batch, reads of one and many keys
tq.kv_put(key="s0", partition_id="train", fields={"input_ids": torch.tensor([1, 2, 3, 4])},
          tag={"source": "wiki", "score": 0.95})
mask = torch.ones(1, 4, dtype=torch.long)
tq.kv_put(key="s1", partition_id="train", fields=TensorDict(
    {"input_ids": torch.tensor([[5, 6, 7, 8]]), "attention_mask": mask}, batch_size=1),
    tag={"source": "books"})
keys = ["b0", "b1", "b2"]
tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict(
    {"input_ids": torch.tensor([[10, 20], [30, 40], [50, 60]]),
     "attention_mask": torch.ones(3, 2, dtype=torch.long)}, batch_size=3),
    tags=[{"idx": i} for i in range(3)])
one = tq.kv_batch_get(keys="s0", partition_id="train")
assert list(one.keys()) == ["input_ids"] and one["input_ids"].is_nested
many = tq.kv_batch_get(keys=keys, partition_id="train")
assert many["input_ids"].offsets().tolist() == [0, 2, 4, 6]
assert list(tq.kv_list(partition_id="train")["train"]) == ["s0", "s1", "b0", "b1", "b2"]
assert list(tq.kv_batch_get(keys="s1", partition_id="train", select_fields="input_ids").keys()) == [
    "input_ids"]
tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict(
    {"response": torch.tensor([[1, 2], [3, 4], [5, 6]])}, batch_size=3))
assert sorted(tq.kv_batch_get(keys=keys, partition_id="train").keys()) == [
    "attention_mask", "input_ids", "response"]

# jagged responses, 3-D jagged rows, flattened images with their shapes
nested = torch.nested.as_nested_tensor([torch.tensor([10, 11, 12]), torch.tensor([20]),
                                        torch.tensor([30, 31])], layout=torch.jagged)
tq.kv_batch_put(keys=["n0", "n1", "n2"], partition_id="train", fields=TensorDict(
    {"input_ids": torch.tensor([[1, 2], [3, 4], [5, 6]]), "response": nested}, batch_size=3))
part = tq.kv_batch_get(keys=["n0", "n2"], partition_id="train")
assert torch.equal(part["response"][1], torch.tensor([30, 31]))
hidden = torch.nested.as_nested_tensor([torch.randn(2, 3, 4), torch.randn(5, 3, 4)],
                                       layout=torch.jagged)
tq.kv_batch_put(keys=["h0", "h1"], partition_id="train", fields=TensorDict(
    {"hidden_states": hidden}, batch_size=2))
got = tq.kv_batch_get(keys=["h0", "h1"], partition_id="train")["hidden_states"]
assert [tuple(s.shape) for s in got.unbind()] == [(2, 3, 4), (5, 3, 4)]
tq.kv_clear(keys=["n0", "n1", "n2", "h0", "h1"], partition_id="train")

# non-tensor columns, and a NonTensorStack row through kv_put
tq.kv_batch_put(keys=["t0", "t1"], partition_id="train", fields=TensorDict(
    {"prompt_text": NonTensorStack("Summarise.", "Translate:"),
     "metadata": NonTensorStack({"lang": "en"}, {"lang": "fr"})}, batch_size=2))
texts = tq.kv_batch_get(keys=["t0", "t1"], partition_id="train")
assert list(texts["prompt_text"]) == ["Summarise.", "Translate:"]
assert list(texts["metadata"])[1] == {"lang": "fr"}
tq.kv_put(key="single", partition_id="train",
          fields={"label": NonTensorStack("positive"), "score": torch.tensor([0.99])})
assert list(tq.kv_batch_get(keys="single", partition_id="train")["label"]) == [["positive"]]

# a data_parser that turns descriptors into tensors ragged in two dimensions
def parser(columns):
    async def parse_all(urls):
        return [torch.zeros(*[int(d) for d in u.split("x")]) for u in urls]
    columns["to_parse"] = asyncio.run(parse_all(columns["to_parse"]))
    return columns

shapes = [(i % 4 + 1, i % 3 + 2) for i in range(8)]
parsed_keys = [f"p{i}" for i in range(8)]
meta = tq.kv_batch_put(keys=parsed_keys, partition_id="train", data_parser=parser,
    fields=TensorDict({"normal": torch.randn(8, 2),
                       "to_parse": NonTensorStack(*[f"{h}x{w}" for h, w in shapes])}, batch_size=8))
assert sorted(meta.fields) == ["normal", "to_parse"]
result = tq.kv_batch_get(keys=parsed_keys, partition_id="train")
assert [tuple(result["to_parse"][i].shape) for i in range(8)] == shapes

# another partition, then clear everything
tq.kv_put(key="v0", partition_id="validation", fields={"input_ids": torch.tensor([9, 8])})
assert sorted(tq.kv_list()) == ["train", "validation"]
for pid, listing in tq.kv_list().items():
    tq.kv_clear(keys=list(listing), partition_id=pid)
assert sum(len(v) for v in tq.kv_list().values()) == 0
assert BatchMeta.empty().size == 0 and issubclass(tq.RankAwareSampler, BaseSampler)
tq.close()
print("NOTEBOOK DONE")
"""


def test_notebook_cells_in_order_through_the_alias(tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(textwrap.dedent(NOTEBOOK))
    done = subprocess.run(
        [sys.executable, "-m", "tq_async.transfer_queue", str(script)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NOTEBOOK DONE" in done.stdout
    assert "INFO - MAIN - a recipe logs like this" in done.stderr  # as TransferQueue's helper


def _notebook(*cells: str) -> str:
    """A Jupyter notebook (nbformat 4, as ``tutorial/basic.ipynb`` is) of markdown and code
    cells; each code cell's source is a list of lines, with an output stored as Jupyter
    leaves it."""
    out = [{"cell_type": "markdown", "metadata": {}, "source": ["# a tutorial\n"]}]
    for source in cells:
        lines = textwrap.dedent(source).strip().splitlines(keepends=True)
        out.append(
            {
                "cell_type": "code",
                "execution_count": None,
                "metadata": {"scrolled": False},
                "outputs": [{"name": "stdout", "output_type": "stream", "text": ["old\n"]}],
                "source": lines,
            }
        )
    meta = {"kernelspec": {"name": "python3", "display_name": "Python 3"}}
    return json.dumps({"cells": out, "metadata": meta, "nbformat": 4, "nbformat_minor": 5})


def test_a_notebook_runs_its_code_cells_in_order_through_the_alias(tmp_path: Path) -> None:
    """docs/migrating.md: ``tutorial/basic.ipynb`` runs with ``python -m
    tq_async.transfer_queue`` (a notebook file was run as a Python file: a JSON document
    that failed on its ``null``, or that ran nothing and exited 0)."""
    notebook = tmp_path / "basic.ipynb"
    notebook.write_text(
        _notebook(
            "import torch\nimport transfer_queue as tq\n\ntq.init()\n",
            """
            tq.kv_put(key="k", partition_id="train", fields={"x": torch.tensor([1, 2])})
            print("CELL 2", sorted(tq.kv_list("train")["train"]))
            """,
            "x = tq.kv_batch_get(keys='k', partition_id='train')['x']  # jagged, as in TQ\n"
            "print('CELL 3', [row.tolist() for row in x.unbind()])\n"
            "tq.close()",
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "tq_async.transfer_queue", str(notebook)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["CELL 2 ['k']", "CELL 3 [[1, 2]]"]


def test_a_missing_program_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tq_async.transfer_queue", str(tmp_path / "nope.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "nope.py" in done.stderr


def test_the_alias_never_shadows_an_installed_transfer_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "transfer_queue").mkdir()
    (tmp_path / "transfer_queue" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "transfer_queue", raising=False)
    with pytest.raises(tq_async.InvalidRequestError, match="TransferQueue is installed"):
        alias.install()
    assert "transfer_queue" not in sys.modules


def test_alias_names_and_dtype_of_the_recipe_config() -> None:
    assert set(alias.__all__) >= {"init", "kv_batch_get", "BatchMeta", "install"}
    assert alias.BatchMeta is tq_async.compat.BatchMeta
    assert alias.sampler.BaseSampler is tq_async.samplers.BaseSampler
    assert alias.metadata.extract_field_schema({"x": torch.ones(2, 3)})["x"]["shape"] == (3,)
