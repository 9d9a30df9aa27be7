"""The private torch internals ftrun uses (ftrun/_torch.py) exist, with the signatures used.

A torch upgrade that moves one of them fails here, naming it, instead of inside a user's job.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import free_port, pid_alive, wait_for
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ftrun import _torch


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_ddp_private_methods_and_signatures() -> None:
    ddp = DistributedDataParallel
    assert params(ddp._ddp_init_helper)[:5] == [
        "self", "parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]
    assert params(ddp._build_params_for_reducer) == ["self"]
    assert params(ddp._build_debug_param_to_name_mapping) == ["self", "parameters"]
    assert params(ddp._get_ddp_logging_data) == ["self"]
    for name in ("_compute_bucket_assignment_by_size", "_register_comm_hook"):
        assert callable(getattr(dist, name)), name
    for name in ("_rebuild_buckets", "_remove_autograd_hooks", "_set_static_graph",
                 "_set_mixed_precision_param_dtype"):
        assert callable(getattr(dist.Reducer, name)), name
    for name in ("set_runtime_stats_and_log", "_set_static_graph"):
        assert callable(getattr(dist.Logger, name)), name


@pytest.fixture
def group() -> object:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def model() -> nn.Module:
    torch.manual_seed(0)
    # ~3 MiB of parameters: DDP's rebuilt layout has a 1 MiB first bucket, so several buckets.
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512))


def step(ddp: DistributedDataParallel) -> None:
    ddp(torch.randn(4, 512)).sum().backward()


def test_layout_is_read_after_the_first_backward_and_imposed_on_a_new_reducer(group: object) -> None:
    first = DistributedDataParallel(model())
    assert _torch.ddp_layout(first) is None  # no backward yet: nothing to rebuild from
    step(first)
    layout = _torch.ddp_layout(first)
    assert layout is not None and len(layout) > 1
    assert sorted(i for b in layout for i in b) == list(range(6))
    # The layout DDP itself settles on: rebuilding again changes nothing.
    step(first)
    assert _torch.ddp_layout(first) == layout
    sizes = first._get_ddp_logging_data()["rebuilt_bucket_sizes"]

    second = DistributedDataParallel(model())
    assert second._get_ddp_logging_data()["bucket_sizes"] != sizes  # one initial bucket
    assert _torch.ddp_use_layout(second, layout)
    assert second._get_ddp_logging_data()["bucket_sizes"] == sizes
    step(second)  # gradients still flow through the new reducer
    assert all(p.grad is not None for p in second.parameters())
    step(second)
    assert _torch.ddp_layout(second) == layout


def test_a_layout_that_does_not_fit_is_refused(group: object) -> None:
    ddp = DistributedDataParallel(model())
    reducer = ddp.reducer
    assert not _torch.ddp_use_layout(ddp, [[0, 1, 2]])
    assert ddp.reducer is reducer


def test_shutdown_gets_only_the_arguments_torch_takes() -> None:
    calls: list[tuple] = []

    def old(death_sig):  # noqa: ANN001, ANN202 (torch 2.11: _shutdown(self, death_sig))
        calls.append(("old", death_sig))

    def new(death_sig, timeout=30):  # noqa: ANN001, ANN202 (torch 2.12 and later)
        calls.append(("new", death_sig, timeout))

    _torch.call_shutdown(old, signal.SIGTERM, 5)
    _torch.call_shutdown(new, signal.SIGTERM, 5)
    assert calls == [("old", signal.SIGTERM), ("new", signal.SIGTERM, 5)]


def test_will_rebuild_follows_ddp_arguments(group: object) -> None:
    plain = DistributedDataParallel(model())
    assert _torch.ddp_will_rebuild(plain)
    step(plain)
    _torch.ddp_layout(plain)
    assert not _torch.ddp_will_rebuild(plain)
    assert not _torch.ddp_will_rebuild(DistributedDataParallel(model(), find_unused_parameters=True))


def test_get_fqns_signature() -> None:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    assert params(_get_fqns)[:2] == ["model", "name"]


def test_optimizer_state_loads_like_torchs_own_path(group: object) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def trained() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        ddp = DistributedDataParallel(model())
        opt = torch.optim.AdamW([{"params": list(ddp.parameters())[:2], "lr": 1e-3},
                                 {"params": list(ddp.parameters())[2:], "lr": 5e-4}])
        return ddp, opt

    ddp, opt = trained()
    for _ in range(2):
        step(ddp)
        opt.step()
        opt.zero_grad()
    saved = get_optimizer_state_dict(ddp, opt)

    fast_model, fast_opt = trained()
    assert _torch.load_optimizer_state(fast_model, fast_opt, saved)
    slow_model, slow_opt = trained()
    set_optimizer_state_dict(slow_model, slow_opt, saved)
    a, b = fast_opt.state_dict(), slow_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)

    other = torch.optim.AdamW(fast_model.parameters())  # one group, not two: torch's way
    assert not _torch.load_optimizer_state(fast_model, other, saved)


# The parameters ftrun passes to each private method of LocalElasticAgent it overrides and
# calls (ftrun._torch.agent_class), "self" first.
AGENT_METHODS = {
    "_rendezvous": ["self", "worker_group"],
    "_set_local_rank_env": ["self", "worker_env", "local_rank", "spec"],
    "_start_workers": ["self", "worker_group"],
    "_monitor_workers": ["self", "worker_group"],
    "_restart_workers": ["self", "worker_group"],
    "_stop_workers": ["self", "worker_group"],
    "_exit_barrier": ["self"],
}


def test_elastic_agent_private_methods_and_signatures() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert set(_torch.AGENT_HOOKS.values()) == {*AGENT_METHODS, "_shutdown"}
    for name, expected in AGENT_METHODS.items():
        assert params(getattr(LocalElasticAgent, name)) == expected, name
    # (death_sig) up to torch 2.11, (death_sig, timeout) since: call_shutdown passes either.
    shutdown = params(LocalElasticAgent._shutdown)
    assert shutdown in (["self", "death_sig"], ["self", "death_sig", "timeout"]), shutdown
    assert "timeout" in shutdown or torch.__version__ < (2, 12)
    # The public names ftrun adds must not shadow anything of torch's.
    for name in [*_torch.AGENT_HOOKS, *_torch.AGENT_ACCESSORS]:
        assert not hasattr(LocalElasticAgent, name), f"LocalElasticAgent.{name} exists now"
    agent = _torch.agent_class()
    for public, private in _torch.AGENT_HOOKS.items():
        assert private in vars(agent) and public in vars(agent), public


def test_launcher_private_entry_points() -> None:
    import torch.distributed.launcher.api as launcher_api
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    assert params(torch_run.get_args_parser) == []
    assert params(torch_run.run) == ["args"]
    # run_torchrun swaps the agent class launch_agent builds, by its name in that module.
    assert launcher_api.LocalElasticAgent is LocalElasticAgent
    assert "agent = LocalElasticAgent(" in inspect.getsource(launcher_api.launch_agent)
    assert params(_matches_machine_hostname) == ["host"]
    assert _torch.is_this_host(socket.gethostname()) and _torch.is_this_host("localhost")
    assert not _torch.is_this_host("203.0.113.9")  # TEST-NET-3: never this machine
    parser = _torch.torchrun_parser()
    assert parser.parse_args(["--nproc-per-node", "3", "x.py"]).nproc_per_node == "3"


def _worker_spec(script: Path, max_restarts: int) -> object:
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    handler = get_rendezvous_handler(RendezvousParameters(
        backend="static", endpoint=f"127.0.0.1:{free_port()}", run_id="seams", min_nodes=1,
        max_nodes=1, rank=0))
    return WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=handler,
                      entrypoint=sys.executable, args=(str(script),), max_restarts=max_restarts,
                      monitor_interval=0.1)


def test_torch_calls_the_agent_hooks_and_the_accessors_read_its_state(tmp_path: Path) -> None:
    """A real LocalElasticAgent run (static rendezvous, two workers that fail once, then
    succeed if they got the variable set_local_rank_env added) reaches each public hook, and
    the accessors see its restarts and workers."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    sys.exit(1)\n"
        "sys.exit(0 if os.environ['SEAM_MARK'] == os.environ['LOCAL_RANK'] else 3)\n")
    calls: list[str] = []
    seen: dict[str, object] = {}

    class Recording(_torch.agent_class()):  # type: ignore[misc]
        def rendezvous(self, worker_group):  # noqa: ANN001, ANN202
            calls.append("rendezvous")
            super().rendezvous(worker_group)

        def set_local_rank_env(self, worker_env, local_rank, spec):  # noqa: ANN001, ANN202
            calls.append("set_local_rank_env")
            super().set_local_rank_env(worker_env, local_rank, spec)
            worker_env["SEAM_MARK"] = str(local_rank)

        def start_workers(self, worker_group):  # noqa: ANN001, ANN202
            calls.append("start_workers")
            pids = super().start_workers(worker_group)
            seen.setdefault("pids", []).append((dict(pids), self.worker_pids()))
            return pids

        def monitor_workers(self, worker_group):  # noqa: ANN001, ANN202
            result = super().monitor_workers(worker_group)
            if not calls or calls[-1] != "monitor_workers":
                calls.append("monitor_workers")
            return result

        def restart_workers(self, worker_group):  # noqa: ANN001, ANN202
            calls.append("restart_workers")
            seen["remaining_before_restart"] = self.remaining_restarts()
            super().restart_workers(worker_group)

        def shutdown(self, death_sig, timeout):  # noqa: ANN001, ANN202
            calls.append("shutdown")
            super().shutdown(death_sig, timeout)

        def exit_barrier(self):  # noqa: ANN202
            calls.append("exit_barrier")
            seen["barrier"] = (self.rendezvous_store(), self.exit_barrier_timeout())
            self.mark_exit_barrier(True)
            seen["marked"] = getattr(self, "_in_exit_barrier", True)
            self.mark_exit_barrier(False)
            super().exit_barrier()

    agent = Recording(spec=_worker_spec(script, max_restarts=1),
                      logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    assert agent.worker_pids() == {} and agent.remaining_restarts() == 1
    result = agent.run()
    assert result.state == WorkerState.SUCCEEDED, result
    assert calls[0] == "rendezvous" and calls[-1] == "shutdown", calls
    assert calls.count("start_workers") == 2 and "restart_workers" in calls, calls
    assert calls.count("set_local_rank_env") == 4, calls  # two workers, two starts
    assert calls.index("monitor_workers") < calls.index("restart_workers"), calls
    assert seen["remaining_before_restart"] == 0  # torch counts the restart down first
    assert calls.count("exit_barrier") == 1 and calls[-2:] == ["exit_barrier", "shutdown"], \
        calls  # once the workers succeeded, before the last shutdown
    store, timeout_s = seen["barrier"]
    assert hasattr(store, "add") and hasattr(store, "check") and timeout_s > 0, seen
    assert seen["marked"] is True
    for started, from_accessor in seen["pids"]:
        assert started == from_accessor and sorted(started) == [0, 1]


def test_rendezvous_state_seen_through_the_c10d_handler() -> None:
    """rendezvous_view/rendezvous_node read DynamicRendezvousHandler's private state: a real
    c10d handler, after one rendezvous of one node, shows its round, itself as participant,
    and its own name."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        create_backend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        _RendezvousState,
    )

    for name in ("round", "participants", "last_heartbeats", "wait_list", "redundancy_list"):
        assert name in _RendezvousState().__dict__, name
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "seam", 1, 1,
                                  is_host="0", timeout="30")
    backend, _ = create_backend(params)
    handler = DynamicRendezvousHandler.from_backend("seam", store, backend, 1, 1)
    try:
        assert _torch.rendezvous_view(object()) is None
        handler.next_rendezvous()
        view = _torch.rendezvous_view(handler)
        node = _torch.rendezvous_node(handler)
        assert view is not None and node is not None
        round_, members, present = view
        assert round_ >= 0 and members == frozenset({node}) and node in present
    finally:
        handler.shutdown()


def _node_handler(port: int, run_id: str, nodes: int) -> Any:
    """A real c10d DynamicRendezvousHandler of one node of ``nodes`` (min = max), over the
    TCPStore server on ``port``. One store client per node, as on real hosts: with one client
    shared by two handlers, rank 1's blocking get of MASTER_ADDR could hold it while rank 0
    waited to set the key (seen once in CI under load: a 300 s store timeout)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    backend, _ = create_backend(RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", run_id, nodes, nodes, is_host="0", timeout="60"))
    return DynamicRendezvousHandler.from_backend(run_id, client, backend, nodes, nodes)


def test_a_lost_node_is_dropped_from_the_rendezvous_as_torch_drops_an_expired_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """drop_rendezvous_node goes through DynamicRendezvousHandler's state holder, backend and
    settings and torch's own _sanitize: two real c10d handlers form a round of 2; one stops
    its keep-alives; the other drops it (refused while its keep-alive is younger than asked),
    and a fresh handler on the same store reads the round without it."""
    import threading

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        _BackendRendezvousStateHolder,
    )

    assert params(_BackendRendezvousStateHolder) == ["backend", "settings", "cache_duration"]
    for name in ("_sanitize", "sync", "mark_dirty", "state"):
        assert hasattr(_BackendRendezvousStateHolder, name), name
    # As ftrun runs it (launch.py): no rendezvous store shared with the ranks.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = free_port()
    _server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def handler() -> DynamicRendezvousHandler:
        return _node_handler(port, "drop", 2)

    a, b = handler(), handler()
    assert _torch.drop_rendezvous_node(object(), "x", 0.0, 1.0)[0] == "unsupported"
    joined = [threading.Thread(target=h.next_rendezvous) for h in (a, b)]
    for t in joined:
        t.start()
    for t in joined:
        t.join(60)
    assert not any(t.is_alive() for t in joined), "the round of 2 did not form within 60 s"
    try:
        lost = _torch.rendezvous_node(b)
        me = _torch.rendezvous_node(a)
        assert lost is not None and me is not None
        b._stop_heartbeats()  # b's host died
        outcome, round_, age_s = _torch.drop_rendezvous_node(a, lost, 3600.0, 10.0)
        assert outcome == "alive" and age_s is not None and age_s < 3600, (outcome, age_s)
        outcome, round_, age_s = _torch.drop_rendezvous_node(a, lost, 0.0, 10.0)
        assert outcome == "dropped", outcome
        fresh = handler()
        fresh.num_nodes_waiting()  # a sync: reads the state as every node will
        view = _torch.rendezvous_view(fresh)
        assert view is not None and view[0] == round_ and view[1] == frozenset({me}), view
        assert lost not in view[2]
        assert _torch.drop_rendezvous_node(a, lost, 0.0, 10.0)[0] == "absent"
    finally:
        a.shutdown()



def test_a_node_left_waiting_for_a_full_round_is_parked_as_a_spare(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """spares_stay_spare: real c10d handlers, a round of 2 (a, b) and a third node c waiting
    as a spare. c is put on the wait list of the full round, as torch's join leaves a node
    that a restart round filled without (seen in CI: every round restarted every node); torch
    alone counts it as waiting; with ftrun's wrapper it is parked on the redundancy list and
    not counted. Once the round has room again (b dropped), c's own join puts it back on the
    wait list and it is counted."""
    import threading

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        _BackendRendezvousStateHolder,
    )

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = free_port()
    _server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def handler() -> DynamicRendezvousHandler:
        return _node_handler(port, "park", 2)

    a, b, c = handler(), handler(), handler()
    joined = [threading.Thread(target=h.next_rendezvous) for h in (a, b)]
    for t in joined:
        t.start()
    for t in joined:
        t.join(60)
    assert not any(t.is_alive() for t in joined), "the round of 2 did not form within 60 s"
    ended: list[BaseException] = []

    def spare() -> None:
        try:
            c.next_rendezvous()
        except BaseException as e:  # noqa: BLE001  (the rendezvous closed at the end)
            ended.append(e)

    waiting = threading.Thread(target=spare, daemon=True)
    waiting.start()
    holder = _BackendRendezvousStateHolder(a._state_holder._backend, a._settings, 0)
    try:
        name_c = wait_for(lambda: _torch.rendezvous_node(c), 30, "c's name")

        def listed(where: str) -> bool:
            holder.sync()
            return any(str(n) == name_c for n in getattr(holder.state, where))

        wait_for(lambda: listed("redundancy_list"), 30, "c parked as a spare by torch")
        # What a restart round that filled without c leaves behind:
        desc = next(n for n in holder.state.redundancy_list if str(n) == name_c)
        holder.state.redundancy_list.discard(desc)
        holder.state.wait_list.add(desc)
        holder.mark_dirty()
        assert holder.sync()
        # torch alone (once its cached state expires): every agent would restart.
        wait_for(lambda: a.num_nodes_waiting() == 1, 10, "c counted as waiting by torch")
        assert listed("wait_list")  # and it stays there

        _torch.spares_stay_spare(a)
        assert a.num_nodes_waiting() == 0
        assert listed("redundancy_list") and not listed("wait_list")
        assert waiting.is_alive()  # still waiting, as a spare

        b._stop_heartbeats()
        assert _torch.drop_rendezvous_node(a, _torch.rendezvous_node(b), 0.0, 10.0)[0] \
            == "dropped"
        wait_for(lambda: a.num_nodes_waiting() == 1, 30,
                 "c waiting again for the round that has room")
    finally:
        a.set_closed()
        waiting.join(30)
        a.shutdown()
    assert not waiting.is_alive() and ended, "c did not leave the closed rendezvous"


def test_a_spare_leaves_the_new_round_to_a_live_member_still_joining(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """spares_stay_spare, the join side: a round of 2 (a, b) and a spare c, every handler
    wrapped as a launcher wraps its own. The round restarts: a has left it and waits (on the
    wait list, alive) but is slow to join the next round; b leaves last, which opens the next
    round, and joins at once. torch's join gives the open place to whoever asks first: c,
    polling once a second, took it from a (a survivor's live processes stopped, a spare's
    started). With ftrun's wrapper c waits while a, alive, has not joined; the new round is
    a and b, and c is a spare again."""
    import threading

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder,
    )

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = free_port()
    _server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    a, b, c = (_node_handler(port, "defer", 2) for _ in range(3))
    for h in (a, b, c):
        _torch.spares_stay_spare(h)
    ended: dict[str, BaseException | None] = {}

    def join(name: str, h: Any) -> threading.Thread:
        def run() -> None:
            try:
                h.next_rendezvous()
                ended[name] = None
            except BaseException as e:  # noqa: BLE001  (the rendezvous closed at the end)
                ended[name] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    first = [join("a", a), join("b", b)]
    for t in first:
        t.join(60)
    assert ended == {"a": None, "b": None}, ended
    ended.clear()
    spare = join("c", c)
    holder = _BackendRendezvousStateHolder(a._state_holder._backend, a._settings, 0)
    threads: list[threading.Thread] = []
    try:
        name_a, name_c = _torch.rendezvous_node(a), wait_for(lambda: _torch.rendezvous_node(c),
                                                             30, "c's name")

        def listed(name: str, where: str) -> bool:
            holder.sync()
            return any(str(n) == name for n in getattr(holder.state, where))

        wait_for(lambda: listed(name_c, "redundancy_list"), 30, "c parked as a spare")
        round_ = int(holder.state.round)
        # a leaves the complete round and waits for the next, as torch's exit and join do
        # (its keep-alive timer keeps it alive meanwhile).
        desc = next(n for n in holder.state.participants if str(n) == name_a)
        del holder.state.participants[desc]
        holder.state.wait_list.add(desc)
        holder.mark_dirty()
        assert holder.sync()
        threads.append(join("b", b))  # b leaves last: round + 1 opens, b joins it
        wait_for(lambda: listed(_torch.rendezvous_node(b), "participants")
                 and int(holder.state.round) == round_ + 1, 30, "b in the next round")
        time.sleep(3.0)  # c polls the open round (once a second) while a has not joined
        threads.append(join("a", a))
        for t in threads:
            t.join(30)
        assert ended.get("a", "pending") is None and ended.get("b", "pending") is None, ended
        holder.sync()
        assert {str(n) for n in holder.state.participants} == \
            {name_a, _torch.rendezvous_node(b)}, holder.state.participants
        assert spare.is_alive()  # c waits on, a spare
    finally:
        a.set_closed()
        spare.join(30)
        for h in (a, b, c):
            h.shutdown()


# ---- leaving a job without closing its rendezvous (ftrun._torch.rendezvous_keeping_error) ----


def _launch_one_node(tmp_path: Path, port: int, run_id: str, leave: bool) -> BaseException | None:
    """torch's own launch path (run_torchrun -> launch_agent) for one node of one worker that
    writes its pid and sleeps; with ``leave``, the agent's first monitor tick raises a
    subclass of rendezvous_keeping_error() (SIGKILL), else the worker exits 0 at once."""
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, time\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "time.sleep(60 if sys.argv[2] == 'leave' else 0)\n")
    pid_file = tmp_path / f"pid-{run_id}"

    class Leave(_torch.rendezvous_keeping_error()):  # type: ignore[misc]
        pass

    class Agent(_torch.agent_class()):  # type: ignore[misc]
        def monitor_workers(self, worker_group):  # noqa: ANN001, ANN202
            if leave and pid_file.exists():
                assert _torch.leave_rendezvous(worker_group.spec.rdzv_handler, 10.0)
                raise Leave("leaving", signal.SIGKILL)
            return super().monitor_workers(worker_group)

    args = _torch.torchrun_parser().parse_args([
        "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", "is_host=0", "--monitor-interval", "0.1", "--max-restarts", "0",
        str(script), str(pid_file), "leave" if leave else "stay"])
    try:
        _torch.run_torchrun(args, lambda **kwargs: Agent(**kwargs))
    except Leave as e:
        assert pid_file.exists()
        assert not pid_alive(int(pid_file.read_text())), "the worker outlived its agent"
        return e
    return None


def _rendezvous_state(port: int, run_id: str) -> tuple[bool, tuple[int, frozenset[str], frozenset[str]] | None]:
    """(closed, rendezvous_view) as a fresh c10d handler on the same store reads them."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    backend, _ = create_backend(RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, 1, 1,
                                                     is_host="0"))
    handler = DynamicRendezvousHandler.from_backend(run_id, store, backend, 1, 1)
    return bool(handler.is_closed()), _torch.rendezvous_view(handler)


def test_an_agent_leaving_by_the_signal_path_keeps_the_rendezvous_open(tmp_path: Path) -> None:
    """launch_agent closes the rendezvous after a normal end, and not after the agent left
    its round (leave_rendezvous) and raised a rendezvous_keeping_error() subclass, which
    reaches the caller with its worker killed."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing.api import SignalException

    assert _torch.rendezvous_keeping_error() is SignalException
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      multi_tenant=True)
    try:
        assert _launch_one_node(tmp_path, port, "ends", leave=False) is None
        closed, view = _rendezvous_state(port, "ends")
        assert closed  # the check sees a closed rendezvous
        assert view is not None and view[0] == 0 and len(view[1]) == 1  # and a member
        left = _launch_one_node(tmp_path, port, "leaves", leave=True)
        assert left is not None and left.sigval == signal.SIGKILL
        closed, view = _rendezvous_state(port, "leaves")
        assert not closed
        # leave_rendezvous took the node out of its round, which emptied it: a new round
        # began for the next nodes, without waiting for the keep-alives to expire.
        assert view is not None and view[0] == 1 and not view[1], view
    finally:
        del server


# -- the Flight Recorder (ftrun.rank.collectives) ----------------------------------------------


FR_CHECK = """
import os, torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace_json
from ftrun import _torch
from torch._C import _distributed_c10d as c10d
# Both recorders take includeCollectives and onlyActive; NCCL's only in builds with NCCL.
for dump in (_dump_fr_trace_json, getattr(c10d, "_dump_nccl_trace_json", None)):
    if dump is not None:
        assert "includeCollectives" in (dump.__doc__ or "") and "onlyActive" in dump.__doc__
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0,
                        world_size=1)
group = dist.group.WORLD
[name] = [n for n, pg in _torch.process_groups().items() if pg is group]
dist.all_reduce(torch.ones(10))  # a group shows in pg_status from its first collective
before = int(_torch.fr_dump(False)["pg_status"][name]["last_enqueued_collective"])
dist.all_reduce(torch.ones(10))
dist.all_reduce(torch.ones(10), async_op=True).wait()
import time
deadline = time.monotonic() + 10
# gloo's work thread records the completion after waking the waiter: under load, a moment later.
while True:
    status = _torch.fr_dump(False)["pg_status"][name]
    if int(status["last_completed_collective"]) == before + 2 or time.monotonic() > deadline:
        break
    time.sleep(0.01)
assert int(status["last_enqueued_collective"]) == before + 2, status
assert int(status["last_completed_collective"]) == before + 2, status
assert int(status["last_started_collective"]) >= -1, status
entries = [e for e in _torch.fr_dump(True)["entries"] if e["process_group"][0] == name]
assert entries[-1]["profiling_name"].endswith("all_reduce"), entries[-1]
assert entries[-1]["collective_seq_id"] == before + 2, entries[-1]
assert entries[-1]["input_sizes"] == [[10]] and entries[-1]["input_dtypes"] == ["Float"]
dist.destroy_process_group()
print("ok")
"""


def test_flight_recorder_counts_collectives_by_the_groups_registry_name() -> None:
    """The dump function exists with the arguments used; ``pg_status`` counts a gloo group's
    blocking and async collectives under the name torch's group registry gives it, and a
    full dump has the op and its sizes. In a fresh process: the recorder keeps a destroyed
    group's counts under its name, so a process that made groups before would mislead."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", FR_CHECK], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PORT": str(free_port())})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# -- aborting every process group in place (in-process restart) -----------------------------------


ABORT_CHECK = """
import inspect, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from ftrun import _torch
assert list(inspect.signature(c10d._abort_process_group).parameters) == ["group"]
_torch.abort_process_groups()  # no group yet: nothing to do
store = dist.TCPStore("127.0.0.1", 0, 1, True)
dist.init_process_group("gloo", store=dist.PrefixStore("world0", store), rank=0, world_size=1)
dist.new_group([0])
dist.all_reduce(torch.ones(4))
_torch.abort_process_groups()
assert c10d.GroupMember.WORLD is None and not c10d._world.pg_map and not dist.is_initialized()
# A new default group, under a new store prefix, in the same process.
dist.init_process_group("gloo", store=dist.PrefixStore("world1", store), rank=0, world_size=1)
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [1.0] * 4 and len(c10d._world.pg_map) == 1
dist.destroy_process_group()
print("ok")
"""


def test_abort_process_groups_forgets_every_group_so_a_new_world_can_form() -> None:
    """``_abort_process_group(None)`` takes one optional group; after ftrun's call no group is
    left registered and ``init_process_group`` forms a new default group in the same process."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", ABORT_CHECK], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_worker_env_matches_torchs_start_workers() -> None:
    """ftrun._torch.worker_env builds, for a rank restarted in place, the keys torch's
    _start_workers gives a new worker process."""
    import re

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    src = inspect.getsource(LocalElasticAgent._start_workers)
    block = src[src.index("worker_env = {"):src.index("self._set_local_rank_env")]
    torch_keys = set(re.findall(r'"([A-Z_]+)":', block))
    ours = inspect.getsource(_torch.worker_env)
    assert torch_keys and torch_keys == set(re.findall(r'"([A-Z_]+)":', ours))
    assert "self._set_local_rank_env(worker_env, local_rank, spec)" in src
    assert 'worker_env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]' in src


def test_detach_process_groups_lets_a_new_group_form(tmp_path: Path) -> None:
    """detach_process_groups forgets every group at once (a new default group forms) and
    returns the abort of the old ones."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.new_group([0])
    assert _torch.default_backend() == "gloo"
    abort = _torch.detach_process_groups()
    assert _torch.default_backend() is None
    store2 = dist.FileStore(str(tmp_path / "store2"), 1)
    dist.init_process_group("gloo", store=store2, rank=0, world_size=1)
    t = torch.ones(1)
    dist.all_reduce(t)
    abort()
    assert t.item() == 1.0
    dist.destroy_process_group()


def test_a_dead_worker_gets_a_new_process_in_torchs_context(tmp_path: Path) -> None:
    """ftrun._torch.worker_processes / replace_worker on torch's own SubprocessContext: the
    exit code is read without torch's poll closing the others, the new process replaces
    the dead one in pids(), the survivor keeps its pid, and close() ends both."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    code = "import os, sys, time; sys.exit(3) if os.environ['X'] == 'die' else time.sleep(60)"
    pc = start_processes(
        name="seam", entrypoint=sys.executable,
        args={0: ("-c", code), 1: ("-c", code)},
        envs={0: {"X": "live"}, 1: {"X": "die"}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    try:
        procs = _torch.worker_processes(pc)
        assert procs is not None and set(procs) == {0, 1}
        assert procs[1].wait(30) == 3
        assert procs[0].poll() is None  # torch's poll would have closed it by now
        before = pc.pids()
        new_pid = _torch.replace_worker(pc, 1, {"X": "live"})
        after = pc.pids()
        assert after[0] == before[0] and after[1] == new_pid != before[1]
        assert pid_alive(new_pid)
        assert pc.wait(0) is None  # both running: no failure left over from the dead one
    finally:
        pc.close(signal.SIGKILL, 5)
    assert not pid_alive(after[0]) and not pid_alive(new_pid)


def test_a_context_without_the_attributes_is_refused_loudly() -> None:
    class Other:  # a MultiprocessContext, or a torch that moved the attributes
        subprocess_handlers: dict = {}  # noqa: RUF012

    assert _torch.worker_processes(Other()) is None
    with pytest.raises(_torch.SeamMissing, match="_running_local_ranks"):
        _torch.replace_worker(Other(), 0, {})


def test_worker_starts_go_through_the_hook_and_torch_keeps_the_process(tmp_path: Path) -> None:
    """ftrun._torch.intercept_worker_starts on torch's own start_processes: the hook sees the
    command, the merged environment, the rank's log files and its local rank; the process
    it returns is the one torch's context watches (exit code) and stops (killpg); None lets
    torch start the process itself, in a session of its own as a warm one is; undo restores
    torch's start."""
    import subprocess

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as module,
    )

    torchs = module.SubprocessHandler._popen
    seen: list[tuple] = []
    ours: list[subprocess.Popen] = []

    def start(args: tuple, env: dict, stdout: object, stderr: object, local_rank: int) -> object:
        seen.append((args, env.get("X"), env.get("PATH"), stdout, stderr, local_rank))
        if local_rank == 1:
            return None
        ours.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                     start_new_session=True, stdout=stdout, stderr=stderr))
        return ours[-1]

    code = "import time; time.sleep(60)"
    undo = _torch.intercept_worker_starts(start)
    try:
        pc = start_processes(
            name="seam", entrypoint=sys.executable, args={0: ("-c", code), 1: ("-c", code)},
            envs={0: {"X": "a"}, 1: {"X": "b"}},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL))
    finally:
        undo()
    assert module.SubprocessHandler._popen is torchs
    try:
        by_rank = {s[5]: s for s in seen}
        assert set(by_rank) == {0, 1}
        assert by_rank[0][0] == (sys.executable, "-c", code)
        assert by_rank[0][1:3] == ("a", os.environ["PATH"])  # the launcher's env, updated
        assert by_rank[0][3] is not None and by_rank[0][3].name.endswith("stdout.log")
        pids = pc.pids()
        assert pids[0] == ours[0].pid and pids[1] != pids[0]
        assert os.getsid(pids[0]) == pids[0] and os.getsid(pids[1]) == pids[1]
        assert pc.wait(0) is None
    finally:
        pc.close(signal.SIGKILL, 5)
    assert not pid_alive(pids[0]) and not pid_alive(pids[1])


def test_a_store_bound_to_one_address_listens_there_only_and_torch_shares_it() -> None:
    """bound_tcp_store: torch's TCPStore takes a pre-bound listening socket
    (``master_listen_fd``, libuv backend); a second server that torch's launcher makes for the
    same port in the process (multi-tenant) shares it."""
    from datetime import timedelta

    assert "master_listen_fd" in (dist.TCPStore.__init__.__doc__ or "")
    store = _torch.bound_tcp_store("127.0.0.1", 0, "127.0.0.1", 10)
    port = store.port
    assert port > 0 and store.libuvBackend
    store.set("k", "v")
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("k") == b"v"
    # Another address of this host (all of 127/8 is loopback on Linux): nobody listens.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    # What torch's c10d handler does on the hosting launcher: a multi-tenant server on the
    # same port, in the same process, is the same store.
    again = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                          wait_for_workers=False, timeout=timedelta(seconds=10))
    assert again.get("k") == b"v"
    with pytest.raises(OSError):
        _torch.bound_tcp_store("127.0.0.1", 0, "203.0.113.9", 10)  # not an address here


def test_rendezvous_waits_poll_sooner_at_first_and_back_off_to_torchs_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """quick_rendezvous_polls replaces dynamic_rendezvous._delay, which torch's operation loop
    calls with seconds=1 between syncs while a node waits: the first polls of a wait come after
    50 ms per 8 nodes, each next one twice as late up to torch's second; a new wait starts over;
    any other delay (the first join's random jitter) is torch's."""
    import time

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    run = inspect.getsource(dr._DistributedRendezvousOpExecutor.run)
    assert "_delay(seconds=1)" in run, "torch's wait no longer polls through _delay(seconds=1)"
    assert "seconds" in inspect.signature(dr._delay).parameters
    assert _torch.rendezvous_max_nodes(object()) is None
    assert _torch.quick_rendezvous_polls(1000) == 1.0
    assert _torch.quick_rendezvous_polls(16) == pytest.approx(0.1)
    assert _torch.quick_rendezvous_polls(3) == pytest.approx(0.05)
    assert getattr(dr._delay, "ftrun_quick", False)
    installed = dr._delay
    _torch.quick_rendezvous_polls(3)
    assert dr._delay is installed  # replaced once

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(_torch._poll, "last", float("-inf"), raising=False)
    for _ in range(7):
        dr._delay(seconds=1)
    assert slept == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    _torch._poll.last = time.monotonic() - 10  # the previous poll was long ago: a new wait
    dr._delay(seconds=1)
    assert slept[-1] == pytest.approx(0.05)
    slept.clear()
    dr._delay(seconds=0.5)
    assert slept == [0.5]  # not the wait's poll: torch's delay, unchanged


def test_the_rounds_master_port_is_free_on_every_address() -> None:
    """Group rank 0 of a round picks MASTER_PORT through rendezvous.api.get_free_port (a
    module global that RendezvousStoreInfo.build calls); ftrun's replacement picks a port
    free on the wildcard address. The case it prevents: a listener on one address of the
    host (ftrun's store serves replicas on the node's address) leaves the port free on
    localhost, where torch's pick looks, but rank 0's store, listening on every address,
    then fails with EADDRINUSE."""
    from torch.distributed.elastic.rendezvous import api

    assert "get_free_port()" in inspect.getsource(api.RendezvousStoreInfo.build)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("0.0.0.0", port))  # what rank 0's store would do on that port
    _torch.master_port_free_on_every_address()
    installed = api.get_free_port
    assert getattr(installed, "ftrun_any_address", False)
    _torch.master_port_free_on_every_address()
    assert api.get_free_port is installed  # replaced once
    for _ in range(3):
        port = api.get_free_port()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
