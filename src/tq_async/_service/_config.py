"""``Config``: one description of a deployment, for every way to run the services.

The same object (or the same TOML file) configures ``local_cluster(config=...)``, ``tq-async
serve --config FILE`` and ``tq_async.ray.launch(config=...)``, so a job reproduces the same
samplers, admission and limits wherever its services run:

    num_storage_units = 2
    capacity = 4096

    [admission]
    max_staleness = 1
    capacity = 128
    learner_task = "learner"

    [task_samplers.reward]
    factory = "tq_async:GRPOGroupNSampler"
    n_samples_per_prompt = 4

    [task_samplers.learner]                 # StalenessSampler(SeqlenBalancedSampler(...))
    factory = "tq_async:StalenessSampler"
    max_staleness = 1
    inner = { factory = "tq_async:SeqlenBalancedSampler", n_samples_per_prompt = 4, dp_size = 2 }

A sampler is a table with a ``factory`` (``"module:callable"``: a sampler class or any
function of yours that returns one) and the callable's keyword arguments; an argument that is
itself such a table (or a list of them) is built first and passed as the object. Factories are
imported and called where the services run (in the Ray actor, in the ``tq-async serve``
process), when they start.

A bad configuration fails before anything starts, with one line that names the key:
`ConfigError`.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec
import numpy as np
import zmq.auth

from .._core._settings import AdmissionConfig, Deadlines
from .._errors import ConfigError, InvalidRequestError, TQError
from .._paths._shm import DEFAULT_SHM_CAP
from .._transport._endpoints import normalize_bind
from .._transport._security import CurveServer
from ._metrics import metrics_address

if TYPE_CHECKING:  # (a storage unit's process never imports the samplers)
    from ..samplers import BaseSampler

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - depends on the Python version
    import tomli as tomllib

__all__ = [
    "AdmissionSection",
    "Config",
    "CurveSection",
    "SamplerSpec",
    "device_indexes",
    "load_curve",
    "per_unit",
]

T = TypeVar("T")


class SamplerSpec:
    """How to build a sampler: ``factory(**kwargs)``, with nested specs built first.

    Args:
        factory: ``"module:callable"``, e.g. ``"tq_async:SeqlenBalancedSampler"`` or
            ``"my_pkg.samplers:make_sampler"`` (any callable that returns a sampler).
        kwargs: keyword arguments; a value that is a `SamplerSpec` (or a list of
            them) is built first, so ``StalenessSampler(SeqlenBalancedSampler(...))`` is
            ``SamplerSpec("tq_async:StalenessSampler", {"inner": SamplerSpec(...)})``.
    """

    __slots__ = ("factory", "kwargs")

    def __init__(self, factory: str, kwargs: Mapping[str, Any] | None = None) -> None:
        if not isinstance(factory, str) or not _IMPORT_PATH.fullmatch(factory):
            raise ConfigError(
                f'factory: expected "module:callable" (e.g. "tq_async:SequentialSampler"), '
                f"got {factory!r}"
            )
        self.factory = factory
        self.kwargs: dict[str, Any] = dict(kwargs or {})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplerSpec):
            return NotImplemented
        return (self.factory, self.kwargs) == (other.factory, other.kwargs)

    def __hash__(self) -> int:  # pragma: no cover - specs are not meant as dict keys
        return hash(self.factory)

    def __repr__(self) -> str:
        return f"SamplerSpec({self.factory!r}, {self.kwargs!r})"

    def __reduce__(self) -> tuple[Any, ...]:  # Ray ships configs by pickling
        return (SamplerSpec, (self.factory, self.kwargs))

    @classmethod
    def from_table(cls, table: Mapping[str, Any], key: str = "sampler") -> SamplerSpec:
        """The spec of a TOML table: ``factory`` plus the keyword arguments.

        Raises:
            ConfigError: no ``factory``, or it is not a ``"module:callable"`` string.
        """
        if not isinstance(table, Mapping):
            raise ConfigError(
                f'{key}: expected a table with a factory = "module:callable" key, '
                f"got {type(table).__name__}{_sampler_hint(table)}"
            )
        factory = table.get("factory")
        if factory is None:
            raise ConfigError(
                f"{key}.factory: missing; a sampler is a table with factory = "
                '"module:callable" and the callable\'s keyword arguments'
            )
        if not isinstance(factory, str) or not _IMPORT_PATH.fullmatch(factory):
            raise ConfigError(
                f'{key}.factory: expected "module:callable" (e.g. '
                f'"tq_async:SequentialSampler"), got {factory!r}'
            )
        kwargs = {
            name: _nested_specs(value, f"{key}.{name}")
            for name, value in table.items()
            if name != "factory"
        }
        return cls(factory, kwargs)

    def to_table(self) -> dict[str, Any]:
        """The TOML table form (the inverse of `from_table`)."""
        return {"factory": self.factory, **{k: _tables(v) for k, v in self.kwargs.items()}}

    def build(self, key: str = "sampler") -> BaseSampler:
        """Import the factory and call it (nested specs first).

        Args:
            key: where this spec sits in the configuration (named in errors).

        Raises:
            ConfigError: the import path does not resolve, the factory raises, or it does
                not return a sampler.
        """
        factory = _import(self.factory, f"{key}.factory")
        kwargs = {name: _built(value, f"{key}.{name}") for name, value in self.kwargs.items()}
        try:
            sampler = factory(**kwargs)
        except Exception as exc:
            raise ConfigError(
                f"{key}: {self.factory}(...) raised {type(exc).__name__}: {exc}"
            ) from exc
        if not callable(getattr(sampler, "sample", None)):
            raise ConfigError(
                f"{key}: {self.factory}(...) returned {type(sampler).__name__}, not a sampler "
                "(an object with a sample() method, e.g. a tq_async.BaseSampler)"
            )
        return sampler  # type: ignore[no-any-return]


def _sampler_hint(given: Any) -> str:
    """What to write instead of a sampler object (or class) where a spec is expected."""
    from ..samplers import BaseSampler

    if isinstance(given, BaseSampler) or (
        isinstance(given, type) and issubclass(given, BaseSampler)
    ):
        return (
            " (a Config says how to build a sampler, e.g. SamplerSpec("
            "'tq_async:GRPOGroupNSampler', {'n_samples_per_prompt': 4}); a sampler object "
            "goes to local_cluster(sampler=...))"
        )
    return ""


_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _nested_specs(value: Any, key: str) -> Any:
    if isinstance(value, Mapping) and "factory" in value:
        return SamplerSpec.from_table(value, key)
    if isinstance(value, list):
        return [_nested_specs(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def _tables(value: Any) -> Any:
    if isinstance(value, SamplerSpec):
        return value.to_table()
    if isinstance(value, list):
        return [_tables(v) for v in value]
    return value


def _built(value: Any, key: str) -> Any:
    if isinstance(value, SamplerSpec):
        return value.build(key)
    if isinstance(value, list):
        return [_built(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def _import(path: str, key: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{key}: {path} is not callable")
    return obj


class AdmissionSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[admission]``: bounds enforced by ``acquire_rollout`` (see `AdmissionConfig`).

    Attributes:
        max_staleness: a rollout of version ``v`` starts only while ``v - learner <= K``.
        capacity: the most rows admitted and not yet consumed by ``learner_task``.
        learner_task: the task whose consumption frees admission slots.
        slot_lease: seconds an asynchronous client's slots not put yet stay its own
            without a renewal (it renews every third of it; a dead producer's come back).
    """

    max_staleness: int | None = None
    capacity: int | None = None
    learner_task: str | None = None
    slot_lease: float = AdmissionConfig.slot_lease

    def build(self) -> AdmissionConfig:
        """The `AdmissionConfig` (raises `ConfigError` when inconsistent)."""
        try:
            return AdmissionConfig(
                self.max_staleness, self.capacity, self.learner_task, self.slot_lease
            )
        except TQError as exc:
            raise ConfigError(f"admission: {exc}") from exc


class CurveSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``[curve]``: CURVE encryption and client authentication from certificate files.

    Attributes:
        cert: the services' secret certificate (``NAME.key_secret`` written by
            ``zmq.auth.create_certificates(dir, NAME)``).
        allow: public certificates (files, or directories of ``*.key`` files) of the clients
            let in; empty: any client that knows the services' public key.
    """

    cert: str
    allow: list[str] = msgspec.field(default_factory=list)

    def load(self) -> CurveServer:
        """Read the key files (raises `ConfigError` naming the file)."""
        try:
            curve = load_curve(self.cert, self.allow or None)
        except TQError as exc:
            raise ConfigError(f"curve: {exc}") from exc
        assert curve is not None
        return curve


def load_curve(cert: str | None, allow: Sequence[str] | None) -> CurveServer | None:
    """CURVE keys from ZMQ certificate files (``zmq.auth.create_certificates`` makes them).

    Args:
        cert: the services' secret certificate (``NAME.key_secret``); None: no CURVE.
        allow: public certificates (files, or directories of ``*.key`` files) of the clients
            let in; None: any client that knows the services' public key.

    Raises:
        InvalidRequestError: a file is missing or holds no key of the needed kind.
    """
    from .._errors import InvalidRequestError

    if cert is None:
        if allow:
            raise InvalidRequestError("--curve-allow needs --curve-cert (the services' keys)")
        return None
    try:
        public, secret = zmq.auth.load_certificate(cert)
        allowed: list[bytes] | None = None
        if allow:
            allowed = []
            for path in allow:
                if os.path.isdir(path):
                    allowed.extend(zmq.auth.load_certificates(path))
                else:
                    allowed.append(zmq.auth.load_certificate(path)[0])
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot read CURVE certificates: {exc}") from exc
    if secret is None:
        raise InvalidRequestError(
            f"{cert} holds no secret key; pass the NAME.key_secret file that "
            "zmq.auth.create_certificates(dir, NAME) wrote"
        )
    return CurveServer(public, secret, allowed_clients=allowed)


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One deployment's configuration (TOML keys are these attribute names).

    Attributes:
        num_storage_units: storage units of an all-in-one cluster (``local_cluster``,
            ``tq-async serve``, ``tq_async.ray.launch``).
        host: the interface services bind (loopback by default).
        bind: the controller's full bind address, e.g. ``"tcp://127.0.0.1:5555"``.
        allow_pickle: accept columns of arbitrary Python objects (trusted deployments only).
        capacity: backpressure: the most live rows per partition (``capacity_scope=
            "global"``: in all partitions together); a put that does not fit waits.
        capacity_scope: ``"partition"`` or ``"global"``.
        auto_clear_tasks: free each row once every one of these tasks consumed it, in every
            partition without its own ``register_tasks`` setting (empty: off).
        default_lease: seconds a fetched batch is leased when get_meta asks for no lease
            (None: no lease unless asked); a batch not acknowledged in time is handed out
            again. ``get`` (and so the streaming datasets) acknowledges after reading;
            callers of ``get_meta`` + ``get_data`` call ``ack``.
        put_lease: seconds a put's new rows stay reserved without a commit or a renewal
            (a dead producer's are then reclaimed; see `Deadlines`).
        unit_suspend_after: seconds a silent storage unit has before it is suspended.
        unit_lost_after: seconds a suspended unit has to come back before its rows are
            declared lost.
        waiting_warning_after: seconds a get_meta waits before the controller warns why
            (missing fields or partition, or a partition not sealed and gone quiet).
        shm_cap: bytes of shared memory per storage unit for clients on the units' host (0:
            off; at the cap, puts go over the socket).
        data_path: what storage units offer besides the socket: ``"auto"`` (shared memory
            to clients on their host, NIXL to clients on other hosts when ``tq_async[nixl]``
            is installed), ``"shm"``, ``"nixl"`` or ``"zmq"``. Each client chooses too
            (``connect(data_path=...)``); see ``docs/deployment.md``, "Data paths".
        device_cap: bytes of GPU memory per storage unit for cells put from GPUs by clients
            on the units' host (0: none, the default): such columns then move device to
            device (CUDA IPC) instead of through host memory; see ``docs/deployment.md``,
            "GPU to GPU on one host". Needs ``shm_cap`` > 0 and a GPU on the units' host.
        device_index: which GPU holds them (its CUDA index as the units' process sees it);
            a list gives each unit of a cluster its own (unit ``i`` on ``device_index[i]``:
            one GPU per unit on a multi-GPU host).
        placement: which storage unit a put's new rows go to: ``"local"`` (a unit on the
            producer's host, the least-loaded there, unless that host holds more than 1.2x
            the mean; else the least-loaded unit), ``"round_robin"``, or ``"auto"`` (the
            default: ``"local"`` while the units span more than one host). See
            ``docs/deployment.md``, "Locality".
        host_id: the storage units' host id (default: ``$TQ_HOST_ID``, the Ray node id or
            the machine's); a list gives the units of an all-in-one cluster one each (tests
            of locality on one machine).
        metrics_on: ``"host:port"`` to serve Prometheus metrics on (port 0: any free port).
        sampler: the sampler of every task without its own (``SequentialSampler`` if None).
        task_samplers: samplers for particular tasks, by task name.
        admission: staleness and capacity bounds for ``acquire_rollout``.
        curve: CURVE key files: encrypt every socket, admit only the allowed clients.
        durability: ``"memory"`` (default: today's speed, nothing survives a crash),
            ``"process"`` (the controller acknowledges a change once it is in its journal's
            files: survives SIGKILL or OOM of the controller) or ``"fsync"`` (once it is on
            the disk: survives a machine crash). See ``docs/guarantees.md``.
        data_dir: the controller's journal directory for ``process`` / ``fsync`` (an
            existing directory, empty or an earlier controller's: a controller started on it
            recovers). For ``tq-async serve storage`` it is the unit's own directory: the unit
            keeps its cells there too and a unit started on it comes back with them. A cluster
            started as a whole (``local_cluster``, ``tq-async serve``, ``tq_async.ray.launch``)
            keeps unit N's cells in ``data_dir/units/unit-N``; for Ray it is an absolute path
            on the actors' nodes.
        memory_cap: most bytes of cells a storage unit keeps in memory (None: no bound, the
            default); the least recently used ones past it go to disk and are read back on
            demand, at every durability level (at ``memory`` into a scratch directory under
            ``data_dir``, or the system's temporary directory, removed when the unit stops).
            See ``docs/deployment.md``, "Cells on disk".
    """

    num_storage_units: int = 2
    host: str = "127.0.0.1"
    bind: str | None = None
    allow_pickle: bool = False
    capacity: int | None = None
    capacity_scope: Literal["partition", "global"] = "partition"
    auto_clear_tasks: list[str] = msgspec.field(default_factory=list)
    default_lease: float | None = None
    put_lease: float = Deadlines.put_lease
    unit_suspend_after: float = Deadlines.unit_suspend_after
    unit_lost_after: float = Deadlines.unit_lost_after
    waiting_warning_after: float = Deadlines.waiting_warning_after
    shm_cap: int = DEFAULT_SHM_CAP
    data_path: Literal["auto", "zmq", "shm", "nixl"] = "auto"
    device_cap: int = 0
    device_index: int | list[int] = 0
    placement: Literal["auto", "local", "round_robin"] = "auto"
    host_id: str | list[str] | None = None
    metrics_on: str | None = None
    sampler: SamplerSpec | None = None
    task_samplers: dict[str, SamplerSpec] = msgspec.field(default_factory=dict)
    admission: AdmissionSection | None = None
    curve: CurveSection | None = None
    durability: Literal["memory", "process", "fsync"] = "memory"
    data_dir: str | None = None
    memory_cap: int | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        if self.durability != "memory" and self.data_dir is None:
            raise ConfigError(
                f"data_dir: durability {self.durability!r} keeps the controller's state in a "
                'directory; give data_dir (e.g. data_dir = "/var/lib/tq-async/controller")'
            )
        if self.memory_cap is not None and self.memory_cap < 0:
            raise ConfigError(f"memory_cap: must be >= 0 bytes or absent, got {self.memory_cap}")
        if self.num_storage_units < 1:
            raise ConfigError(f"num_storage_units: must be >= 1, got {self.num_storage_units}")
        for name in ("shm_cap", "device_cap", "memory_cap"):  # int64s on the wire (stats)
            if (getattr(self, name) or 0) >= 2**63:
                raise ConfigError(
                    f"{name}: must be at most {2**63 - 1} bytes, got {getattr(self, name)}"
                )
        if self.shm_cap < 0:
            raise ConfigError(
                f"shm_cap: must be >= 0 bytes (0: no shared memory), got {self.shm_cap}"
            )
        if self.device_cap < 0:
            raise ConfigError(f"device_cap: must be >= 0, got {self.device_cap}")
        indexes = self.device_index if isinstance(self.device_index, list) else [self.device_index]
        if not indexes or any(i < 0 for i in indexes):
            raise ConfigError(
                f"device_index: must be >= 0 (or a non-empty list of such), got {self.device_index}"
            )
        if self.capacity is not None and not 1 <= self.capacity < 2**63:
            raise ConfigError(
                f"capacity: must be from 1 to {2**63 - 1} rows, or absent, got {self.capacity}"
            )
        if self.default_lease is not None and not 0 < self.default_lease < math.inf:
            raise ConfigError(
                f"default_lease: must be > 0 seconds and finite (or absent: no lease), got "
                f"{self.default_lease}"
            )
        if not all(self.auto_clear_tasks):
            raise ConfigError(
                f"auto_clear_tasks: task names must be non-empty, got {self.auto_clear_tasks}"
            )
        try:
            if self.metrics_on is not None:
                metrics_address(self.metrics_on)
            if self.bind is not None:
                normalize_bind(self.bind)
        except InvalidRequestError as exc:
            raise ConfigError(str(exc)) from None

    # ---- loading and saving ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> Config:
        """Validate a mapping (e.g. parsed TOML): unknown keys and wrong types are errors.

        Args:
            data: the configuration, keyed as the attributes.
            source: named at the start of error messages (a file name).

        Raises:
            ConfigError: one line naming the offending key and the problem.
        """
        try:
            return msgspec.convert(_with_specs(data), cls, dec_hook=_decode_spec, strict=True)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{source}: {_describe(exc)}") from None
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Config:
        """Read a TOML file (see the module docstring for the layout).

        Raises:
            ConfigError: the file cannot be read or parsed, or does not validate.
        """
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path}: not valid TOML: not UTF-8 ({exc.reason} at byte {exc.start}); save "
                "the file as UTF-8"
            ) from exc
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_toml_string(cls, text: str, *, source: str = "config") -> Config:
        """Parse TOML text (see `from_toml`)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
        return cls.from_dict(data, source=source)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``None`` values left out), such that ``from_dict(to_dict())`` equals it."""
        clean: dict[str, Any] = _drop_none(msgspec.to_builtins(self, enc_hook=_encode_spec))
        return clean

    def to_toml(self) -> str:
        """The configuration as TOML text that `from_toml_string` reads back equal."""
        return _dump_toml(self.to_dict())

    def replace(self, *, source: str = "config", **changes: Any) -> Config:
        """A copy with some attributes changed, validated like a new config.

        Raises:
            ConfigError: a changed attribute is unknown or of the wrong type.
        """
        merged = {**self.to_dict(), **msgspec.to_builtins(changes, enc_hook=_encode_spec)}
        return Config.from_dict(_drop_none(merged), source=source)

    # ---- what the services are built from ----------------------------------------------------

    def build_samplers(self) -> tuple[BaseSampler | None, dict[str, BaseSampler]]:
        """``(sampler, task_samplers)``: the factories imported and called.

        Raises:
            ConfigError: an import path does not resolve or a factory raises.
        """
        sampler = self.sampler.build("sampler") if self.sampler is not None else None
        tasks = {
            task: spec.build(f"task_samplers.{task}") for task, spec in self.task_samplers.items()
        }
        return sampler, tasks

    def controller_options(self) -> dict[str, Any]:
        """Keyword arguments for the controller (`ControllerServer`).

        A new controller setting is one attribute above and one entry here.

        Raises:
            ConfigError: a sampler, the admission bounds or the CURVE files are bad.
        """
        sampler, task_samplers = self.build_samplers()
        return {
            "sampler": sampler,
            "task_samplers": task_samplers,
            "allow_pickle": self.allow_pickle,
            "admission": self.admission.build() if self.admission is not None else None,
            "curve": self.load_curve(),
            "default_lease": self.default_lease,
            "deadlines": self.deadlines(),
            "durability": self.durability,
            "data_dir": self.data_dir,
        }

    def deadlines(self) -> Deadlines:
        """The put-lease and unit-liveness deadlines (`Deadlines`).

        Raises:
            ConfigError: a deadline is not a positive number of seconds, or the unit is
                declared lost before it is suspended.
        """
        try:
            return Deadlines(
                self.put_lease,
                self.unit_suspend_after,
                self.unit_lost_after,
                self.waiting_warning_after,
            )
        except InvalidRequestError as exc:
            raise ConfigError(f"config: {exc}") from None

    def load_curve(self) -> CurveServer | None:
        """The CURVE keys of ``[curve]`` (None without it)."""
        return self.curve.load() if self.curve is not None else None


def _check_types(config: Config) -> None:
    """Check (and set) each attribute of ``config`` as its TOML key is checked: msgspec checks
    types only when it decodes, so ``Config(num_storage_units=2.0)``, ``capacity=True`` or
    ``auto_clear_tasks="learner"`` built in Python were taken as they came. numpy's scalars
    (configs are built from arrays) count as Python's, paths (``os.PathLike``) as strings.

    Raises:
        ConfigError: naming the attribute and what it takes.
    """
    for field in msgspec.structs.fields(config):
        value = getattr(config, field.name)
        try:
            checked = msgspec.convert(_plain(value), field.type, strict=True, dec_hook=_decode_spec)
        except msgspec.ValidationError as exc:
            text, _, at = str(exc).partition(" - at `")
            if at.startswith("key` in"):  # (task_samplers' keys)
                raise ConfigError(
                    f"{field.name}: a key is a task name, {text.lower()}".replace("`", "")
                ) from None
            text += f" - at `$.{field.name}{at[1:] if at else '`'}"
            raise ConfigError(_describe(msgspec.ValidationError(text))) from None
        if checked is not value:
            setattr(config, field.name, checked)


def _plain(value: Any) -> Any:
    """numpy's scalars as Python's, paths as strings, in lists too (see `_check_types`)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _with_specs(data: Any) -> Any:
    """``data`` with its sampler tables parsed, so that their errors name the whole key
    (msgspec's paths do not name dict keys)."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    if out.get("sampler") is not None and not isinstance(out["sampler"], SamplerSpec):
        out["sampler"] = SamplerSpec.from_table(out["sampler"], "sampler")
    tasks = out.get("task_samplers")
    if isinstance(tasks, Mapping):
        out["task_samplers"] = {
            task: spec
            if isinstance(spec, SamplerSpec)
            else SamplerSpec.from_table(spec, f"task_samplers.{task}")
            for task, spec in tasks.items()
        }
    return out


def _decode_spec(kind: type, obj: Any) -> Any:
    if kind is SamplerSpec:
        if isinstance(obj, SamplerSpec):
            return obj
        # not a table: the key is prefixed by _describe, which knows where msgspec was
        return SamplerSpec.from_table(obj, "")
    raise NotImplementedError(kind)


def _encode_spec(obj: Any) -> Any:
    if isinstance(obj, SamplerSpec):
        return obj.to_table()
    raise NotImplementedError(type(obj))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_AT = re.compile(r" - at `\$(.*)`$")


def _describe(exc: msgspec.ValidationError) -> str:
    """msgspec's ``"Expected `int`, got `str` - at `$.admission.capacity`"`` as
    ``"admission.capacity: expected int, got str"``."""
    text = str(exc)
    path = ""
    at = _AT.search(text)
    if at:
        path = at.group(1).lstrip(".")
        path = re.sub(r"\[(['\"]?)([^\]]*?)\1\]", r".\2", path).lstrip(".")
        text = text[: at.start()]
    unknown = _UNKNOWN.match(text)
    if unknown:
        key = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return f"{key}: unknown key (known: {_known_keys(path)})"
    text = text.replace("`", "")
    if text.startswith("."):  # a SamplerSpec error, keyed relative to the spec
        return f"{path}{text}"
    # our own errors raised in __post_init__ / dec_hook already start with their key
    if path and text.startswith(": "):
        text = text[2:]
    message = text[0].lower() + text[1:] if text else text
    return f"{path}: {message}" if path else message


def _known_keys(path: str) -> str:
    head = path.split(".")[0] if path else ""
    struct: Any = {"admission": AdmissionSection, "curve": CurveSection}.get(head, Config)
    return ", ".join(struct.__struct_fields__)


# ---- a TOML writer for what a Config holds (tables, lists, str, int, float, bool) ----------


def _dump_toml(data: Mapping[str, Any]) -> str:
    lines: list[str] = []
    _dump_table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _dump_table(table: Mapping[str, Any], path: list[str], lines: list[str]) -> None:
    subtables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if path and (len(subtables) < len(table) or not table):
        lines.extend(["", f"[{'.'.join(_toml_key(p) for p in path)}]"])
    for key, value in table.items():
        if not isinstance(value, Mapping):
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in subtables.items():
        _dump_table(value, [*path, key], lines)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()  # JSON strings are TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    raise ConfigError(f"cannot write {type(value).__name__} values as TOML: {value!r}")


def per_unit(name: str, what: str, value: T | Sequence[T], n: int) -> list[T]:
    """Setting ``name`` for each of ``n`` units: one ``value`` for all, or a list with one
    per unit (``what`` they are, in the error: ``"host ids"``).

    Raises:
        ConfigError: a list whose length is not ``n``.
    """
    if not isinstance(value, list):
        return [value] * n  # type: ignore[list-item]
    if len(value) != n:
        raise ConfigError(
            f"{name}: got {len(value)} {what} for {n} storage units; give one for all or one "
            "per unit"
        )
    return list(value)


def device_indexes(device_index: int | Sequence[int], n: int) -> list[int]:
    """Each of ``n`` units' GPU index (see `per_unit`)."""
    return per_unit("device_index", "GPU indexes", device_index, n)
