"""Asynchronous GRPO on tq_async: rollout, reward, reference and learner tasks stream one table.

::

    rollout workers ──put rows──▶  train@{step}  ◀──put(meta=)── reward workers
     (a GRPO group per prompt)     (a partition   ◀──put(meta=)── reference workers
                                    per step)     ──get──▶ learner: dp_size ranks x replicas,
                                                           one StreamingDataLoader each

* **Rollout workers** (coroutines) take prompts in order, sample ``n`` responses per prompt
  from their copy of the policy and ``put`` the group as new rows of the step's partition
  ``train@{step}``: prompts (``input_ids``), jagged ``responses`` and ``old_log_prob``, a
  ``uid`` (the prompt group) and ``total_lengths`` tag per row, and the ``policy_version``
  of the weights they generated with. Whoever puts a step's last group seals the partition.
* **Reward and reference workers** read rows under their own task names (``get``: the rows
  and their data) and add columns to the same rows (``put(fields, meta=meta)``): a toy
  verifiable reward with GRPO group-normalised advantages, and the log-probs of a frozen copy
  of the initial policy. Each row is handed to each task exactly once.
* **The learner** gets a row as soon as all its columns exist. It has ``dp_size`` data-parallel
  ranks (threads), each reading through a ``StreamingDataLoader``; ``SeqlenBalancedSampler``
  gives every rank of a batch the same token count. ``replicas`` loaders per rank stand for a
  rank's tensor/pipeline-parallel peers and receive identical micro-batches. Rank gradients
  are summed (the all-reduce), one optimizer step is taken per step partition, the weights are
  published to the rollout workers, ``set_policy_version(step + 1)`` is announced, the
  partition is cleared once every task has consumed it, and the loaders ``step()`` on.
* **Bounded staleness** (``--max-staleness K``, default 1): a rollout for step ``s`` calls
  ``acquire_rollout(s, n)``, which waits until the learner reached version ``s - K``, then
  generates with the newest weights. So rollouts run at most ``K`` steps ahead and no trained
  row is older than ``K`` versions. The learner's sampler is wrapped in
  ``StalenessSampler(..., on_stale="drop")``: the safety net that would drop rows beyond the
  bound (a rollout that outlived it), so with admission working it drops nothing. ``off``
  removes both; ``--staleness-sweep off,0,1,2`` prints throughput against the bound.

The model is tiny and real (an embedding and a linear layer, trained on CPU with honest
gradients). So that the overlap of generation and training shows, ``--decode-ms`` and
``--train-ms`` add the time an inference server and an accelerator would spend per token
(sleeps that leave the CPU free, as waiting on a GPU does); set both to 0 for pure compute.

Run it::

    python examples/async_grpo.py                          # embedded cluster, about 15 s
    python examples/async_grpo.py --max-staleness 0        # synchronous GRPO
    python examples/async_grpo.py --staleness-sweep off,0,1,2

    tq-async serve --config examples/grpo.toml             # elsewhere: prints TQ_ADDRESS=...
    python examples/async_grpo.py --address tcp://127.0.0.1:PORT

With ``--address`` no cluster is started, and the remote cluster's samplers and admission
apply: ``examples/grpo.toml`` is :func:`cluster_config` for the default arguments (a plain
``tq-async serve`` starts the defaults: no token balancing, no staleness bound). For other
arguments, ``--print-config`` writes the matching file::

    python examples/async_grpo.py --n-samples 8 --print-config > grpo8.toml
    tq-async serve --config grpo8.toml

If any task fails, the run stops within seconds: it clears the partitions it created (so the
next run starts clean), prints the first error with what it most likely means, and exits
with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from tensordict import TensorDict
from torch import nn

import tq_async as tq

try:  # optional: pip install -e ".[examples]"
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

EOS = 0
LEARNER_FIELDS = [
    "input_ids",
    "responses",
    "old_log_prob",
    "rewards",
    "advantages",
    "ref_log_prob",
]


def partition(step: int) -> str:
    return f"train@{step}"


# ---- the toy policy, the reward rule and the GRPO loss ---------------------------------------


class TinyPolicy(nn.Module):
    """Next-token logits from the previous token plus the prompt's mean embedding.

    Small enough to train in milliseconds on a CPU, rich enough to learn the reward rule.
    """

    def __init__(self, vocab: int, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)
        with torch.no_grad():
            self.head.bias[EOS] += 0.3  # about 1 token in 12 ends a response: varied lengths

    def context(self, prompts: torch.Tensor) -> torch.Tensor:
        return self.embed(prompts).mean(dim=1)

    def logits(self, prev: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(prev) + context))


@torch.no_grad()
def generate(
    policy: TinyPolicy, prompt: torch.Tensor, n: int, max_new_tokens: int, rng: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Sample ``n`` responses to one prompt: their tokens and per-token log-probs.

    A response ends with (and includes) EOS, or after ``max_new_tokens`` tokens.
    """
    context = policy.context(prompt[None]).expand(n, -1)
    prev = prompt[-1].repeat(n)
    tokens, log_probs = [], []
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(policy.logits(prev, context), dim=-1)
        prev = torch.multinomial(lp.exp(), 1, generator=rng).squeeze(1)
        tokens.append(prev)
        log_probs.append(lp.gather(1, prev[:, None]).squeeze(1))
        done |= prev == EOS
        if done.all():
            break
    all_tokens, all_lps = torch.stack(tokens, 1), torch.stack(log_probs, 1)
    responses, lps = [], []
    for i in range(n):
        eos = (all_tokens[i] == EOS).nonzero()
        length = int(eos[0]) + 1 if len(eos) else all_tokens.shape[1]
        responses.append(all_tokens[i, :length].clone())
        lps.append(all_lps[i, :length].clone())
    return responses, lps


def jagged(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Variable-length rows as one ``[B, j]`` jagged nested tensor (how they travel)."""
    return torch.nested.nested_tensor(list(rows), layout=torch.jagged)


def flat_tokens(
    prompts: torch.Tensor, responses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every response token of a batch, flat: ``(tokens, previous tokens, row of each)``."""
    rows = responses.unbind()
    tokens = torch.cat(rows)
    lengths = torch.tensor([len(r) for r in rows])
    prev = tokens.roll(1)
    prev[lengths.cumsum(0) - lengths] = prompts[:, -1]  # a response continues its prompt
    return tokens, prev, torch.repeat_interleave(torch.arange(len(rows)), lengths)


def token_log_probs(
    policy: TinyPolicy, prompts: torch.Tensor, responses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-prob of every response token under policy, row of each)``, flat."""
    tokens, prev, row = flat_tokens(prompts, responses)
    logits = policy.logits(prev, policy.context(prompts)[row])
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1), row


def reward_fn(prompts: torch.Tensor, responses: torch.Tensor, vocab: int) -> torch.Tensor:
    """The toy verifiable task: count up from the prompt's last token to the end of the vocab.

    The right answer to ``... 11`` is ``12 13 14 15 EOS`` (with ``vocab=16``; EOS is 0, the
    token after ``vocab - 1``). Reward: the tokens that count up by one from their
    predecessor within the answer's length, over the longer of the response and the answer,
    so neither rambling on nor stopping early pays.
    """
    tokens, prev, row = flat_tokens(prompts, responses)
    n_rows = len(prompts)
    lengths = torch.bincount(row, minlength=n_rows)
    position = torch.arange(len(tokens)) - (lengths.cumsum(0) - lengths)[row]
    answer_lengths = vocab - prompts[:, -1]
    good = (tokens == (prev + 1) % vocab) & (position < answer_lengths[row])
    return torch.zeros(n_rows).index_add_(0, row, good.float()) / torch.maximum(
        lengths, answer_lengths
    )


def group_advantages(rewards: torch.Tensor, uids: Sequence[int], n: int) -> torch.Tensor:
    """GRPO: each reward normalised by the mean and std of its prompt group."""
    by_uid: dict[int, list[int]] = {}
    for i, uid in enumerate(uids):
        by_uid.setdefault(uid, []).append(i)
    advantages = torch.empty_like(rewards)
    for uid, rows in by_uid.items():
        if len(rows) != n:
            raise RuntimeError(
                f"the reward task got {len(rows)} of the {n} rows of group {uid}; it needs "
                "whole groups (the embedded cluster gives it a GRPOGroupNSampler)"
            )
        r = rewards[rows]
        advantages[rows] = (r - r.mean()) / (r.std() + 1e-6)
    return advantages


def grpo_loss(
    policy: TinyPolicy, td: TensorDict, clip: float, kl_coef: float
) -> tuple[torch.Tensor, int]:
    """``(sum over tokens of the GRPO loss, number of tokens)`` for one micro-batch.

    Clipped policy gradient with the ratio taken against the log-probs the rollout generated
    with (this corrects for rows from an older policy), plus ``kl_coef`` x KL(policy || ref)
    (the k3 estimator). A sum, not a mean, so the learner can average over all ranks' tokens.
    """
    lp, row = token_log_probs(policy, td["input_ids"], td["responses"])
    old_lp = torch.cat(td["old_log_prob"].unbind())
    ref_lp = torch.cat(td["ref_log_prob"].unbind())
    adv = td["advantages"][row]
    ratio = torch.exp(lp - old_lp)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    log_ratio_ref = ref_lp - lp
    kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1
    return (pg + kl_coef * kl).sum(), lp.numel()


# ---- bookkeeping -----------------------------------------------------------------------------


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread; cancelling abandons the thread.

    A learner thread waits inside its loader for rows; if another task fails, they may never
    come. ``anyio.to_thread.run_sync(..., abandon_on_cancel=True)`` would let the task group
    end, but its worker threads are not daemons: the interpreter would wait for them at exit.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return  # abandoned
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def target() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as exc:
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=target, name=f"learner-{fn.__name__}", daemon=True).start()
    return await done


@dataclass
class TaskStats:
    """What one task did: the rows it processed and how long it waited for work."""

    rows: list[tuple[int, int]] = field(default_factory=list)  # (step, row id)
    waits: list[float] = field(default_factory=list)
    finished_at: float = 0.0


@dataclass
class RankResult:
    """What one learner loader (a rank's replica) did during one step."""

    grads: list[torch.Tensor]  # sums over the rank's tokens (replica 0 only)
    loss_sum: float = 0.0
    tokens: int = 0  # response tokens in the loss
    balanced_tokens: int = 0  # what the sampler balances: the rows' total_lengths tags
    batches: list[tuple[int | None, tuple[int, ...]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version of each row
    rewards: list[torch.Tensor] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)


class WeightSync:
    """The learner publishes weights after each update; rollout engines load the newest.

    A real job broadcasts them to the inference servers; here it is a copy.
    """

    def __init__(self, policy: nn.Module) -> None:
        self.version = -1
        self.state: dict[str, torch.Tensor] = {}
        self.publish(0, policy)

    def publish(self, version: int, policy: nn.Module) -> None:
        self.state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        self.version = version

    def pull(self, engine: nn.Module, engine_version: int) -> int:
        """Load the newest weights into ``engine`` (if it lacks them); their version."""
        if engine_version != self.version:
            engine.load_state_dict(self.state)
        return self.version


# ---- the pipeline ----------------------------------------------------------------------------


class Pipeline:
    """The four tasks, sharing one client, the policy and the run's bookkeeping."""

    def __init__(self, args: argparse.Namespace, address: str, client: tq.AsyncClient) -> None:
        self.args = args
        self.address = address
        self.client = client
        self.policy = TinyPolicy(args.vocab)
        self.reference = TinyPolicy(args.vocab)
        self.reference.load_state_dict(self.policy.state_dict())
        self.reference.requires_grad_(False)  # frozen: the KL anchor
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=args.lr)
        self.weights = WeightSync(self.policy)
        self.stats = {task: TaskStats() for task in ("rollout", "reward", "ref", "learner")}
        self.groups_put: Counter[int] = Counter()  # step -> groups put so far
        self.group_tokens: dict[int, tuple[int, int]] = {}  # uid -> (step, total_lengths sum)
        self.response_tokens = 0
        self.rank_tokens: list[list[int]] = []  # per step: tokens of each rank
        self.losses: list[float] = []
        self.mean_rewards: list[float] = []
        self.staleness_seen: list[int] = []  # per trained row: learner version - row version
        self.replicas_identical = True
        self.consumption_confirmed = True
        self.started = time.perf_counter()

    # -- rollout ---------------------------------------------------------------------------

    async def rollout_worker(self, worker: int, work: Iterator[tuple[int, int]]) -> None:
        """Generate a group for each ``(step, uid)`` this worker takes from ``work``."""
        args, stats, n = self.args, self.stats["rollout"], self.args.n_samples
        engine, version = TinyPolicy(args.vocab), -1  # this worker's "inference server"
        rng = torch.Generator().manual_seed(args.seed * 1000 + worker)
        for step, uid in work:  # one iterator shared by all workers: each item goes to one
            if args.max_staleness is not None:
                # wait until the learner reached version step - max_staleness (and the
                # capacity has room for n more rows)
                t0 = time.perf_counter()
                await self.client.acquire_rollout(step, n)
                stats.waits.append(time.perf_counter() - t0)
            # The newest weights are at least version step - max_staleness (the learner
            # publishes them before announcing their version), so no row this rollout puts
            # is more than max_staleness versions old when the learner trains on it.
            version = self.weights.pull(engine, version)
            try:
                meta = await self.generate_and_put(engine, version, rng, step, uid)
            except BaseException:
                if args.max_staleness is not None:  # no rows came: give the slots back
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                        await self.client.release_rollout(n)
                raise
            stats.rows.extend((step, r) for r in meta.global_indexes)
            self.group_tokens[uid] = (step, sum(t["total_lengths"] for t in meta.tags))
            self.groups_put[step] += 1
            if self.groups_put[step] == args.prompts_per_step:
                await self.client.seal(partition(step))  # readers that drain it see the end
        stats.finished_at = time.perf_counter()

    async def generate_and_put(
        self, engine: TinyPolicy, version: int, rng: torch.Generator, step: int, uid: int
    ) -> tq.BatchMeta:
        """Sample prompt ``uid``'s group and put it as new rows of ``step``'s partition."""
        args, n = self.args, self.args.n_samples
        prompt_rng = torch.Generator().manual_seed(args.seed * 1_000_003 + uid)
        prompt = torch.randint(1, args.vocab, (args.prompt_len,), generator=prompt_rng)
        responses, log_probs = await anyio.to_thread.run_sync(
            generate, engine, prompt, n, args.max_new_tokens, rng
        )
        # the time a server would take to decode the group (as long as its longest answer)
        await anyio.sleep(args.decode_ms / 1000 * max(len(r) for r in responses))
        meta = await self.client.put(
            {
                "input_ids": prompt.expand(n, -1).clone(),
                "responses": jagged(responses),
                "old_log_prob": jagged(log_probs),
            },
            partition_id=partition(step),
            tags=[{"uid": uid, "total_lengths": args.prompt_len + len(r)} for r in responses],
            policy_version=version,
        )
        self.response_tokens += sum(len(r) for r in responses)
        return meta

    # -- reward and reference ----------------------------------------------------------------

    async def consume(
        self,
        task: str,
        batch_size: int,
        add_fields: Callable[[TensorDict, tq.BatchMeta], Awaitable[dict[str, torch.Tensor]]],
    ) -> None:
        """Read every row of every step for ``task``; put the fields ``add_fields`` makes."""
        stats = self.stats[task]
        for step in range(self.args.steps):
            while True:
                t0 = time.perf_counter()
                # rows and their data in one call (one round trip when the cells are local)
                td, meta = await self.client.get(
                    ["input_ids", "responses"], batch_size, partition(step), task
                )
                stats.waits.append(time.perf_counter() - t0)
                if meta.end_of_stream:
                    break  # sealed, and this task has had every row
                await self.client.put(await add_fields(td, meta), meta=meta)
                stats.rows.extend((step, r) for r in meta.global_indexes)
        stats.finished_at = time.perf_counter()

    async def rewards(self, td: TensorDict, meta: tq.BatchMeta) -> dict[str, torch.Tensor]:
        rewards = reward_fn(td["input_ids"], td["responses"], self.args.vocab)
        uids = [tags["uid"] for tags in meta.tags]
        advantages = group_advantages(rewards, uids, self.args.n_samples)
        return {"rewards": rewards, "advantages": advantages}

    async def ref_log_probs(self, td: TensorDict, meta: tq.BatchMeta) -> dict[str, torch.Tensor]:
        def compute() -> torch.Tensor:
            with torch.no_grad():
                lp, row = token_log_probs(self.reference, td["input_ids"], td["responses"])
            return jagged(lp.split(torch.bincount(row, minlength=len(meta)).tolist()))

        return {"ref_log_prob": await anyio.to_thread.run_sync(compute)}

    # -- learner -----------------------------------------------------------------------------

    async def learner(self, progress: Any) -> None:
        args = self.args
        loaders = {
            (rank, replica): self.loader(rank)
            for rank in range(args.dp_size)
            for replica in range(args.replicas)
        }
        await self.client.set_policy_version(0)
        for step in range(args.steps):
            # every rank's replicas stream the rank's share of the step, each in a thread
            results: dict[tuple[int, int], RankResult] = {}
            async with anyio.create_task_group() as tg:
                for key, loader in loaders.items():
                    loader.step(partition(step))  # batch_index 0 of this step's partition
                    tg.start_soon(self.read_in_thread, loader, key, results)
            loss = self.update([results[rank, 0] for rank in range(args.dp_size)])

            self.weights.publish(step + 1, self.policy)  # before announcing the version
            await self.client.set_policy_version(step + 1)  # admits the waiting rollouts
            # every task is done with the partition (the learner reads a row only after reward
            # and ref wrote it, and has drained it): free it
            for task in ("reward", "ref", "learner"):
                done = await self.client.check_consumption_status(partition(step), task)
                self.consumption_confirmed &= done
            await self.client.clear_partition(partition(step))
            self.record_step(step, results, loss, progress)
        self.stats["learner"].finished_at = time.perf_counter()

    def loader(self, rank: int) -> tq.StreamingDataLoader:
        dataset = tq.StreamingDataset(
            self.address,
            LEARNER_FIELDS,
            batch_size=self.args.rank_batch_size,  # rows per rank per batch_index
            micro_batch_size=self.args.micro_batch_size,
            partition_id=partition(0),
            task_name="learner",
            dp_rank=rank,
            # the controller decides each global batch for every rank at once: every rank
            # takes the same number of steps, whatever the cluster's sampler (--address)
            dp_size=self.args.dp_size,
        )
        return tq.StreamingDataLoader(dataset)

    async def read_in_thread(
        self,
        loader: tq.StreamingDataLoader,
        key: tuple[int, int],
        results: dict[tuple[int, int], RankResult],
    ) -> None:
        _, replica = key
        # if another task fails, do not wait for a thread that may be blocked on a partition
        # that will now never be sealed (and do not let it keep the process alive)
        results[key] = await in_daemon_thread(self.train_on_partition, loader, replica == 0)

    def train_on_partition(self, loader: tq.StreamingDataLoader, compute: bool) -> RankResult:
        """A rank's share of one step (in a worker thread): stream micro-batches, sum grads.

        Replica 0 of each rank computes. In a real job the other replicas would compute their
        shard of the model on the same data; here they only record the rows they got.
        ``torch.autograd.grad`` leaves ``.grad`` alone, so the ranks can share the policy.
        """
        params = list(self.policy.parameters())
        out = RankResult(grads=[torch.zeros_like(p) for p in params] if compute else [])
        batches = iter(loader)
        while True:
            t0 = time.perf_counter()
            item = next(batches, None)  # blocks until a micro-batch is ready, or the end
            out.waits.append(time.perf_counter() - t0)
            if item is None:
                return out
            td, meta = item
            out.batches.append((meta.batch_index, tuple(meta.global_indexes)))
            out.versions.extend(meta.row_policy_versions())
            out.balanced_tokens += sum(tags["total_lengths"] for tags in meta.tags)
            if compute:
                loss, tokens = grpo_loss(self.policy, td, self.args.clip, self.args.kl_coef)
                for acc, grad in zip(out.grads, torch.autograd.grad(loss, params), strict=True):
                    acc += grad
                out.loss_sum += loss.item()
                out.tokens += tokens
                out.rewards.append(td["rewards"])
                # the time an accelerator would spend on this micro-batch
                time.sleep(self.args.train_ms / 1000 * tokens)

    def update(self, ranks: list[RankResult]) -> float:
        """All-reduce the ranks' gradient sums, take one optimizer step; the step's loss.

        The ranks here are threads of one process, so the all-reduce is a sum in memory.
        Dividing by every rank's tokens gives the token-mean loss of the whole step, exactly
        the gradient one process would compute on the whole batch. With one model per rank
        (real DDP), each rank would apply the same summed gradient to its copy.
        """
        params = list(self.policy.parameters())
        tokens = max(1, sum(r.tokens for r in ranks))
        for i, p in enumerate(params):
            p.grad = torch.stack([r.grads[i] for r in ranks]).sum(dim=0) / tokens
        nn.utils.clip_grad_norm_(params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return sum(r.loss_sum for r in ranks) / tokens

    def record_step(
        self, step: int, results: dict[tuple[int, int], RankResult], loss: float, progress: Any
    ) -> None:
        args, stats = self.args, self.stats["learner"]
        for (rank, replica), res in results.items():
            stats.waits.extend(res.waits)
            if replica == 0:
                stats.rows.extend((step, r) for _, rows in res.batches for r in rows)
                self.staleness_seen.extend(step - v for v in res.versions if v >= 0)
            else:
                self.replicas_identical &= res.batches == results[rank, 0].batches
        per_rank = [results[rank, 0].balanced_tokens for rank in range(args.dp_size)]
        rewards = [r for rank in range(args.dp_size) for r in results[rank, 0].rewards]
        reward = torch.cat(rewards).mean().item() if rewards else math.nan
        self.rank_tokens.append(per_rank)
        self.losses.append(loss)
        self.mean_rewards.append(reward)
        if progress is not None:
            progress.set_postfix(loss=f"{loss:+.4f}", reward=f"{reward:.3f}")
            progress.update(1)
        if not args.quiet:
            line = (
                f"step {step + 1:>3}/{args.steps}  loss {loss:+.4f}  mean reward {reward:.3f}"
                f"  tokens per rank {per_rank}"
            )
            (tqdm.write if tqdm is not None else print)(line)

    # -- summary -----------------------------------------------------------------------------

    def summary(self, wall: float, dropped: int) -> dict[str, Any]:
        """The run in numbers; ``exactly_once`` compares every task's rows with the rows put."""
        args = self.args
        produced = Counter(self.stats["rollout"].rows)
        tasks: dict[str, dict[str, Any]] = {}
        for task, st in self.stats.items():
            seen = Counter(st.rows)
            once = all(count == 1 for count in seen.values()) and set(seen) <= set(produced)
            # the learner's sampler consumes stale rows without delivering them
            once &= len(seen) + (dropped if task == "learner" else 0) == len(produced)
            tasks[task] = {
                "rows": len(st.rows),
                "rows_per_s": len(st.rows) / max(st.finished_at - self.started, 1e-9),
                "wait_mean_s": statistics.fmean(st.waits) if st.waits else 0.0,
                "wait_max_s": max(st.waits, default=0.0),
                "exactly_once": once,
            }
        ratios = [max(t) / max(1, min(t)) for t in self.rank_tokens]
        return {
            "steps": args.steps,
            "rows": len(produced),
            "response_tokens": self.response_tokens,
            "wall_s": wall,
            "samples_per_s": len(produced) / wall,
            "tokens_per_s": self.response_tokens / wall,
            "max_staleness": args.max_staleness,
            "remote": bool(args.address),
            "tasks": tasks,
            "exactly_once": all(t["exactly_once"] for t in tasks.values()),
            "consumption_confirmed": self.consumption_confirmed,
            "replicas_identical": self.replicas_identical,
            "dropped": dropped,
            "staleness_seen_max": max(self.staleness_seen, default=0),
            "staleness_seen_mean": statistics.fmean(self.staleness_seen or [0]),
            "balance": {
                "tokens_per_rank": self.rank_tokens,
                "ratio_mean": statistics.fmean(ratios) if ratios else 1.0,
                "ratio_max": max(ratios, default=1.0),
                "in_order_ratio_mean": self.in_order_ratio(),
            },
            "losses": self.losses,
            "final_loss": self.losses[-1] if self.losses else math.nan,
            "mean_rewards": self.mean_rewards,
        }

    def in_order_ratio(self) -> float:
        """The max/min token ratio had each batch's groups been dealt to ranks in uid order."""
        args = self.args
        groups_per_rank = args.rank_batch_size // args.n_samples
        ratios = []
        for step in range(args.steps):
            tokens = [tok for _, (s, tok) in sorted(self.group_tokens.items()) if s == step]
            per_rank = [0] * args.dp_size
            for i, tok in enumerate(tokens):
                per_rank[i % (groups_per_rank * args.dp_size) // groups_per_rank] += tok
            if tokens:
                ratios.append(max(per_rank) / max(1, min(per_rank)))
        return statistics.fmean(ratios) if ratios else 1.0


# ---- running it ------------------------------------------------------------------------------


def cluster_config(args: argparse.Namespace) -> tq.Config:
    """The services' configuration: a sampler per consuming task, and admission for staleness.

    ``examples/grpo.toml`` is this for the default arguments, so that ``tq-async serve
    --config examples/grpo.toml`` serves ``--address`` runs as the embedded cluster does.
    """
    n = args.n_samples
    learner = tq.SamplerSpec(
        "tq_async:SeqlenBalancedSampler",
        {"n_samples_per_prompt": n, "dp_size": args.dp_size, "n_replicas": args.replicas},
    )
    admission = None
    if args.max_staleness is not None:
        k = args.max_staleness
        learner = tq.SamplerSpec(
            "tq_async:StalenessSampler", {"inner": learner, "max_staleness": k, "on_stale": "drop"}
        )
        admission = tq.AdmissionSection(
            max_staleness=k,
            # rollouts run at most k steps ahead: at most k + 1 steps of rows are in flight
            capacity=(k + 1) * args.prompts_per_step * n,
            learner_task="learner",
        )
    return tq.Config(
        num_storage_units=2,
        # whole prompt groups for the reward task (it normalises rewards per group)
        task_samplers={
            "reward": tq.SamplerSpec("tq_async:GRPOGroupNSampler", {"n_samples_per_prompt": n}),
            "learner": learner,
        },
        admission=admission,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the pipeline once; return its summary (see :meth:`Pipeline.summary`)."""
    check_args(args)
    torch.manual_seed(args.seed)
    async with AsyncExitStack() as stack:
        if args.address:
            address = args.address
        else:
            cluster = await stack.enter_async_context(tq.local_cluster(config=cluster_config(args)))
            address = cluster.address
        client = await stack.enter_async_context(tq.AsyncClient.connect(address))
        leftovers = [p for p in await client.list_partitions() if p.startswith("train@")]
        if leftovers:
            raise SystemExit(
                f"{address} already holds the partitions {leftovers[:5]}: another run of this "
                "example is using this cluster, or one was killed before it could clear them. "
                "Wait for that run, or start a fresh `tq-async serve` (or clear them: "
                "client.clear_partition(p) for each)"
            )
        dropped_before = (await client.staleness_status()).get("dropped", 0)

        pipeline = Pipeline(args, address, client)
        show_bar = tqdm is not None and sys.stdout.isatty() and not args.quiet
        progress = tqdm(total=args.steps, desc="learner steps", leave=False) if show_bar else None
        work = (  # (step, uid) of every prompt group, in order
            (step, step * args.prompts_per_step + g)
            for step in range(args.steps)
            for g in range(args.prompts_per_step)
        )
        try:
            async with anyio.create_task_group() as tg:
                for worker in range(args.rollout_workers):
                    tg.start_soon(pipeline.rollout_worker, worker, work)
                for _ in range(args.reward_workers):
                    tg.start_soon(pipeline.consume, "reward", args.n_samples, pipeline.rewards)
                for _ in range(args.ref_workers):
                    tg.start_soon(
                        pipeline.consume, "ref", 2 * args.n_samples, pipeline.ref_log_probs
                    )
                tg.start_soon(pipeline.learner, progress)
        except BaseException:
            # a task failed: free what this run created, so that the next run starts clean
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await clear_run_partitions(client)
            raise
        finally:
            if progress is not None:
                progress.close()
        wall = time.perf_counter() - pipeline.started
        dropped = (await client.staleness_status()).get("dropped", 0) - dropped_before
    return pipeline.summary(wall, dropped)


async def clear_run_partitions(client: tq.AsyncClient) -> None:
    """Clear every ``train@`` partition (best effort: the cluster may be the failure)."""
    try:
        for pid in await client.list_partitions():
            if pid.startswith("train@"):
                await client.clear_partition(pid)
    except tq.TQError as exc:
        print(f"could not clear this run's partitions: {exc}", file=sys.stderr)


def first_error(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups of failed tasks."""
    cancelled = asyncio.CancelledError  # anyio.run runs asyncio
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:  # type: ignore[attr-defined]
        group: tuple[BaseException, ...] = exc.exceptions  # type: ignore[attr-defined]
        exc = next((e for e in group if not isinstance(e, cancelled)), group[0])
    return exc


def diagnose(error: BaseException, args: argparse.Namespace) -> str:
    """What a failure most likely means, and what to do about it."""
    text = str(error)
    if args.address and (
        "n_samples_per_prompt" in text or "whole groups" in text or "sampler" in text
    ):
        return (
            f"the cluster at {args.address} has samplers set up for other arguments than "
            "this run's (examples/grpo.toml is for the defaults: --n-samples 4 --dp-size 2 "
            "--replicas 2 --prompts-per-step 16 --max-staleness 1). Start it with this run's "
            "configuration: python examples/async_grpo.py ARGS --print-config > run.toml; "
            "tq-async serve --config run.toml"
        )
    if isinstance(error, (tq.BrokenError, tq.TQTimeoutError)) and args.address:
        return f"is `tq-async serve` running at {args.address}, and reachable from here?"
    return "a task of the pipeline failed (traceback above); the run was stopped"


def print_summary(s: dict[str, Any]) -> None:
    bound = "off" if s["max_staleness"] is None else str(s["max_staleness"])
    if s["remote"]:
        bound += (
            " (enforced only if the remote cluster has admission and StalenessSampler, as"
            " `tq-async serve --config examples/grpo.toml` does)"
        )
    print(
        f"\n{s['rows']} samples ({s['response_tokens']} response tokens) in {s['steps']} steps: "
        f"{s['wall_s']:.1f} s, {s['samples_per_s']:.0f} samples/s; max staleness {bound}\n"
    )
    print(f"{'task':<9}{'rows':>6}{'rows/s':>8}{'wait mean':>11}{'wait max':>10}  exactly once")
    for task, t in s["tasks"].items():
        print(
            f"{task:<9}{t['rows']:>6}{t['rows_per_s']:>8.0f}{t['wait_mean_s'] * 1e3:>9.1f}ms"
            f"{t['wait_max_s'] * 1e3:>8.0f}ms  {'yes' if t['exactly_once'] else 'NO'}"
        )
    b = s["balance"]
    yes_no = {True: "yes", False: "NO"}
    print(
        f"\ntokens per DP rank per step, max/min: mean {b['ratio_mean']:.3f}, worst "
        f"{b['ratio_max']:.3f} (dealt in uid order instead: mean {b['in_order_ratio_mean']:.3f})"
        f"\nstaleness of trained rows: mean {s['staleness_seen_mean']:.2f}, max "
        f"{s['staleness_seen_max']}; stale rows dropped: {s['dropped']}"
        f"\nthe controller confirms every task consumed every row: "
        f"{yes_no[s['consumption_confirmed']]}; replicas got identical micro-batches: "
        f"{yes_no[s['replicas_identical']]}"
        f"\nfinal loss {s['final_loss']:+.4f}; mean reward {s['mean_rewards'][0]:.3f} (step 1)"
        f" -> {s['mean_rewards'][-1]:.3f} (step {s['steps']})"
    )


async def sweep(args: argparse.Namespace, bounds: Sequence[int | None]) -> list[dict[str, Any]]:
    """Run the pipeline once per staleness bound; print throughput against the bound."""
    results = []
    for k in bounds:
        print(f"running with max staleness {'off' if k is None else k} ...", flush=True)
        results.append(await run(argparse.Namespace(**{**vars(args), "max_staleness": k})))
    print(f"\n{'max staleness':>13}{'samples/s':>11}{'tokens/s':>10}{'wall':>8}", end="")
    print(f"{'stale max':>11}{'dropped':>9}")
    for s in results:
        bound = "off" if s["max_staleness"] is None else str(s["max_staleness"])
        print(
            f"{bound:>13}{s['samples_per_s']:>11.0f}{s['tokens_per_s']:>10.0f}{s['wall_s']:>7.1f}s"
            f"{s['staleness_seen_max']:>11}{s['dropped']:>9}"
        )
    return results


def check_args(args: argparse.Namespace) -> None:
    if args.rank_batch_size % args.n_samples:
        raise SystemExit("--rank-batch-size must be a multiple of --n-samples (whole groups)")
    if args.prompts_per_step % args.dp_size:
        raise SystemExit("--prompts-per-step must be a multiple of --dp-size (no rank goes empty)")
    if args.max_staleness is not None and args.max_staleness < 0:
        raise SystemExit("--max-staleness must be >= 0, or off")


def staleness_bound(value: str) -> int | None:
    return None if value.lower() in ("off", "none") else int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--address", help="a running controller (tq-async serve); None: an embedded cluster"
    )
    p.add_argument("--steps", type=int, default=20, help="learner steps, one partition each")
    p.add_argument("--prompts-per-step", type=int, default=16, help="GRPO groups per step")
    p.add_argument("--n-samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--dp-size", type=int, default=2, help="learner data-parallel ranks")
    p.add_argument("--replicas", type=int, default=2, help="loaders per rank (TP/PP peers)")
    p.add_argument("--rank-batch-size", type=int, default=16, help="rows per rank per batch")
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--rollout-workers", type=int, default=4, help="rollout coroutines")
    p.add_argument("--reward-workers", type=int, default=2, help="reward coroutines")
    p.add_argument("--ref-workers", type=int, default=2, help="reference coroutines")
    p.add_argument("--vocab", type=int, default=16, help="tokens in the toy vocabulary")
    p.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest response")
    p.add_argument("--decode-ms", type=float, default=4.0, help="simulated ms per decoded token")
    p.add_argument("--train-ms", type=float, default=1.0, help="simulated ms per trained token")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--kl-coef", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--max-staleness",
        type=staleness_bound,
        default=1,
        metavar="K",
        help="rollouts run at most K policy versions ahead of the learner (off: unbounded)",
    )
    p.add_argument(
        "--staleness-sweep",
        type=lambda v: [staleness_bound(x) for x in v.split(",")],
        metavar="K,K,...",
        help="run once per bound (e.g. off,0,1,2) and print throughput against it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the cluster configuration (TOML) for these arguments and exit: "
        "tq-async serve --config FILE serves --address runs with it",
    )
    p.add_argument("--tiny", action="store_true", help="a run of a few seconds (for tests)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines or progress bar")
    return p


#: --tiny: sizes for a smoke test (each still settable on the command line)
TINY = {
    "steps": 3,
    "prompts_per_step": 4,
    "n_samples": 2,
    "rank_batch_size": 2,
    "micro_batch_size": 2,
    "rollout_workers": 2,
    "reward_workers": 1,
    "ref_workers": 1,
    "max_new_tokens": 12,
    "decode_ms": 0.0,
    "train_ms": 0.0,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in TINY.items():
            if getattr(args, name) == parser.get_default(name):  # not set on the command line
                setattr(args, name, value)
    if args.staleness_sweep:
        args.quiet = True
        if args.lr == parser.get_default("lr"):
            # A learning policy changes its response lengths, and so the work per sample,
            # differently in every run: freeze it, so each bound gets the same workload.
            args.lr = 0.0
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.print_config:
        check_args(args)
        print(cluster_config(args).to_toml(), end="")
        return
    torch.set_num_threads(1)  # small ops from several threads: intra-op threads only contend
    tq.configure_logging("WARNING")
    if args.staleness_sweep:
        if args.address:
            raise SystemExit(
                "--staleness-sweep needs the embedded cluster (admission is set there)"
            )
        anyio.run(sweep, args, args.staleness_sweep)
        return
    try:
        summary = anyio.run(run, args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # a task failed: one error, what it means, status 1
        error = first_error(exc)
        traceback.print_exception(type(error), error, error.__traceback__)
        print(f"\nerror: {type(error).__name__}: {error}", file=sys.stderr)
        print(f"diagnosis: {diagnose(error, args)}", file=sys.stderr)
        sys.exit(1)
    print_summary(summary)


if __name__ == "__main__":
    main()
