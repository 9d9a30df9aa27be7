"""ftrun's etcd v3 rendezvous backend, store and coordinator election, against a real etcd.

One 3-member cluster on loopback ports (ftrun.testing.etcd) serves the module, but for the
quorum-loss test, which stops 2 members of a cluster of its own. The tests skip where etcd is not installed (``bash scripts/setup-etcd.sh`` installs it), and fail
instead under ``FTRUN_REQUIRE_ETCD=1``, as in CI. The member-failover test stops a member and
runs last.
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch.distributed as dist

from ftrun import _torch
from ftrun.errors import ConfigError, JobNotFoundError
from ftrun.launcher import etcd
from ftrun.testing.etcd import REQUIRE_ENV, EtcdCluster, etcd_binary


def require_etcd() -> None:
    """Skip without etcd; fail under FTRUN_REQUIRE_ETCD=1."""
    if etcd_binary() is not None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        raise RuntimeError(f"{REQUIRE_ENV}=1 but etcd is not installed; run: "
                           "bash scripts/setup-etcd.sh")
    pytest.skip(f"etcd not installed (bash scripts/setup-etcd.sh; {REQUIRE_ENV}=1 makes this "
                "a failure)")


@pytest.fixture(scope="module", name="cluster")
def cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    require_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as c:
        yield c


@pytest.fixture(name="client")
def client_fixture(cluster: EtcdCluster) -> etcd.EtcdClient:
    return etcd.EtcdClient(cluster.endpoints, timeout_s=2)


def run_id() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


# -- no etcd needed ----------------------------------------------------------------------------


def test_endpoints_parse_and_bad_ones_say_what_to_do() -> None:
    assert etcd.parse_endpoints("a:1, http://b:2,c") == [("a", 1), ("b", 2), ("c", 2379)]
    assert etcd.parse_endpoints("[::1]:5") == [("::1", 5)]
    assert etcd.parse_endpoints("https://a:1,https://b") == [("a", 1), ("b", 2379)]
    assert etcd.endpoints_scheme("https://a:1,https://b") == "https"
    for bad, words in [("", "no etcd endpoint"), ("a:x", "HOST:PORT"), ("a:0", "HOST:PORT"),
                       ("ftp://a:1", "not etcd's"), ("http://a:1,https://b:1", "mix"),
                       ("a:1,a:1", "twice")]:
        with pytest.raises(ConfigError, match=words):
            etcd.parse_endpoints(bad)


def test_unreachable_cluster_is_a_clear_error() -> None:
    from ftrun.testing.procs import free_port

    client = etcd.EtcdClient(f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout_s=1)
    with pytest.raises(etcd.EtcdUnavailable, match="no etcd member answered.*majority"):
        etcd.check_endpoints(client)


def test_torch_seams_for_the_etcd_backend() -> None:
    """The torch parts ftrun/_torch.py's rendezvous-backend block uses exist as used."""
    import inspect

    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    base = _torch.rendezvous_backend_base()
    assert {"name", "get_state", "set_state"} <= set(base.__abstractmethods__)
    assert list(inspect.signature(base.set_state).parameters) == ["self", "state", "token"]
    assert list(inspect.signature(create_handler).parameters) == ["store", "backend", "params"]
    assert issubclass(_torch.rendezvous_connection_error(), Exception)
    assert list(inspect.signature(rendezvous_handler_registry.register).parameters) == \
        ["backend", "creator"]
    # keep_world_while_unreachable: torch's agent asks the handler, by attribute, for nodes
    # waiting on every healthy monitor tick, and torch's handler lets a backend error out.
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    assert "rdzv_handler.num_nodes_waiting()" in inspect.getsource(SimpleElasticAgent._invoke_run)
    assert "raise" in inspect.getsource(DynamicRendezvousHandler.num_nodes_waiting)


def test_keep_alives_are_moved_past_an_outage_never_past_now() -> None:
    """discount_keep_alives on torch's own pickled rendezvous state."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    state = _RendezvousState()
    now = datetime.now(timezone.utc)
    old, recent = _NodeDesc("old", 1, 0), _NodeDesc("recent", 2, 0)
    state.last_heartbeats = {old: now - timedelta(seconds=60), recent: now - timedelta(seconds=1)}
    state.participants = {old: 0, recent: 1}
    moved = pickle.loads(_torch.discount_keep_alives(pickle.dumps(state), 20.0))
    after = datetime.now(timezone.utc)
    age = {str(n): (after - t).total_seconds() for n, t in moved.last_heartbeats.items()}
    assert 40 <= age[str(old)] < 41, age  # as old as when the outage began
    assert 0 <= age[str(recent)] < 1, age  # never in the future
    assert moved.participants == state.participants
    # One keep-alive interval more for the timer's phase (a tick can come an interval late).
    moved = pickle.loads(_torch.discount_keep_alives(pickle.dumps(state), 20.0, 5.0))
    after = datetime.now(timezone.utc)
    age = {str(n): (after - t).total_seconds() for n, t in moved.last_heartbeats.items()}
    assert 35 <= age[str(old)] < 36, age


# -- against the cluster ------------------------------------------------------------------------


def test_torch_handler_rendezvous_on_etcd(cluster: EtcdCluster,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own handler, built by name from its registry, completes a one-node round on
    the etcd backend and hands out the etcd store (as torch's launcher would)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from ftrun.launcher import etcd_rdzv

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as ftrun's launcher
    etcd_rdzv.register()
    etcd_rdzv.register()  # idempotent
    handler = get_rendezvous_handler(RendezvousParameters(
        backend=etcd_rdzv.BACKEND_NAME, endpoint=cluster.endpoints, run_id=run_id(),
        min_nodes=1, max_nodes=1, local_addr="127.0.0.1", join_timeout="30"))
    assert handler.get_backend() == etcd_rdzv.BACKEND_NAME
    info = handler.next_rendezvous()
    try:
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        info.store.set("k", "v")
        assert info.store.get("k") == b"v"
    finally:
        handler.shutdown()
    assert handler.is_closed()


def test_backend_compare_and_set(client: etcd.EtcdClient) -> None:
    from ftrun.launcher.etcd_rdzv import EtcdRendezvousBackend

    backend = EtcdRendezvousBackend(client, run_id())
    assert backend.get_state() is None
    # No token: create if absent.
    state, token, ok = backend.set_state(b"s1")
    assert (state, ok) == (b"s1", True)
    assert backend.get_state() == (b"s1", token)
    assert backend.set_state(b"other") == (b"s1", token, False)
    # The right token writes and returns a new one.
    state2, token2, ok2 = backend.set_state(b"s2", token)
    assert (state2, ok2) == (b"s2", True) and token2 > token
    # A stale token (another node wrote in between) changes nothing: the current state back.
    assert backend.set_state(b"stale", token) == (b"s2", token2, False)
    assert backend.set_state(b"junk", "not-a-token") == (b"s2", token2, False)
    assert backend.get_state() == (b"s2", token2)


def test_backend_concurrent_writers_never_lose_an_update(client: etcd.EtcdClient) -> None:
    """Eight threads each add their name to one state through compare-and-set, retrying
    on a token mismatch as torch's state holder does: every name ends up in the state."""
    from ftrun.launcher.etcd_rdzv import EtcdRendezvousBackend

    backend = EtcdRendezvousBackend(client, run_id())
    errors: list[BaseException] = []

    def join(name: bytes) -> None:
        try:
            current = backend.get_state()
            while True:
                state, token = current if current is not None else (b"", None)
                result = backend.set_state(state + name, token)
                assert result is not None
                if result[2]:
                    return
                current = result[:2]
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=join, args=(b"%d," % i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    got = backend.get_state()
    assert got is not None
    assert sorted(got[0].decode().rstrip(",").split(",")) == [str(i) for i in range(8)]


def test_store_as_torch_uses_it(client: etcd.EtcdClient) -> None:
    from ftrun.launcher.etcd_rdzv import EtcdStore

    rid = run_id()
    # Keep the Python object referenced: a PrefixStore only holds its C++ half.
    etcd_store = EtcdStore(client, rid, timedelta(seconds=1))
    store = dist.PrefixStore("torch.rendezvous.x.0", etcd_store)
    store.set("MASTER_ADDR", "h0")
    assert store.get("MASTER_ADDR") == b"h0"
    store.multi_set(["r0", "r1"], [b"a", b"b"])
    assert store.multi_get(["r0", "r1"]) == [b"a", b"b"]
    assert store.check(["r0"]) and not store.check(["r9"])
    assert [store.add("n", 1) for _ in range(3)] == [1, 2, 3]
    assert store.compare_set("c", "", "v1") == b"v1"
    assert store.compare_set("c", "wrong", "v2") == b"v1"
    assert store.compare_set("c", "v1", "v2") == b"v2"
    with pytest.raises(dist.DistStoreError, match="not set within"):
        store.get("never")
    with pytest.raises(dist.DistStoreError, match="not set within"):
        store.wait(["never"], timedelta(milliseconds=200))
    # A get blocks until another agent sets the key.
    timer = threading.Timer(0.3, lambda: store.set("late", "here"))
    timer.start()
    try:
        waiting = EtcdStore(client, rid, timedelta(seconds=30))
        assert waiting.get("torch.rendezvous.x.0/late") == b"here"
    finally:
        timer.cancel()


def test_election_one_holder_then_the_next(client: etcd.EtcdClient) -> None:
    rid = run_id()
    first = etcd.CoordinatorElection(client, rid, "n1/1", "n1", ttl_s=2)
    second = etcd.CoordinatorElection(client, rid, "n2/2", "n2", ttl_s=2)
    assert first.campaign() is None and first.leading
    holder = second.campaign()
    assert holder is not None and holder.node_id == "n1/1" and not second.leading
    with pytest.raises(JobNotFoundError, match="still starting"):
        etcd.coordinator_endpoint(etcd.format_endpoints(client.endpoints), rid, 2)
    first.publish("10.0.0.1:7000", "10.0.0.1:7001")
    found = etcd.wait_coordinator(client, rid, timeout_s=5)
    assert (found.endpoint, found.detect_endpoint, found.term) == \
        ("10.0.0.1:7000", "10.0.0.1:7001", first.term)
    assert etcd.coordinator_endpoint(etcd.format_endpoints(client.endpoints), rid, 2) == \
        "10.0.0.1:7000"
    first.resign()
    assert etcd.read_coordinator(client, rid) is None
    # The next holder gets a larger term: what a coordinator signs can be bound to it.
    assert second.campaign() is None and second.term > first.term
    second.resign()


def test_a_job_that_ended_well_leaves_only_its_end_and_a_new_run_clears_the_old_rendezvous(
        client: etcd.EtcdClient) -> None:
    from ftrun.launcher.etcd_rdzv import EtcdRendezvousBackend, EtcdStore

    rid = run_id()
    prefix = etcd.key_prefix(rid)

    def keys() -> set[str]:
        return {kv.key.decode()[len(prefix):] for kv in client.get_prefix(prefix)}

    # A previous run under this id, killed (a requeue): its rendezvous, its agents' store,
    # the coordinator's kept state.
    EtcdRendezvousBackend(client, rid).set_state(b"a killed run's rendezvous")
    EtcdStore(client, rid).set("torch.rendezvous.x.0/MASTER_ADDR", "gone")
    client.put(etcd.state_key(rid, "excluded"), "{}")
    first, second, third, fourth = (etcd.LauncherPresence(client, rid, f"n{i}/1", ttl_s=2)
                                    for i in (1, 2, 3, 4))
    try:
        assert first.join()  # the first launcher of the new run clears the old rendezvous
        assert keys() == {"state/excluded", "launchers/n1/1"}
        kv = client.get(first.key)
        assert kv is not None and kv.lease == first.lease  # gone with its host
        EtcdRendezvousBackend(client, rid).set_state(b"this run's rendezvous")
        assert not second.join()  # one is present: nothing cleared
        assert keys() == {"state/excluded", "launchers/n1/1", "launchers/n2/1", "rdzv/state"}
        assert not second.leave(done=True)  # another launcher is present: keys stay
        election = etcd.CoordinatorElection(client, rid, "n1/1", "n1", ttl_s=2)
        assert election.campaign() is None
        assert not first.leave(done=True)  # the role is held: keys stay
        assert keys() == {"state/excluded", "rdzv/state", "coordinator"}
        election.resign()
        # Nobody of the job is running: a launcher starting now begins a new run.
        assert third.join()
        assert keys() == {"state/excluded", "launchers/n3/1"}
        assert third.leave(done=True)  # the last one out, after a job that ended well
        assert keys() == {"ended"}  # under a lease: gone by itself
        ended = client.get(etcd.ended_key(rid))
        assert ended is not None and ended.lease
        # A launcher of that job back after its end (frozen, cut off) finds it closed.
        with pytest.raises(_torch.rendezvous_closed_error(), match="ended"):
            EtcdRendezvousBackend(client, rid).get_state()
        # A new run under the id starts afresh.
        assert fourth.join() and keys() == {"launchers/n4/1"}
        assert EtcdRendezvousBackend(client, rid).get_state() is None
    finally:
        for presence in (first, second, third, fourth):
            presence.leave(done=False)


def test_member_failover(cluster: EtcdCluster, client: etcd.EtcdClient) -> None:
    """Runs last in the module: stops a member. The client, its backend and an election's
    lease keep working on the two others."""
    from ftrun.launcher.etcd_rdzv import EtcdRendezvousBackend

    backend = EtcdRendezvousBackend(client, run_id())
    _, token, _ = backend.set_state(b"before")
    election = etcd.CoordinatorElection(client, run_id(), "n1/1", "n1", ttl_s=2)
    assert election.campaign() is None
    lost: list[str] = []
    election.on_lost = lost.append
    # Stop the member the client talks to now (it moves on to the next one).
    cluster.stop_member(0)
    state, token2, ok = backend.set_state(b"after", token)
    assert ok and state == b"after"
    assert backend.get_state() == (b"after", token2)
    # The lease outlives a few renewals (ttl 2 s, renewed every 0.67 s) across the loss.
    first_term = election.term
    from ftrun.testing.procs import wait_for

    renewed = threading.Event()
    original = client.keep_alive

    def counting(lease: int) -> int:
        ttl = original(lease)
        renewed.set()
        return ttl

    client.keep_alive = counting  # type: ignore[method-assign]
    wait_for(renewed.is_set, 10, "a lease renewal after the member stopped")
    assert not lost and election.leading and election.term == first_term
    election.resign()


# Serial (run alone, scripts/test.sh): beside another file's jobs on the 2-CPU CI machine the
# lone node was once out of its round after the outage although its keep-alives were moved
# past it (not understood; the test passes alone and in most parallel runs).
@pytest.mark.serial
def test_quorum_lost_reads_as_such_and_the_world_is_kept_until_it_is_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A cluster of its own loses 2 of its 3 members: requests fail at once saying the quorum
    is lost; a rendezvous handler built by torch's registry answers "nobody waiting" instead
    of raising out of the agent's loop; the coordinator's holder loses its role. Once the
    members are back, the handler answers from etcd again and the role is taken anew."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
    )
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from ftrun.launcher import etcd_rdzv
    from ftrun.testing.procs import wait_for

    require_etcd()
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with EtcdCluster(tmp_path / "etcd") as cluster:
        client = etcd.EtcdClient(cluster.endpoints, timeout_s=2)
        rid = run_id()
        etcd_rdzv.register()
        handler = get_rendezvous_handler(RendezvousParameters(
            backend=etcd_rdzv.BACKEND_NAME, endpoint=cluster.endpoints, run_id=rid,
            min_nodes=1, max_nodes=1, local_addr="127.0.0.1", join_timeout="30",
            # Keep-alives expire after 4 s: longer than a loaded host delays a keep-alive, far
            # shorter than the outage below (asserted at the end).
            read_timeout="2", keep_alive_interval="2", keep_alive_max_attempt="2"))
        handler.next_rendezvous()
        lost: list[str] = []
        election = etcd.CoordinatorElection(client, rid, "n1/1", "n1", ttl_s=2,
                                            on_lost=lost.append)
        assert election.campaign() is None
        old_term = election.term
        assert handler.num_nodes_waiting() == 0
        try:
            cluster.stop_member(1)
            cluster.stop_member(2)
            # The lone member answers "no leader" once it has noticed (its election timeout).
            error = wait_for(lambda: _unavailable(client), 30, "etcd to say it has no leader")
            assert "quorum is lost" in str(error) and "no leader" in str(error), error
            round_before = _torch.rendezvous_view(handler)
            with caplog.at_level("WARNING", logger="ftrun._torch"):
                assert handler.num_nodes_waiting() == 0  # no raise: the world is kept
                assert handler.num_nodes_waiting() == 0  # (and not tried again at once)
            assert "keeps training on its current world" in caplog.text
            # A recovery needs a rendezvous: it fails, saying why (a launcher exits with it).
            joining = get_rendezvous_handler(RendezvousParameters(
                backend=etcd_rdzv.BACKEND_NAME, endpoint=cluster.endpoints, run_id=rid,
                min_nodes=1, max_nodes=1, local_addr="127.0.0.1", join_timeout="30",
                read_timeout="2"))
            with pytest.raises(RendezvousConnectionError, match="quorum is lost"):
                joining.next_rendezvous()
            wait_for(lambda: lost, 30, "the holder to lose its role")
            assert not election.acting()
            time.sleep(3.0)  # an outage well past the keep-alives' expiry (asserted below)
        finally:
            for i in (1, 2):
                if cluster.procs[i] is None:
                    cluster.start_member(i)
        wait_for(cluster.healthy, 30, "the members healthy again")

        def reads_again() -> bool:
            handler.num_nodes_waiting()
            return "reachable again" in caplog.text

        with caplog.at_level("WARNING", logger="ftrun._torch"):
            wait_for(reads_again, 30, "the handler to read etcd again", interval_s=0.3)
        # The outage outlasted the keep-alive expiry (4 s), yet the node is still in its
        # round: its keep-alive was moved past the outage, not found expired.
        outage = re.search(r"etcd answers again after ([0-9.]+) s", caplog.text)
        assert outage and float(outage[1]) > 5.0, caplog.text[-3000:]
        me = _torch.rendezvous_node(handler)
        view = _torch.rendezvous_view(handler)
        assert view is not None and me in view[1] and me in view[2], (me, view)
        assert round_before is not None and view[0] == round_before[0], (round_before, view)
        # Moved in etcd, not only in this node's copy: what any node reads next keeps it too.
        stored = pickle.loads(client.get(etcd_rdzv.EtcdRendezvousBackend(client, rid).key).value)
        beats = {str(n): (datetime.now(timezone.utc) - t).total_seconds()
                 for n, t in stored.last_heartbeats.items()}
        assert me in {str(n) for n in stored.participants} and beats[me] < 4.0, beats
        # The old holder's key expires with its lease (etcd renews every lease for one TTL
        # when a new leader is elected); a campaign then takes the role with a new term.
        wait_for(lambda: election.campaign() is None, 30, "the role taken again",
                 interval_s=0.3)
        assert election.term > old_term
        election.resign()
        handler.shutdown()


def _unavailable(client: etcd.EtcdClient) -> etcd.EtcdUnavailable | None:
    try:
        client.get("/ftrun/probe")
    except etcd.EtcdUnavailable as e:
        return e if "no leader" in str(e) else None
    return None


def test_tls_with_client_certificates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real etcd serving https that asks each client for a certificate (certificates
    made with openssl here): without the CA a client fails saying what to check; with
    --rdzv-conf protocol=https,cacert,cert,key (torch's keys) torch's handler completes a
    round; ``ftrun status --etcd https://...`` finds the coordinator with etcdctl's
    variables."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from ftrun.launcher import etcd_rdzv
    from ftrun.testing.etcd import TestCerts

    require_etcd()
    certs = TestCerts.make(tmp_path / "certs")
    with EtcdCluster(tmp_path / "etcd", members=1, tls=certs) as cluster:
        assert cluster.endpoints.startswith("https://")
        with pytest.raises(etcd.EtcdUnavailable, match="TLS handshake failed"):
            etcd.check_endpoints(etcd.EtcdClient(cluster.endpoints, timeout_s=2))  # no CA
        no_cert = etcd.EtcdClient(cluster.endpoints, timeout_s=2,
                                  tls=etcd.EtcdTLS(cacert=str(certs.ca)))
        with pytest.raises(etcd.EtcdError):
            no_cert.get("/x")  # the member asks for a client certificate
        conf = {"protocol": "https", "cacert": str(certs.ca), "cert": str(certs.client_cert),
                "key": str(certs.client_key)}
        tls = etcd.EtcdTLS.from_conf(conf.get)
        client = etcd.EtcdClient(cluster.endpoints, timeout_s=2, tls=tls)
        client.put("/x", "y")
        assert client.get("/x").value == b"y"
        # The launcher's path: the endpoints without a scheme, TLS from --rdzv-conf.
        bare = cluster.endpoints.replace("https://", "")
        assert etcd.EtcdClient(bare, tls=tls).endpoints_text == cluster.endpoints

        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        etcd_rdzv.register()
        handler = get_rendezvous_handler(RendezvousParameters(
            backend=etcd_rdzv.BACKEND_NAME, endpoint=bare, run_id=run_id(), min_nodes=1,
            max_nodes=1, local_addr="127.0.0.1", join_timeout="30", **conf))
        info = handler.next_rendezvous()
        try:
            assert (info.rank, info.world_size) == (0, 1)
        finally:
            handler.shutdown()

        rid = run_id()
        election = etcd.CoordinatorElection(client, rid, "n1/1", "n1", ttl_s=2)
        assert election.campaign() is None
        election.publish("127.0.0.1:5555", "")
        for name, var in etcd.TLS_ENV.items():
            monkeypatch.setenv(var, conf[name])
        assert etcd.coordinator_endpoint(cluster.endpoints, rid, 5) == "127.0.0.1:5555"
        election.resign()


def test_tls_settings_that_cannot_work_are_refused(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    key.write_text("x")
    for conf, words in [({"protocol": "ftp"}, "give http or https"),
                        ({"protocol": "http", "cacert": str(key)}, "protocol=https"),
                        ({"protocol": "https", "cert": str(key)}, "both cert and key"),
                        ({"cacert": str(tmp_path / "missing.pem")}, "does not exist")]:
        with pytest.raises(ConfigError, match=words):
            etcd.EtcdTLS.from_conf(conf.get)
    assert etcd.EtcdTLS.from_conf({}.get) is None
    with pytest.raises(ConfigError, match="cannot load"):
        etcd.EtcdClient("https://127.0.0.1:1", tls=etcd.EtcdTLS(cacert=str(key)))
