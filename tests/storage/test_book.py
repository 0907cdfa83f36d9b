"""The storage unit's Book alone: who holds which region, and what each step gives back.

No arena, socket or event loop: regions are plain records, the NIXL claims' clock is the
test's own.
"""

from __future__ import annotations

from tq_async._paths._nixl import Claims
from tq_async._paths._shm import Region
from tq_async._storage._book import Book

A, B = b"client-a", b"client-b"


def _book(now: list[float] | None = None) -> Book:
    clock = (lambda: now[0]) if now is not None else (lambda: 0.0)
    book = Book(claims=Claims(ttl=10.0, clock=clock))
    book.peers[A] = 101
    book.peers[B] = 202
    return book


def test_a_client_is_known_by_its_pid_a_nixl_client_by_zero() -> None:
    book = _book()
    book.nixl_peers.add(b"remote")
    assert book.pid(A) == 101
    assert book.pid(b"remote") == 0
    assert book.pid(b"stranger") is None
    book.nixl_peers.add(A)  # a same-host client that also said NIXL hello: its pid wins
    assert book.pid(A) == 101


def test_a_grant_is_consumed_once_and_only_by_its_holder() -> None:
    book = _book()
    region = Region(0, 4096)
    gid = book.grant(A, 101, region)
    assert book.take_grant(B, gid) is None  # another client's: refused and kept
    assert gid in book.grants
    assert book.take_grant(A, gid) is region
    assert book.take_grant(A, gid) is None  # used already
    assert book.grants == {}
    assert len(book.claims) == 0  # a same-host grant is no NIXL claim


def test_device_grants_are_their_own_and_never_claims() -> None:
    book = _book()
    host, device = Region(0, 4096), Region(0, 8192)
    g_host = book.grant(A, 101, host)
    g_dev = book.grant(A, 101, device, device=True)
    assert g_host != g_dev  # one counter: a free names either kind
    assert book.take_grant(A, g_dev) is None  # not a shared-memory grant
    assert book.take_grant(A, g_host, device=True) is None
    assert book.take_grant(A, g_dev, device=True) is device
    assert book.take_grant(A, g_host) is host


def test_free_gives_back_the_holders_grants_and_pins_and_ignores_others() -> None:
    book = _book()
    g1, g2 = Region(0, 4096), Region(4096, 4096)
    gd = Region(0, 4096)
    p1, p2, pd = Region(8192, 4096), Region(12288, 4096), Region(4096, 4096)
    ga = book.grant(A, 101, g1)
    gb = book.grant(B, 202, g2)
    gda = book.grant(A, 101, gd, device=True)
    pin = book.pin(A, 101, [p1, p2], [pd])
    assert book.device_pins == {pin: [pd]}
    out = book.free(A, [ga, gb, gda, 999], [pin, 998])
    assert out.shm == [g1, p1, p2]
    assert out.device == [gd, pd]
    assert out.expired == []
    assert list(book.grants) == [gb]  # B's grant is B's to free
    assert book.pins == {}
    assert book.device_pins == {}
    assert book.device_grants == {}
    again = book.free(A, [ga], [pin])  # freeing twice gives nothing back
    assert again.shm == []
    assert again.device == []


def test_an_exited_client_is_forgotten_and_all_it_held_goes_back() -> None:
    book = _book()
    book.peers[b"client-a-again"] = 101  # two sockets of one process
    ga, gb = Region(0, 4096), Region(4096, 4096)
    gd, pd = Region(0, 4096), Region(4096, 4096)
    pa = Region(8192, 4096)
    book.grant(A, 101, ga)
    kept = book.grant(B, 202, gb)
    book.grant(A, 101, gd, device=True)
    book.pin(A, 101, [pa], [pd])
    out = book.exited(101)
    assert sorted(r.offset for r in out.shm) == [0, 8192]
    assert sorted(r.offset for r in out.device) == [0, 4096]
    assert book.peers == {B: 202}
    assert list(book.grants) == [kept]
    assert book.pins == {}
    assert book.device_pins == {}
    assert book.device_grants == {}
    assert book.exited(101).shm == []  # nothing twice


def test_a_closed_client_is_forgotten_and_all_its_connection_held_goes_back() -> None:
    """A client that closes (its process lives on) gives back everything its connection
    holds, also what was lent with answers it will never read; another connection of its
    process keeps its own."""
    book = _book()
    again = b"client-a-again"
    book.peers[again] = 101  # two sockets of one process
    ga, gd, pa, pd = Region(0, 4096), Region(0, 4096), Region(8192, 4096), Region(4096, 4096)
    book.lend_spare(A, 101, ga)
    book.grant(A, 101, gd, device=True)
    book.pin(A, 101, [pa], [pd])
    book.lock(A, [0, 1])
    kept = book.grant(again, 101, Region(4096, 4096))
    out = book.closed(A)
    assert sorted(r.offset for r in out.shm) == [0, 8192]
    assert sorted(r.offset for r in out.device) == [0, 4096]
    assert sorted(out.chunks) == [0, 1]
    assert book.peers == {B: 202, again: 101}
    assert list(book.grants) == [kept]
    assert book.spare_bytes == 0
    assert book.pins == book.device_pins == book.device_grants == {}
    assert book.closed(A).shm == []  # nothing twice


def test_a_closed_nixl_client_is_forgotten() -> None:
    """A NIXL client (no pid tells the unit it exited) that closes is forgotten too."""
    book = _book()
    book.nixl_peers.add(b"remote")
    book.closed(b"remote")
    assert book.nixl_peers == set()
    assert book.pid(b"remote") is None


def test_nixl_claims_held_past_the_ttl_are_taken_back() -> None:
    now = [0.0]
    book = _book(now)
    assert book.expire() is None  # no NIXL claim outstanding
    book.nixl_peers.add(b"remote")
    g, p, used = Region(0, 4096), Region(4096, 4096), Region(8192, 4096)
    gid = book.grant(b"remote", 0, g)
    pin = book.pin(b"remote", 0, [p])
    consumed = book.grant(b"remote", 0, used)
    assert book.take_grant(b"remote", consumed) is used  # a claim no longer held
    mine = book.grant(A, 101, Region(12288, 4096))  # same-host: watched by pid instead
    now[0] = 9.0
    out = book.expire()
    assert out is not None
    assert out.shm == []
    assert out.expired == []
    now[0] = 11.0
    out = book.expire()
    assert out is not None
    assert out.shm == [g, p]
    assert out.expired == [("grant", gid), ("pin", pin)]
    assert list(book.grants) == [mine]
    assert book.pins == {}
    assert book.expire() is None  # every claim is settled


def test_a_claim_freed_in_time_is_not_taken_back() -> None:
    now = [0.0]
    book = _book(now)
    book.nixl_peers.add(b"remote")
    gid = book.grant(b"remote", 0, Region(0, 4096))
    assert book.free(b"remote", [gid], []).shm != []
    now[0] = 100.0
    out = book.expire()
    assert out is not None
    assert out.shm == []
    assert out.expired == []


def test_reset_forgets_everyone_and_everything() -> None:
    book = _book()
    book.nixl_peers.add(b"remote")
    book.grant(A, 101, Region(0, 4096))
    book.grant(A, 101, Region(0, 4096), device=True)
    book.pin(A, 101, [Region(4096, 4096)], [Region(4096, 4096)])
    book.data_path = "shm"
    book.reset()
    assert book.peers == {}
    assert book.nixl_peers == set()
    assert book.grants == {}
    assert book.device_grants == {}
    assert book.pins == {}
    assert book.device_pins == {}
    assert book.data_path == "shm"  # what the unit offers outlives its clients


def test_spare_grants_are_counted_until_used_freed_or_their_client_exits() -> None:
    book = _book()
    s1, s2, s3 = Region(0, 4096), Region(4096, 8192), Region(12288, 4096)
    g1 = book.lend_spare(A, 101, s1)
    g2 = book.lend_spare(A, 101, s2)
    book.lend_spare(B, 202, s3)
    plain = book.grant(A, 101, Region(16384, 4096))
    assert book.spare_bytes == 16384
    assert book.take_grant(B, g1) is None  # a spare is its client's, like any grant
    assert book.spare_bytes == 16384
    assert book.take_grant(A, g1) is s1  # used by a put
    assert book.spare_bytes == 12288
    assert book.take_grant(A, plain) is not None  # a plain grant is no spare
    assert book.spare_bytes == 12288
    assert book.free(A, [g2], []).shm == [s2]  # given back
    assert book.spare_bytes == 4096
    assert book.exited(202).shm == [s3]  # its client exited
    assert book.spare_bytes == 0
    assert book.spares == {}
    book.lend_spare(A, 101, Region(0, 4096))
    book.reset()
    assert (book.spares, book.spare_bytes) == ({}, 0)
