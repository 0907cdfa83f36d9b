"""``tq.Config``: one configuration for local_cluster, ``tq-async serve --config`` and Ray."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tq_async as tq
from _cluster_proc import serve_cluster
from tq_async._deploy._cli import _build_parser, _given, config_from_args

ROOT = Path(__file__).resolve().parents[2]

FULL = """
num_storage_units = 3
allow_pickle = true
capacity = 64
capacity_scope = "global"
auto_clear_tasks = ["learner", "ref"]
default_lease = 30.0
metrics_on = "127.0.0.1:0"

[sampler]
factory = "tq_async:SequentialSampler"

[task_samplers.reward]
factory = "tq_async:GRPOGroupNSampler"
n_samples_per_prompt = 4

[task_samplers.learner]
factory = "tq_async:StalenessSampler"
max_staleness = 1
on_stale = "drop"
inner = { factory = "tq_async:SeqlenBalancedSampler", n_samples_per_prompt = 4, dp_size = 2 }

[admission]
max_staleness = 1
capacity = 128
learner_task = "learner"
"""


def test_round_trip_through_toml_dict_and_pickle() -> None:
    config = tq.Config.from_toml_string(FULL)
    assert config.num_storage_units == 3
    assert config.admission == tq.AdmissionSection(1, 128, "learner")
    inner = config.task_samplers["learner"].kwargs["inner"]
    assert inner == tq.SamplerSpec(
        "tq_async:SeqlenBalancedSampler", {"n_samples_per_prompt": 4, "dp_size": 2}
    )
    assert tq.Config.from_toml_string(config.to_toml()) == config
    assert tq.Config.from_dict(config.to_dict()) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert tq.Config.from_toml_string("") == tq.Config()
    assert tq.Config.from_toml_string(tq.Config().to_toml()) == tq.Config()


def test_samplers_are_built_nested() -> None:
    options = tq.Config.from_toml_string(FULL).controller_options()
    learner = options["task_samplers"]["learner"]
    assert isinstance(learner, tq.StalenessSampler)
    assert isinstance(learner.inner, tq.SeqlenBalancedSampler)
    assert learner.max_staleness == 1
    assert isinstance(options["sampler"], tq.SequentialSampler)
    assert options["admission"] == tq.AdmissionConfig(1, 128, "learner")
    assert options["default_lease"] == 30.0
    assert options["allow_pickle"] is True


def make_sampler(n: int) -> tq.BaseSampler:
    """A factory of the user's own (referenced by its import path)."""
    return tq.GRPOGroupNSampler(n)


def test_a_factory_of_your_own() -> None:
    spec = tq.SamplerSpec(f"{__name__}:make_sampler", {"n": 3})
    sampler = tq.Config(sampler=spec).build_samplers()[0]
    assert isinstance(sampler, tq.GRPOGroupNSampler)
    assert sampler.n_samples_per_prompt == 3


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("samplr = 1", "samplr: unknown key"),
        ('capacity = "x"', "capacity: expected int"),
        ("num_storage_units = 0", "num_storage_units: must be >= 1"),
        ("shm_cap = -1", "shm_cap: must be >= 0 bytes (0: no shared memory), got -1"),
        ('capacity_scope = "cluster"', "capacity_scope: invalid enum value 'cluster'"),
        ("[admission]\nmax_stalenes = 1", "admission.max_stalenes: unknown key"),
        ("[admission]\ncapacity = 3", "admission: capacity must be >= 1 and needs learner_task"),
        ("sampler = 3", "sampler: expected a table"),
        ("[task_samplers.x]\nfoo = 1", "task_samplers.x.factory: missing"),
        ('[task_samplers.x]\nfactory = "nope"', 'task_samplers.x.factory: expected "module'),
        (
            '[task_samplers.x]\nfactory = "no_such_module_here:X"',
            "task_samplers.x.factory: cannot import module 'no_such_module_here'",
        ),
        (
            '[task_samplers.x]\nfactory = "tq_async:StalenessSampler"\n'
            'inner = { factory = "tq_async:Nope" }',
            "task_samplers.x.inner.factory: module 'tq_async' has no attribute 'Nope'",
        ),
        (
            '[task_samplers.x]\nfactory = "tq_async:GRPOGroupNSampler"\nn_samples_per_prompt = 0',
            "task_samplers.x: tq_async:GRPOGroupNSampler(...) raised InvalidRequestError: "
            "n_samples_per_prompt must be >= 1",
        ),
        ('[sampler]\nfactory = "tq_async:Config"', "sampler: tq_async:Config(...) returned"),
        ("[curve]\nallow = []", "curve: object missing required field cert"),
        ('[curve]\ncert = "/nonexistent.key_secret"', "curve: cannot read CURVE certificates"),
        ("capacity = ", "not valid TOML"),
    ],
)
def test_a_bad_config_fails_with_one_line_naming_the_key(toml: str, message: str) -> None:
    with pytest.raises(tq.ConfigError) as info:
        tq.Config.from_toml_string(toml, source="x.toml").controller_options()
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """TOML is UTF-8: a file in another encoding failed with a UnicodeDecodeError traceback
    (``tq-async serve --config``: status 1), not the one line naming the file."""
    path = tmp_path / "latin1.toml"
    path.write_bytes('host_id = "Gießen"\n'.encode("latin-1"))
    with pytest.raises(tq.ConfigError, match=r"latin1\.toml: not valid TOML: not UTF-8"):
        tq.Config.from_toml(path)


async def test_a_capacity_past_what_the_wire_carries_is_refused() -> None:
    """``capacity = 99999999999999999999999`` was taken; the controller then could not encode
    its Hello reply (msgpack ints end at 2**64), so every client timed out connecting
    ("nothing answered ... within 5 s") while the services ran."""
    with pytest.raises(tq.ConfigError, match=r"^capacity: must be from 1 to 9223372036854775807"):
        tq.Config(capacity=2**63)
    with pytest.raises(tq.InvalidRequestError, match="capacity must be from 1 to"):
        async with tq.local_cluster(num_storage_units=1, capacity=10**23):
            pass
    async with (
        tq.local_cluster(config=tq.Config(num_storage_units=1, capacity=2**63 - 1)) as cluster,
        tq.AsyncClient.connect(cluster.address, connect_timeout=10) as client,
    ):
        assert await client.list_partitions() == []


@pytest.mark.parametrize("name", ["memory_cap", "shm_cap", "device_cap"])
def test_a_byte_size_past_what_the_wire_carries_is_refused(name: str) -> None:
    """``memory_cap = 10**20`` was taken, and the unit could then not encode its stats:
    ``storage_stats()`` and ``tq-async status`` timed out; ``shm_cap = 10**20`` failed the
    start in an ExceptionGroup."""
    with pytest.raises(
        tq.ConfigError, match=rf"^x\.toml: {name}: must be at most 9223372036854775807"
    ):
        tq.Config.from_toml_string(f"{name} = {10**20}", source="x.toml")


def test_missing_file() -> None:
    with pytest.raises(tq.ConfigError, match=r"cannot read config file 'nope\.toml'"):
        tq.Config.from_toml("nope.toml")


def test_the_example_config_is_the_examples_default_arguments() -> None:
    from _example import example

    shipped = tq.Config.from_toml(ROOT / "examples" / "grpo.toml")
    assert shipped == example.cluster_config(example.parse_args([]))
    shipped.controller_options()


def parse_config(*argv: str) -> tq.Config:
    parser = _build_parser()
    return config_from_args(parser.parse_args(argv), _given(parser, argv))


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('num_storage_units = 3\ncapacity = 10\ncapacity_scope = "global"\n')
    assert parse_config("serve") == tq.Config()
    from_file = parse_config("serve", "--config", str(path))
    assert (from_file.num_storage_units, from_file.capacity) == (3, 10)
    # a flag wins, even one given with its default value
    flags = parse_config(
        "serve", "--config", str(path), "--capacity", "5", "--capacity-scope", "partition"
    )
    assert (flags.num_storage_units, flags.capacity, flags.capacity_scope) == (3, 5, "partition")
    role = parse_config("serve", "controller", "--config", str(path), "--allow-pickle")
    assert role.allow_pickle
    assert role.capacity == 10


def test_a_negative_shm_cap_is_a_bad_flag() -> None:
    """``--shm-cap -1`` passed as a configuration and failed the started services (status 1)
    with "shm_cap and shm_idle_bytes must be >= 0", naming a setting the user never gave."""
    for argv in (("serve",), ("serve", "storage", "--controller", "tcp://127.0.0.1:1")):
        with pytest.raises(tq.ConfigError, match=r"^command line: shm_cap: must be >= 0"):
            parse_config(*argv, "--shm-cap", "-1")


async def test_local_cluster_applies_the_config() -> None:
    config = tq.Config.from_toml_string(FULL).replace(metrics_on=None, allow_pickle=False)
    async with tq.local_cluster(config=config) as cluster:
        ctl = cluster.controller
        assert len(cluster.units) == 3
        assert isinstance(ctl.task_samplers["learner"], tq.StalenessSampler)
        assert ctl.admission == tq.AdmissionConfig(1, 128, "learner")
        assert (ctl.state.capacity, ctl.state.capacity_global) == (64, True)
        assert ctl.state.auto_clear[None] == ("learner", "ref")
        assert ctl.default_lease == 30.0
    with pytest.raises(tq.ConfigError, match="capacity: given both"):
        async with tq.local_cluster(capacity=3, config=config):
            pass


async def test_default_lease_redelivers_an_unacknowledged_fetch() -> None:
    import torch
    from tensordict import TensorDict

    async with (
        tq.local_cluster(config=tq.Config(default_lease=0.2)) as cluster,
        tq.AsyncClient.connect(cluster.address) as client,
    ):
        await client.put(TensorDict({"x": torch.arange(2)}, [2]), partition_id="p")
        first = await client.get_meta(["x"], 2, "p", "t")
        assert first.lease_id
        # never acknowledged: the lease expires and the rows come back
        again = await client.get_meta(["x"], 2, "p", "t", timeout=30)
        assert sorted(again.global_indexes) == sorted(first.global_indexes)


def test_serve_rejects_a_bad_config_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[task_samplers.learner]\nfactory = "tq_async:NoSuchSampler"\n')
    done = subprocess.run(
        [sys.executable, "-m", "tq_async._deploy._cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "tq-async: error: task_samplers.learner.factory: module 'tq_async' has no attribute "
        "'NoSuchSampler'"
    ]


async def test_the_example_against_serve_config_matches_the_embedded_run(
    tmp_path: Path,
) -> None:
    """The issue's acceptance: balance within 0.05 of the embedded run, staleness bounded."""
    from _example import example

    # rank batches of 8 rows: enough for the balancing to show (with 2 rows there is little
    # to choose from); the default `tq-async serve` gives ~1.1 here and a staleness of 2
    sizes = "--steps 4 --prompts-per-step 8 --rank-batch-size 8 --micro-batch-size 4"
    argv = ["--tiny", "--quiet", "--max-staleness", "1", *sizes.split()]
    args = example.parse_args(argv)
    path = tmp_path / "tiny.toml"
    path.write_text(example.cluster_config(args).to_toml())
    embedded = await example.run(args)
    with serve_cluster(2, ["--config", str(path)]) as address:
        remote = await example.run(example.parse_args([*argv, "--address", address]))
    assert remote["remote"]
    assert remote["exactly_once"]
    assert remote["staleness_seen_max"] <= 1
    assert remote["dropped"] == 0
    assert abs(remote["balance"]["ratio_mean"] - embedded["balance"]["ratio_mean"]) <= 0.05


async def test_serve_controller_takes_the_config_too(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[admission]\nmax_staleness = 0\n")
    with serve_cluster(2, ["controller", "--config", str(path)]) as address:
        async with tq.AsyncClient.connect(address) as client:
            await client.acquire_rollout(0, 1)  # within the bound
            with pytest.raises(tq.TQTimeoutError):
                await client.acquire_rollout(1, 1, timeout=0.2)  # a version ahead: waits


def test_a_sampler_spec_checks_its_import_path_at_once() -> None:
    with pytest.raises(tq.ConfigError, match='expected "module:callable"'):
        tq.SamplerSpec("tq_async.SequentialSampler")


def test_a_config_built_in_python_is_checked_as_a_toml_file_is(tmp_path: Path) -> None:
    """msgspec checks types only when it decodes: ``tq.Config(...)`` built in Python took
    ``num_storage_units=2.0``, ``capacity=True``, ``auto_clear_tasks="learner"`` (five
    one-letter tasks), ``host_id=3`` as they came, failed late with AttributeError for
    ``sampler="grpo"`` or a sampler object, and refused numpy's scalars in the deadlines
    ("put_lease must be a positive number of seconds: np.float32(5.0)"). A NaN or infinite
    ``default_lease`` (TOML has ``nan`` and ``inf``) was taken too, and every fetch got a
    lease of NaN seconds. Each attribute is checked as its TOML key is; numpy's scalars and
    paths count as the plain values they hold."""
    config = tq.Config(
        num_storage_units=np.int64(2),
        capacity=np.int64(10),
        put_lease=np.float32(5.0),
        default_lease=np.float64(30.0),
        device_index=[np.int64(0)],
        durability="process",
        data_dir=tmp_path,
    )
    assert (config.num_storage_units, config.capacity, config.data_dir) == (2, 10, str(tmp_path))
    assert type(config.put_lease) is float
    assert config.deadlines().put_lease == 5.0
    assert tq.Config.from_toml_string(config.to_toml()) == config
    for attribute, value, message in [
        ("num_storage_units", 2.0, "num_storage_units: expected int, got float"),
        ("capacity", True, "capacity: expected int | null, got bool"),
        ("auto_clear_tasks", "learner", "auto_clear_tasks: expected array, got str"),
        ("auto_clear_tasks", [""], "auto_clear_tasks: task names must be non-empty"),
        ("host_id", 3, "host_id: expected str | array | null, got int"),
        ("placement", "nearest", "placement: invalid enum value 'nearest'"),
        ("sampler", "grpo", "sampler: expected a table"),
        ("sampler", tq.SequentialSampler(), "a sampler object goes to local_cluster(sampler="),
        ("task_samplers", {3: {"factory": "tq_async:SequentialSampler"}}, "a key is a task"),
        ("default_lease", float("nan"), "default_lease: must be > 0 seconds and finite"),
        ("default_lease", float("inf"), "default_lease: must be > 0 seconds and finite"),
    ]:
        with pytest.raises(tq.ConfigError) as info:
            tq.Config(**{attribute: value})
        assert message in str(info.value), (attribute, value, str(info.value))
    for toml in ("default_lease = nan", "default_lease = inf"):
        with pytest.raises(tq.ConfigError, match="default_lease: must be > 0 seconds"):
            tq.Config.from_toml_string(toml)
    # a table given as a dict is read as the TOML table
    spec = tq.Config(sampler={"factory": "tq_async:GRPOGroupNSampler", "n_samples_per_prompt": 2})
    assert isinstance(spec.build_samplers()[0], tq.GRPOGroupNSampler)
