"""The same members re-form without a rendezvous round (ftrun.launcher.reform): votes in a
real c10d store (TCPStore under a PrefixStore, as the round's store is), one thread per node."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore

from ftrun.launcher.reform import KEEP, ROUND, Decision, Reform


class Stores:
    """A TCPStore server and, per node, a client of its own under the round's prefix (one
    connection per launcher, as in a job: a blocking wait holds its connection)."""

    def __init__(self) -> None:
        self.server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def client(self) -> Any:
        return PrefixStore("torch.rendezvous.job.3",
                           TCPStore("127.0.0.1", self.server.port, is_master=False))


@pytest.fixture
def store() -> Stores:
    return Stores()


def vote_all(store: Stores, votes: list[tuple[bool, str] | None], deadline_s: float = 5.0,
             give_up: Callable[[], str | None] = lambda: None,
             late: dict[int, threading.Event] | None = None) -> list[Decision | None]:
    """Node i votes votes[i] (None: it never votes) in its own thread; node 0 offers the
    master port. ``late``: node i votes only once its event is set."""
    out: list[Decision | None] = [None] * len(votes)

    def node(i: int, keep: bool, why: str) -> None:
        if late and i in late:
            assert late[i].wait(30)
        out[i] = Reform(store.client(), "ftrun/reform/0", len(votes)).vote(
            keep, why, 4242 if i == 0 else None, deadline_s, give_up)

    threads = [threading.Thread(target=node, args=(i, *v)) for i, v in enumerate(votes)
               if v is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return out


def test_every_node_keeps_and_reads_the_rank0_port(store: Stores) -> None:
    got = vote_all(store, [(True, "")] * 4)
    assert [d.verdict for d in got if d] == [KEEP] * 4
    assert {d.master_port for d in got if d} == {4242}


def test_one_node_that_cannot_keep_sends_everyone_to_a_round(store: Stores) -> None:
    got = vote_all(store, [(True, ""), (True, ""), (False, "a node waits to join")])
    assert [(d.verdict, d.why, d.master_port) for d in got if d] == [
        (ROUND, "a node waits to join", None)] * 3


def test_a_node_that_never_votes_sends_the_others_to_a_round_at_their_deadline(
        store: Stores) -> None:
    got = vote_all(store, [(True, ""), (True, ""), None], deadline_s=1.0)
    assert [(d.verdict, d.why) for d in got if d] == [
        (ROUND, "not every node voted in time")] * 2
    # It votes late: it follows the decision that stands, it does not keep alone.
    assert Reform(store.client(), "ftrun/reform/0", 3).vote(True, "", None, 5.0,
                                                            lambda: None).verdict == ROUND


def test_a_member_gone_stops_the_wait_before_the_deadline(store: Stores) -> None:
    gone = threading.Event()

    def give_up() -> str | None:
        return "node c left the round" if gone.is_set() else None

    timer = threading.Timer(0.3, gone.set)
    timer.start()
    got = vote_all(store, [(True, ""), (True, ""), None], deadline_s=60.0, give_up=give_up)
    timer.cancel()
    assert [(d.verdict, d.why) for d in got if d] == [(ROUND, "node c left the round")] * 2
    assert all(d.waited_s < 60 for d in got if d)


def test_the_last_voter_decides_keep_even_after_others_waited(store: Stores) -> None:
    release = threading.Event()
    timer = threading.Timer(0.8, release.set)
    timer.start()
    got = vote_all(store, [(True, ""), (True, ""), (True, "")], deadline_s=10.0,
                   late={2: release})
    assert [d.verdict for d in got if d] == [KEEP] * 3


def test_decisions_are_per_prefix(store: Stores) -> None:
    Reform(store.client(), "ftrun/reform/0", 2).veto("torch's rendezvous")
    got = [None, None]

    def node(i: int) -> None:
        got[i] = Reform(store.client(), "ftrun/reform/1", 2).vote(
            True, "", 7 if i == 0 else None, 5.0, lambda: None)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [(d.verdict, d.master_port) for d in got if d] == [(KEEP, 7)] * 2


def test_without_an_offered_port_the_master_keeps_its_own(store: Stores) -> None:
    """(--master-port given, or the ranks share the agent's store: rank 0 offers none.)"""
    got: list[Decision | None] = [None, None]

    def node(i: int) -> None:
        got[i] = Reform(store.client(), "ftrun/reform/0", 2).vote(True, "", None, 5.0,
                                                                 lambda: None)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [(d.verdict, d.master_port) for d in got if d] == [(KEEP, None)] * 2
