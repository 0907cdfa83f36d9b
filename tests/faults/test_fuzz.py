"""Fuzz the wire protocol against a live controller and storage unit.

Random frames, mutated valid requests, well-formed msgpack with wrong types and oversized
headers: no input may crash a service, and valid requests must still be answered after each.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tq_async as tq
from tq_async._wire._columns import ColumnHeader
from tq_async._wire._protocol import (
    GetMeta,
    Hello,
    ListPartitions,
    PutBegin,
    PutCommit,
    Reply,
    SetTags,
    StoreGet,
    StorePut,
    StoreStats,
    encoder,
)

TRIED = {"count": 0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tq.LocalCluster]:
    """One cluster for the whole module, on its own loop thread (fuzzing needs many inputs)."""
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(tq.local_cluster(num_storage_units=1)) as c,
    ):
        yield c
    print(f"\nfuzz: {TRIED['count']} inputs tried")


@pytest.fixture(scope="module")
def sockets(cluster: tq.LocalCluster) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context.instance()
    ctl = ctx.socket(zmq.DEALER)
    unit = ctx.socket(zmq.DEALER)
    for sock, address in ((ctl, cluster.address), (unit, cluster.unit_addresses[0])):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(address)
    yield ctl, unit
    ctl.close()
    unit.close()


def valid_requests() -> list[tuple[str, list[bytes]]]:
    header = ColumnHeader("x", "dense", "float32", (2,))
    data = torch.zeros(3, 2).numpy().tobytes()
    return [
        ("ctl", [encoder.encode((1, Hello()))]),
        ("ctl", [encoder.encode((2, PutBegin("p", [header], 3)))]),
        ("ctl", [encoder.encode((3, PutCommit("p", [0, 1, 2], ["x"])))]),
        ("ctl", [encoder.encode((4, GetMeta("p", ["x"], 1, "t", None, "peek", 0.01)))]),
        ("ctl", [encoder.encode((5, SetTags("p", [0], [{"a": 1}])))]),
        ("unit", [encoder.encode((6, StorePut("q", [0, 1, 2], [header]))), data]),
        ("unit", [encoder.encode((7, StoreGet("q", [0], ["x"])))]),
    ]


def still_answers(ctl: zmq.Socket[bytes], unit: zmq.Socket[bytes]) -> None:
    """Drain stray replies, then prove both services answer a valid request."""
    for sock, body in ((ctl, ListPartitions()), (unit, StoreStats())):
        while sock.poll(0):
            sock.recv_multipart()
        sock.send_multipart([encoder.encode((999_999, body))])
        while True:
            reply = msgspec.msgpack.decode(sock.recv_multipart()[0], type=Reply)
            if reply.rid == 999_999:
                assert reply.ok
                break


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    out = [bytearray(f) for f in frames]
    for _ in range(rng.randint(1, 4)):
        f = out[rng.randrange(len(out))]
        op = rng.random()
        if op < 0.4 and f:
            f[rng.randrange(len(f))] = rng.randrange(256)
        elif op < 0.6 and f:
            del f[rng.randrange(len(f)) :]
        elif op < 0.8:
            f[rng.randrange(len(f) + 1) : 0] = rng.randbytes(rng.randint(1, 8))
        else:
            out.append(bytearray(rng.randbytes(rng.randint(0, 64))))
    return [bytes(f) for f in out]


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)
op_names = st.sampled_from(
    [
        "Hello", "PutBegin", "PutCommit", "GetMeta", "Cancel", "Release", "Seal",
        "ClearSamples", "ClearPartition", "SetTags", "KVLookup", "KVTag", "DumpState",
        "RestoreBegin", "AcquireRollout", "TakeRecycled", "StorePut", "StoreGet", "StoreClear",
    ]
)  # fmt: skip


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    target=st.sampled_from(["ctl", "unit"]),
    kind=st.sampled_from(["random", "mutated", "typed"]),
    seed=st.integers(0, 2**32 - 1),
    op=op_names,
    args=st.lists(msgpack_values, max_size=7),
    raw=st.lists(st.binary(max_size=256), min_size=1, max_size=4),
)
def test_fuzzed_frames_never_crash_a_service(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
    target: str,
    kind: str,
    seed: int,
    op: str,
    args: list[object],
    raw: list[bytes],
) -> None:
    ctl, unit = sockets
    rng = random.Random(seed)
    if kind == "random":
        frames = raw
    elif kind == "mutated":
        target, frames = rng.choice(valid_requests())
        frames = mutate(frames, rng)
    else:
        frames = [encoder.encode([rng.randint(-5, 2**40), [op, *args]]), *raw[1:]]
    (ctl if target == "ctl" else unit).send_multipart(frames)
    TRIED["count"] += 1
    still_answers(ctl, unit)


def test_oversized_and_empty_headers(sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    ctl, unit = sockets
    big = encoder.encode([1, ["GetMeta", "p" * (8 << 20), ["x"], 1, "t"]])
    for sock in (ctl, unit):
        sock.send_multipart([big])
        sock.send_multipart([b""])
        sock.send_multipart([b"\x00" * (4 << 20), b"\x01"])
        TRIED["count"] += 3
    still_answers(ctl, unit)
