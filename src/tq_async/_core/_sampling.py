"""Running a sampler: the call the core hands out, and the checks of a sampler's answer.

A sampler may be ``async def``, so running it is an effect: the core decides *what* to ask
(`SampleCall`: the ready rows, the batch size, the context) and runs a plain sampler
itself; an ``async`` sampler's call comes back to the shell as `Awaiting`, to be
awaited and fed back. The helpers here check what a sampler answered (`check_result`,
`check_shares`) and cut a global batch into DP shares (`split_even`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Generator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointError, InvalidRequestError, TQError
from .._logging import get_logger
from .._wire._protocol import GetMeta, MetaReply
from ..samplers import BaseSampler, StaleRows
from ._ready import ReadyView
from ._state import Partition, RecordKey

__all__ = [
    "TAILS",
    "Awaiting",
    "Decision",
    "SampleCall",
    "accepted_kwargs",
    "apply_tail",
    "load_states",
    "check_result",
    "check_sampler",
    "check_shares",
    "check_task_samplers",
    "sampler_error",
    "split_even",
]


log = get_logger(__name__)

#: what a final global batch that cannot be split evenly does (see `SampleCall`)
TAILS = ("uneven", "drop", "error")


@dataclass(slots=True, eq=False)
class SampleCall:
    """An effect: run the sampler on these ready rows, then feed the answer back.

    ``dp_size`` is set for a global batch (`BaseSampler.sample_shares`, or
    `BaseSampler.sample` for ``batch_size * dp_size`` rows).
    """

    partition: Partition
    sampler: BaseSampler
    ready: ReadyView
    batch_size: int
    ctx: dict[str, Any]
    final: bool
    #: what the sampler marks stale (None: it is given no ``stale``, see ``trusted``)
    stale: StaleRows | None
    dp_size: int | None = None
    #: a built-in sampler that reads no row views, marks nothing stale and answers rows of
    #: ``ready`` (so its answer is not checked against the partition again)
    trusted: bool = False
    #: the recorded batch the answer goes to (None: not recorded)
    key: RecordKey | None = None
    #: the sampler answered through ``sample_shares``
    shares: bool = False
    #: a batch below the asked one, decided first (``record_from``): this request for it
    earlier: GetMeta | None = None
    #: the partition's `Partition.moves` when the call was made
    moves: int = 0

    def run(self) -> Any:
        """Call the sampler: its answer, or an awaitable of it.

        An exception the sampler raises (``ValueError``, ...) reaches the caller as
        `InvalidRequestError` naming the sampler, without a server traceback.
        """
        try:
            result = self._call()
        except TQError:
            raise
        except Exception as exc:
            raise sampler_error(self.sampler, exc) from None
        # (a plain sampler's tuple is never awaitable: ``isawaitable`` costs ~1 us a call)
        if type(result) is not tuple and inspect.isawaitable(result):
            return _Mapped(self.sampler, result)
        return result

    def _call(self) -> Any:
        if self.dp_size is not None:
            shares = getattr(self.sampler, "sample_shares", None)
            ctx = {k: v for k, v in self.ctx.items() if k != "dp_size"}
            answer = (
                None if shares is None else shares(self.ready, self.batch_size, self.dp_size, **ctx)
            )
            if answer is not None:
                self.shares = True
                return answer
            return self.sampler.sample(self.ready, self.batch_size * self.dp_size, **self.ctx)
        return self.sampler.sample(self.ready, self.batch_size, **self.ctx)


#: what get_meta can come to: a reply, "run the sampler", or None (wait for a wake-up)
Decision = MetaReply | SampleCall | None


@dataclass(slots=True, eq=False)
class Awaiting:
    """An ``async`` sampler's call, started: the shell awaits `answer` and hands it to
    `resume`."""

    call: SampleCall
    answer: Awaitable[Any]


def check_sampler(sampler: Any, what: str = "sampler") -> BaseSampler:
    """``sampler`` if it is a sampler: an object with a ``sample`` method (a
    `BaseSampler`), not its class, not a name.

    Raises:
        InvalidRequestError: naming ``what`` (it failed deep in the controller's start, an
            AttributeError in an ExceptionGroup).
    """
    if isinstance(sampler, type):
        raise InvalidRequestError(
            f"{what} must be a sampler instance, got the class {sampler.__name__}: pass "
            f"{sampler.__name__}()"
        )
    if not callable(getattr(sampler, "sample", None)):
        raise InvalidRequestError(
            f"{what} must be a sampler (a tq.BaseSampler such as tq.GRPOGroupNSampler(8)), "
            f"got {type(sampler).__name__} {sampler!r:.80}"
        )
    return sampler  # type: ignore[no-any-return]


def check_task_samplers(task_samplers: Any) -> dict[str, BaseSampler]:
    """``task_samplers`` as a dict of task names to samplers (see `check_sampler`)."""
    if not isinstance(task_samplers, Mapping):
        raise InvalidRequestError(
            f"task_samplers must be a dict of task names to samplers, e.g. {{'learner': "
            f"tq.GRPOGroupNSampler(8)}}, got {type(task_samplers).__name__}"
        )
    for task in task_samplers:
        if not isinstance(task, str) or not task:
            raise InvalidRequestError(
                f"task_samplers' keys are task names (non-empty strings), got {task!r}"
            )
    return {t: check_sampler(s, f"task_samplers[{t!r}]") for t, s in task_samplers.items()}


def accepted_kwargs(sampler: Any) -> frozenset[str] | None:
    """Names ``sampler.sample`` accepts as keywords, or None when it takes ``**kwargs``."""
    try:
        params = inspect.signature(sampler.sample).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


def group_limits(samplers: Sequence[BaseSampler]) -> dict[str, int]:
    """Tag -> the most rows of a partition one value may have: the prompt groups of the
    samplers (`BaseSampler.group_tag`; a put never overfills one). Several samplers
    grouping by one tag: the largest ``n``, so that no sampler's groups are refused."""
    limits: dict[str, int] = {}
    for smp in samplers:
        grouping = getattr(smp, "group_tag", None)  # a TransferQueue sampler may lack it
        if grouping is not None:
            tag, n = grouping
            limits[tag] = max(limits.get(tag, 0), n)
    return limits


def too_few(sampler: Any, req: GetMeta, ready: Sized, dp_size: int | None) -> bool:
    """Whether a sampler is not asked yet (the partition not final): as in TransferQueue, one
    without `short_ready_ok` is called only once the request's rows are
    ready (``batch_size * dp_size`` for a global batch) or it holds this rank's answer already
    (``has_cached_result``)."""
    if getattr(sampler, "short_ready_ok", False) or len(ready) >= req.batch_size * (dp_size or 1):
        return False
    has = getattr(sampler, "has_cached_result", None)
    try:
        return not (has is not None and has(req.partition_id, req.task_name, req.sampling_config))
    except Exception as exc:
        raise sampler_error(sampler, exc) from None


def sampler_error(sampler: Any, exc: Exception) -> InvalidRequestError:
    """A sampler's own exception, as the caller sees it (no server traceback)."""
    return InvalidRequestError(
        f"sampler {type(sampler).__name__} raised {type(exc).__name__}: {exc}; check the "
        "request (batch_size, sampling_config) against what the sampler accepts"
    )


class _Mapped:
    """An async sampler's answer, its exceptions mapped like a sync sampler's; ``close()``
    drops it unawaited (the sampler's coroutine is closed unstarted, a future cancelled)."""

    __slots__ = ("result", "sampler")

    def __init__(self, sampler: Any, result: Awaitable[Any]) -> None:
        self.sampler = sampler
        self.result = result

    def __await__(self) -> Generator[Any, None, Any]:
        try:
            return (yield from self.result.__await__())
        except TQError:
            raise
        except Exception as exc:
            raise sampler_error(self.sampler, exc) from None

    def close(self) -> None:
        if inspect.iscoroutine(self.result):
            self.result.close()
        elif isinstance(self.result, asyncio.Future):
            self.result.cancel()


def check_result(result: Any) -> tuple[list[int], list[int]]:
    """A sampler's ``(sampled, consumed)`` as two lists of ints, or InvalidRequestError."""
    try:
        sampled, consumed = result
        sampled = [int(r) for r in sampled]
        consumed = [int(r) for r in consumed]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            "a sampler must return (sampled, consumed), two lists of row indexes; "
            f"got {type(result).__name__}"
        ) from exc
    return sampled, consumed


def check_shares(result: Any, dp_size: int) -> tuple[list[list[int]], list[int]]:
    """A ``sample_shares`` answer: ``dp_size`` lists of rows (or none) and the consumed rows."""
    try:
        shares_in, consumed_in = result
        shares = [[int(r) for r in share] for share in shares_in]
        consumed = [int(r) for r in consumed_in]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            "sample_shares must return (shares, consumed): one list of rows per rank and "
            f"the rows to consume; got {type(result).__name__}"
        ) from exc
    if not shares:
        return [[] for _ in range(dp_size)], consumed
    if len(shares) != dp_size:
        raise InvalidRequestError(
            f"sample_shares returned {len(shares)} shares for {dp_size} ranks"
        )
    return shares, consumed


def split_even(rows: Sequence[int], dp_size: int, group: int = 1) -> list[list[int]]:
    """Cut ``rows`` in order into ``dp_size`` shares, runs of ``group`` rows kept together.

    Share lengths differ by at most one group (earlier ranks get the longer shares); when
    ``len(rows)`` is not a multiple of ``group`` the rows are split one by one.
    """
    if group < 1 or len(rows) % group:
        group = 1
    n_groups = len(rows) // group
    base, extra = divmod(n_groups, dp_size)
    shares = []
    start = 0
    for rank in range(dp_size):
        size = (base + (rank < extra)) * group
        shares.append(list(rows[start : start + size]))
        start += size
    return shares


def apply_tail(req: GetMeta, shares: list[list[int]], tail: str) -> list[list[int]]:
    """The shares of a global batch that do not split evenly, after the ``tail`` policy:
    as they are (``"uneven"``), cut to the shortest (``"drop"``, with a warning; the rows
    cut stay consumed), or `InvalidRequestError` (``"error"``)."""
    lengths = {len(s) for s in shares}
    if tail == "error":
        raise InvalidRequestError(
            f"the last global batch of partition {req.partition_id!r} for task "
            f"{req.task_name!r} has {sum(map(len, shares))} rows, which do not split evenly "
            f"over dp_size={len(shares)} (shares of {sorted(lengths)} rows); put a multiple of "
            "dp_size x batch_size rows, or ask with tail='uneven' or 'drop'"
        )
    if tail != "drop":
        return shares
    keep = min(lengths)
    log.warning(
        "dropping the uneven tail of a global batch",
        partition=req.partition_id,
        task=req.task_name,
        rows=sum(len(s) - keep for s in shares),
        dp_size=len(shares),
    )
    return [s[:keep] for s in shares]


def load_states(
    samplers: Sequence[tuple[str, Any]], states: Mapping[str, Any], source: str, fix: str
) -> None:
    """``load_state_dict`` each ``(name, sampler)`` with ``states[name]`` (``{}``: none);
    what a sampler raises is a `CheckpointError` naming it, the state's ``source`` and
    what to do (``fix``), not the sampler's bare exception."""
    for name, smp in samplers:
        try:
            smp.load_state_dict(states.get(name, {}))
        except Exception as exc:
            raise CheckpointError(
                f"sampler {type(smp).__name__} ({name}) could not load its state from "
                f"{source} ({type(exc).__name__}: {exc}); {fix}"
            ) from None
