"""The private parts of torch that ftrun relies on, all in one place.

Each function here names the torch internals it touches. ``tests/test_torch_seams.py`` checks
that they still exist with the signatures used here, so a torch upgrade that moves one fails
there, with the name of the seam, rather than deep inside a training job.

DDP's gradient buckets
----------------------
``DistributedDataParallel`` reduces gradients in flat buckets. With default arguments its
first iteration uses one bucket of every parameter in definition order; right before the
second forward it *rebuilds* the buckets in the order gradients became ready during the first
backward. With three or more ranks an allreduce sums each element in an order that depends on
where it sits in its bucket, so a process that restarts mid-training and reduces its first
step with the initial layout gets a result that differs in the last bits from the
uninterrupted run, which used the rebuilt one. ftrun therefore records the rebuilt layout in
every snapshot and, on restore, builds the reducer with that layout from the start.

torchrun's launcher
-------------------
ftrun runs torchrun itself: its argument parser and its ``run(args)``, which builds a
``LocalElasticAgent`` inside ``launch_agent``. The agent's extension points (rendezvous,
worker start, monitoring, restart, shutdown, a worker's environment) are private methods, and
the restart budget and the workers' process context private attributes. :func:`agent_class`
maps them, once, onto public names that ``FtrunAgent`` overrides; :func:`run_torchrun` has
torch's launcher build that agent. Supported: torch 2.11 to 2.15 (2.11's ``_shutdown`` takes
no ``timeout``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

Layout = list[list[int]]  # DDP buckets, each a list of parameter indices, in reduction order


def ddp_of(model: Any) -> Any | None:
    """``model`` if it is a DDP module with a C++ reducer ftrun can work with, else None."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    if getattr(model, "_use_python_reducer", False) or getattr(model, "reducer", None) is None:
        return None
    return model


def ddp_layout(ddp: Any) -> Layout | None:
    """The rebuilt bucket layout of ``ddp``, or None while DDP has not rebuilt its buckets.

    DDP rebuilds lazily, at the start of the forward after its first backward. The rebuild
    only needs that backward's gradient order, so it is done here as soon as it can be (this
    is what DDP's next forward would do; the layout and so the numerics are the same). The
    layout is read from DDP's logging data, where the reducer reports it.
    """
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        # Collective (rank 0 broadcasts the layout): every rank calls save() at the same step.
        if not ddp.reducer._rebuild_buckets():
            return None
        ddp._has_rebuilt_buckets = True
    data = ddp._get_ddp_logging_data()
    text = data.get("rebuilt_per_bucket_param_indices")
    if not text:
        # Logged at the next sampled forward; ask the logger to record it now.
        ddp.logger.set_runtime_stats_and_log()
        text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not text:
        return None
    return [[int(i) for i in bucket.split()] for bucket in text.split(",")]


def ddp_use_layout(ddp: Any, layout: Layout) -> bool:
    """Rebuild ``ddp``'s reducer so that its buckets follow ``layout`` from the first step.

    Done the way DDP itself rebuilds a reducer when it is unpickled (``_ddp_init_helper``),
    with the bucket assignment replaced by ``layout``. Communication hooks registered through
    ``register_comm_hook`` are registered again. Returns False (and changes nothing) when the
    layout does not fit the model's parameters.
    """
    import torch.distributed as dist

    parameters, expect_sparse = ddp._build_params_for_reducer()
    flat = sorted(i for bucket in layout for i in bucket)
    if flat != list(range(len(parameters))):
        log.warning("the snapshot's DDP bucket layout covers %d parameters, the model has %d: "
                    "keeping DDP's own layout", len(flat), len(parameters))
        return False
    if ddp.logger is not None and ddp._get_ddp_logging_data().get("comm_hook") and \
            not ddp._comm_hooks:
        log.warning("a built-in DDP communication hook is registered; it is not carried over to "
                    "the reducer ftrun rebuilds for the restored bucket layout")
    names = ddp._build_debug_param_to_name_mapping(parameters)
    cap = ddp.bucket_bytes_cap
    # _ddp_init_helper reverses the assignment it computes; hand it the layout reversed.
    assignment = ([list(b) for b in reversed(layout)], [cap] * len(layout))
    old = ddp.reducer
    old._remove_autograd_hooks()
    original = dist._compute_bucket_assignment_by_size
    dist._compute_bucket_assignment_by_size = lambda *_a, **_k: assignment
    try:
        ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = original
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    if getattr(ddp, "mixed_precision", None) is not None:
        ddp.reducer._set_mixed_precision_param_dtype(ddp.mixed_precision.param_dtype)
    ddp._has_rebuilt_buckets = False
    del old
    return True

def ddp_will_rebuild(ddp: Any) -> bool:
    """Whether ``ddp`` has yet to rebuild its buckets (it never does with unused-parameter
    search, unless its graph is static)."""
    return not ddp._has_rebuilt_buckets and (ddp.static_graph or not ddp.find_unused_parameters)


def load_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> bool:
    """Load a ``get_optimizer_state_dict`` dict (keyed by parameter FQN) straight into
    ``optimizer.load_state_dict``; False (nothing loaded) where torch's own path is needed.

    ``set_optimizer_state_dict`` first runs a step with zero gradients on an optimizer without
    state, to learn what its state looks like: on a restarted rank that is most of a restore
    (2.6 of 3.4 s for 1.2 GB of AdamW state). Plain tensors need none of it: the FQNs map to
    the optimizer's parameter indices, which is what ``load_state_dict`` takes. Sharded
    (DTensor) parameters, and anything that does not match one to one, go torch's way.
    """
    from torch.distributed.checkpoint.state_dict import _get_fqns

    fqn_of: dict[int, str] = {}
    for name, param in model.named_parameters():
        if type(param).__name__ == "DTensor" or type(param).__name__ == "FlatParameter":
            return False
        fqns = _get_fqns(model, name)
        if len(fqns) != 1:
            return False
        fqn_of[id(param)] = next(iter(fqns))
    saved_groups = state.get("param_groups")
    saved_state = state.get("state", {})
    if not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
        return False
    groups, native_state, index = [], {}, 0
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        fqns = [fqn_of.get(id(p)) for p in group["params"]]
        if None in fqns or list(saved.get("params", [])) != fqns:
            return False
        ids = list(range(index, index + len(fqns)))
        index += len(fqns)
        for i, fqn in zip(ids, fqns, strict=True):
            if fqn in saved_state:
                native_state[i] = saved_state[fqn]
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": native_state, "param_groups": groups})
    return True


# --------------------------------------------------------------------------------------------
# torchrun's launcher and elastic agent
# --------------------------------------------------------------------------------------------

# The public names agent_class() adds to LocalElasticAgent, and the private ones they stand for.
AGENT_HOOKS = {
    "rendezvous": "_rendezvous",
    "set_local_rank_env": "_set_local_rank_env",
    "start_workers": "_start_workers",
    "monitor_workers": "_monitor_workers",
    "restart_workers": "_restart_workers",
    "stop_workers": "_stop_workers",
    "shutdown": "_shutdown",
    "exit_barrier": "_exit_barrier",
}
AGENT_ACCESSORS = ("remaining_restarts", "worker_pids", "rendezvous_store",
                   "exit_barrier_timeout", "mark_exit_barrier")


def torchrun_parser() -> Any:
    """torchrun's own argument parser (``torch.distributed.run.get_args_parser``)."""
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def is_this_host(host: str) -> bool:
    """torch's rule for "the rendezvous endpoint is on this machine" (c10d's ``is_host``)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def rendezvous_view(handler: Any) -> tuple[int, frozenset[str], frozenset[str]] | None:
    """What a c10d rendezvous handler last read of its state: (round, the round's
    participants, every node it still counts: participants, nodes with a live keep-alive,
    waiting and spare ones); None for another kind of handler.

    Reads ``DynamicRendezvousHandler._state_holder.state`` (``round``, ``participants``,
    ``last_heartbeats``, ``wait_list``, ``redundancy_list``) and ``_this_node``, refreshed by
    the agent's ``num_nodes_waiting()`` on every monitor tick. A node whose keep-alives
    stopped is removed from all of them by whichever node syncs next.
    """
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    if state is None or not hasattr(state, "participants"):
        return None
    members = frozenset(str(n) for n in state.participants)
    present = members | frozenset(str(n) for n in (
        *state.last_heartbeats, *state.wait_list, *getattr(state, "redundancy_list", ())))
    return int(state.round), members, present


def rendezvous_node(handler: Any) -> str | None:
    """This node's name in the c10d rendezvous state (``_this_node``), or None."""
    node = getattr(handler, "_this_node", None)
    return None if node is None else str(node)


def run_torchrun(args: Any, make_agent: Callable[..., Any]) -> None:
    """``torch.distributed.run.run(args)``, with ``make_agent(**kwargs)`` building the agent
    where torch's ``launch_agent`` builds a ``LocalElasticAgent(**kwargs)``."""
    from torch.distributed.run import run

    with _agent_factory(make_agent):
        run(args)


@contextlib.contextmanager
def _agent_factory(make_agent: Callable[..., Any]) -> Iterator[None]:
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = make_agent  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]


def call_shutdown(shutdown: Callable[..., None], death_sig: signal.Signals, timeout: int) -> None:
    """Call an agent's ``_shutdown`` with the arguments it takes: torch 2.11's takes
    ``(death_sig)``, later ones ``(death_sig, timeout)``."""
    if "timeout" in inspect.signature(shutdown).parameters:
        shutdown(death_sig, timeout)
    else:
        shutdown(death_sig)


@functools.cache
def agent_class() -> type:
    """torch's ``LocalElasticAgent`` with its private extension points under public names.

    A subclass overrides ``rendezvous``, ``set_local_rank_env``, ``start_workers``,
    ``monitor_workers``, ``restart_workers``, ``stop_workers``, ``shutdown`` and
    ``exit_barrier`` (each with the arguments of the torch method of the same name with a
    leading underscore) and calls ``super()`` for torch's own behaviour.
    ``remaining_restarts()``, ``worker_pids()``, ``rendezvous_store()`` (the round's store)
    and ``exit_barrier_timeout()`` read the agent's private state; ``mark_exit_barrier(flag)``
    sets what torch sets while it waits in its exit barrier (its health check then reports
    progress). Built on first call, so that importing this module imports no torch.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class ElasticAgent(LocalElasticAgent):
        # ---- what subclasses override; torch's behaviour by default ------------------
        def rendezvous(self, worker_group: Any) -> None:
            super()._rendezvous(worker_group)

        def set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int,
                               spec: Any) -> None:
            super()._set_local_rank_env(worker_env, local_rank, spec)

        def start_workers(self, worker_group: Any) -> dict[int, Any]:
            return super()._start_workers(worker_group)

        def monitor_workers(self, worker_group: Any) -> Any:
            return super()._monitor_workers(worker_group)

        def restart_workers(self, worker_group: Any) -> None:
            super()._restart_workers(worker_group)

        def stop_workers(self, worker_group: Any) -> None:
            super()._stop_workers(worker_group)

        def shutdown(self, death_sig: signal.Signals, timeout: int) -> None:
            call_shutdown(super()._shutdown, death_sig, timeout)

        def exit_barrier(self) -> None:
            super()._exit_barrier()

        # ---- the agent's private state -----------------------------------------------
        def remaining_restarts(self) -> int:
            return int(self._remaining_restarts)

        def worker_pids(self) -> dict[int, int]:
            """Local rank -> pid of the running workers ({} before the first start)."""
            pcontext = self._pcontext
            if pcontext is None:
                return {}
            try:
                return dict(pcontext.pids())
            except Exception:  # the agent thread is tearing the context down
                return {}

        def rendezvous_store(self) -> Any:
            """The store of the current rendezvous round (torch's exit barrier uses it)."""
            return self._store

        def exit_barrier_timeout(self) -> float:
            return float(self._exit_barrier_timeout)

        def mark_exit_barrier(self, waiting: bool) -> None:
            if hasattr(self, "_in_exit_barrier"):  # (not in every torch version)
                self._in_exit_barrier = waiting

        # ---- torch calls these ---------------------------------------------------------
        def _rendezvous(self, worker_group: Any) -> None:
            self.rendezvous(worker_group)

        def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int,
                                spec: Any) -> None:
            self.set_local_rank_env(worker_env, local_rank, spec)

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            return self.start_workers(worker_group)

        def _monitor_workers(self, worker_group: Any) -> Any:
            return self.monitor_workers(worker_group)

        def _restart_workers(self, worker_group: Any) -> None:
            self.restart_workers(worker_group)

        def _stop_workers(self, worker_group: Any) -> None:
            self.stop_workers(worker_group)

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            self.shutdown(death_sig, timeout)

        def _exit_barrier(self) -> None:
            self.exit_barrier()

    return ElasticAgent


def worker_env(agent: Any, worker_group: Any, worker: Any) -> dict[str, str]:
    """The environment torch's ``LocalElasticAgent._start_workers`` gives ``worker`` of
    ``worker_group`` (the same keys and values, then the agent's ``_set_local_rank_env``
    and ``OMP_NUM_THREADS``): what a rank restarted in place must see, exactly as a new
    process would. Reads the agent's ``_remaining_restarts``."""
    import os

    spec = worker_group.spec
    env: dict[str, str | None] = {
        "RANK": str(worker.global_rank),
        "GROUP_RANK": str(worker_group.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": worker_group.master_addr,
        "MASTER_PORT": str(worker_group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(spec.max_restarts - agent._remaining_restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
        "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", str(1)),
    }
    agent._set_local_rank_env(env, worker.local_rank, spec)
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return {k: v for k, v in env.items() if v is not None}


# --------------------------------------------------------------------------------------------
# Leaving a job without closing its rendezvous (an isolated host)
# --------------------------------------------------------------------------------------------


def rendezvous_keeping_error() -> type:
    """The exception class torch's elastic launch treats as a death signal:
    ``SimpleElasticAgent.run`` stops the workers with its ``sigval`` (``_shutdown(sigval)``)
    and ``launch_agent`` then skips ``rdzv_handler.shutdown()``, which would close the
    rendezvous for every node. A subclass raised from the agent's monitor tick ends one
    launcher and leaves the others free to re-rendezvous without it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return SignalException


def leave_rendezvous(handler: Any, timeout_s: float) -> bool:
    """Take this node out of its c10d rendezvous round without closing the rendezvous: stop
    its keep-alives and run the exit step ``next_rendezvous`` runs before a rejoin
    (``_RendezvousExitOp`` through ``DynamicRendezvousHandler._op_executor``, under its
    ``_heartbeat_lock``). The other nodes then start their next round at once, instead of
    after this node's keep-alives expire. Returns False for another kind of handler, or when
    the exit did not finish within ``timeout_s`` (the keep-alives expire anyway)."""
    executor = getattr(handler, "_op_executor", None)
    lock = getattr(handler, "_heartbeat_lock", None)
    stop = getattr(handler, "_stop_heartbeats", None)
    if executor is None or lock is None or stop is None:
        return False
    import time

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    stop()
    if not lock.acquire(timeout=timeout_s):
        return False
    try:
        executor.run(_RendezvousExitOp(), time.monotonic() + timeout_s)
    except Exception as e:  # noqa: BLE001 - best effort: keep-alive expiry is the fallback
        logging.getLogger(__name__).warning("could not leave the rendezvous round (%s: %s); "
                                            "the other nodes drop this one when its "
                                            "keep-alives expire", type(e).__name__, e)
        return False
    finally:
        lock.release()
    return True


# -- dropping a lost node from a c10d rendezvous round (node loss, ftrun.launcher.agent) ------
#
# ``DynamicRendezvousHandler`` keeps the shared state (``_RendezvousState``: ``participants``,
# ``wait_list``, ``redundancy_list``, ``last_heartbeats`` by ``_NodeDesc``) in its backend and
# syncs it through a ``_BackendRendezvousStateHolder(backend, settings, cache_duration)``: the
# holder's ``sync()`` reads the state (or, marked dirty, writes it by compare-and-set and reads
# back the winner) and then ``_sanitize()``s it, which removes every node whose keep-alive is
# older than ``keep_alive_interval * keep_alive_max_attempt`` from all of them and, where a
# participant went, runs the epilogue that moves an emptied complete round to the next one.
# Nodes waiting for a lost member of their round sit in that state until some node's sanitize
# removes it. ftrun removes a node its coordinator declared lost the same way, sooner: a holder
# of its own over the handler's backend (``handler._state_holder._backend``, ``_settings``),
# the lost node's keep-alive stamped expired, torch's ``_sanitize()`` does the removal, and the
# state is written back by compare-and-set (retried on a lost race). Every node that syncs
# next reads the round without it. The backend's store is a TCPStore client, whose operations
# are serialised by its own lock: this runs on a thread of its own while the agent's thread
# waits in ``next_rendezvous`` (which holds no lock of the handler's).

_LONG_EXPIRED = "1970-01-01T00:00:00+00:00"


def _own_holder(backend: Any, settings: Any) -> Any:
    """A state holder of ftrun's own over a handler's backend, never serving from a cache:
    what it reads is the backend's state, what it writes goes by compare-and-set."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _BackendRendezvousStateHolder,
    )

    return _BackendRendezvousStateHolder(backend, settings, cache_duration=0)


def drop_rendezvous_node(handler: Any, node: str, min_silence_s: float,
                         timeout_s: float) -> tuple[str, int | None, float | None]:
    """Remove ``node`` (its name in the rendezvous, :func:`rendezvous_node`) from the c10d
    rendezvous state of ``handler`` as torch removes a node whose keep-alives expired.

    Refused while the node's last keep-alive is younger than ``min_silence_s`` (it reached
    the store after whoever declared it lost stopped hearing from it: not lost). Returns
    (outcome, round, keep-alive age in seconds) with outcome ``dropped``, ``absent`` (not in
    the state: gone already), ``alive`` (refused), ``unsupported`` (another kind of handler)
    or ``timeout`` (no write won the compare-and-set within ``timeout_s``)."""
    import time
    from datetime import datetime, timezone

    holder = getattr(handler, "_state_holder", None)
    backend = getattr(holder, "_backend", None)
    settings = getattr(handler, "_settings", None)
    if backend is None or settings is None:
        return "unsupported", None, None
    mine = _own_holder(backend, settings)
    deadline = time.monotonic() + timeout_s
    while True:
        mine.sync()
        state = mine.state
        desc = next((d for d in state.last_heartbeats if str(d) == node), None)
        if desc is None:
            members = (*state.participants, *state.wait_list, *state.redundancy_list)
            desc = next((d for d in members if str(d) == node), None)
            if desc is None:
                return "absent", int(state.round), None
            age_s = None  # listed without a keep-alive: nothing keeps it there
        else:
            age_s = (datetime.now(timezone.utc) - state.last_heartbeats[desc]).total_seconds()
            if age_s < min_silence_s:
                return "alive", int(state.round), age_s
        round_ = int(state.round)
        state.last_heartbeats[desc] = datetime.fromisoformat(_LONG_EXPIRED)
        mine._sanitize()
        mine.mark_dirty()
        if mine.sync():
            return "dropped", round_, age_s
        if time.monotonic() >= deadline:
            return "timeout", round_, age_s


# -- a node left waiting for a round that is full (ftrun.launcher.agent) ----------------------
#
# In torch's join operation (``_RendezvousJoinOp``) a node that finds a complete round with no
# room goes to ``redundancy_list`` (a spare: not counted by ``num_nodes_waiting()``), and one
# that finds a complete round with room goes to ``wait_list`` (counted: every agent restarts
# its workers to take it in). During a restart the participants leave the complete round one
# by one, so for a moment it has room: a spare moves itself to the wait list, and so does a
# restarting node. Nothing takes a node off the wait list but its own join (or its keep-alives
# expiring). When the next round fills without it (4 launchers for 3 places: one is left out)
# it stays on the wait list of a full round, every agent sees a node waiting and restarts, and
# the next round can leave the same node out again: seen in CI as a job that restarted every
# few seconds and never trained. A node waiting for a full round is a spare; ftrun moves it
# back to the redundancy list, by compare-and-set as in drop_rendezvous_node, where torch's
# join puts it back on the wait list as soon as the round has room again.


class _WaitingForRoom:
    """``num_nodes_waiting()`` that counts only the nodes a new round could take in (see
    :func:`spares_stay_spare`)."""

    def __init__(self, handler: Any) -> None:
        self._handler = handler
        self._check = handler.num_nodes_waiting  # torch's method, or another ftrun wrapper

    def __call__(self) -> int:
        waiting = int(self._check())
        if waiting <= 0:
            return waiting
        holder = getattr(self._handler, "_state_holder", None)
        settings = getattr(self._handler, "_settings", None)
        state = getattr(holder, "state", None)
        if state is None or settings is None or not _full(state, settings.max_nodes):
            return waiting
        try:
            moved = park_waiting_nodes(holder._backend, settings)
        except rendezvous_connection_error() as e:  # tried again on the next tick
            log.debug("could not park the nodes waiting for a full round: %s", e)
            return 0
        if moved:
            log.info("rendezvous round %d is full: %s moved from its wait list to its spares "
                     "(waiting for a round that has room, they would restart every node for "
                     "nothing)", int(state.round), ", ".join(moved))
        return 0  # a full round takes nobody in: restarting every node would change nothing


def _full(state: Any, max_nodes: int) -> bool:
    return bool(state.complete) and not state.closed and len(state.participants) >= max_nodes


def park_waiting_nodes(backend: Any, settings: Any, timeout_s: float = 10.0) -> list[str]:
    """Move every node on the wait list of a complete, full round to its redundancy list
    (compare-and-set, retried on a lost race for up to ``timeout_s``); the names moved."""
    import time

    mine = _own_holder(backend, settings)
    deadline = time.monotonic() + timeout_s
    while True:
        mine.sync()
        state = mine.state
        waiting = [n for n in state.wait_list if n not in state.participants]
        if not waiting or not _full(state, settings.max_nodes):
            return []
        for node in waiting:
            state.wait_list.discard(node)
            state.redundancy_list.add(node)
        mine.mark_dirty()
        if mine.sync():
            return [str(n) for n in waiting]
        if time.monotonic() >= deadline:
            return []


def spares_stay_spare(handler: Any) -> None:
    """Have ``handler.num_nodes_waiting()`` (what torch's agent asks on every monitor tick
    while its workers are healthy) park the nodes waiting for a complete round that has no
    room as spares and not count them, and have this node, while a spare, leave the places
    of a new round to the previous round's live members (:class:`_SpareDefers`); a
    c10d/etcd ``DynamicRendezvousHandler`` only."""
    if getattr(handler, "_state_holder", None) is None or not hasattr(handler, "_settings"):
        return
    handler.num_nodes_waiting = _WaitingForRoom(handler)
    executor = getattr(handler, "_op_executor", None)
    if executor is not None and not isinstance(executor, _SparesDeferExecutor):
        handler._op_executor = _SparesDeferExecutor(executor)


# -- the rendezvous's poll -----------------------------------------------------------------
#
# A node that waits in torch's rendezvous (for the others to join a round, or for the next
# round) syncs the shared state and, when it has nothing to do, sleeps a second
# (``dynamic_rendezvous._delay(seconds=1)``, a module function) before syncing again. Every
# node of a re-formation waits for the others this way, so each one costs up to a second of
# polling on top of its work (1.3 s of an in-place restart's 1.5 s was this wait). ftrun's
# launchers poll the first moments of each wait sooner and back off to torch's second: the
# first poll after QUICK_POLL_S per 8 nodes of the job (at least QUICK_POLL_S, at most 1 s),
# each next one twice as late. N nodes polling together thus sync about 8 / QUICK_POLL_S
# (160) times a second at the store at first, whatever N (from 160 nodes on, torch's second
# unchanged), and a long wait (a spare's, a node waiting for the next round) polls once a
# second as before. A new wait starts over at the first delay.

TORCH_POLL_S = 1.0
QUICK_POLL_S = 0.05
_poll = threading.local()
_first_poll_s = TORCH_POLL_S


def quick_rendezvous_polls(nodes: int) -> float:
    """Have this process's rendezvous waits poll sooner at first (see above), for a job of up
    to ``nodes`` nodes; returns the first delay. The poll is torch's
    ``dynamic_rendezvous._delay`` (c10d and etcd rendezvous alike), replaced once."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    global _first_poll_s
    _first_poll_s = min(TORCH_POLL_S, max(QUICK_POLL_S, QUICK_POLL_S * max(1, nodes) / 8))
    if not getattr(dr._delay, "ftrun_quick", False):
        dr._delay = _quick_delay(dr._delay)
    return _first_poll_s


def rendezvous_max_nodes(handler: Any) -> int | None:
    """The most nodes a c10d/etcd ``DynamicRendezvousHandler`` admits (its private settings),
    None for another handler."""
    settings = getattr(handler, "_settings", None)
    nodes = getattr(settings, "max_nodes", None)
    return nodes if isinstance(nodes, int) else None


def _quick_delay(torch_delay: Callable[..., None]) -> Callable[..., None]:
    import time

    def delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple) or seconds != TORCH_POLL_S:
            torch_delay(seconds=seconds)  # not the wait's poll (the first join's jitter)
            return
        now = time.monotonic()
        wait = getattr(_poll, "next_s", _first_poll_s)
        if now - getattr(_poll, "last", float("-inf")) > 2 * TORCH_POLL_S + 0.5:
            wait = _first_poll_s  # a new wait: the previous poll was long ago
        time.sleep(wait)
        _poll.next_s = min(TORCH_POLL_S, 2 * wait)
        _poll.last = time.monotonic()

    delay.ftrun_quick = True  # type: ignore[attr-defined]
    return delay


# -- the master port a rendezvous picks (group rank 0) --------------------------------------
#
# When the workers do not share the rendezvous's store, the round's group rank 0 picks the
# workers' MASTER_PORT with ``get_free_port()``: a port free on *localhost* (it binds
# ``localhost:0`` and closes). A listener bound to the node's own address on that port
# (ftrun's snapshot store serves replicas and shards on the node's address, on ports the OS
# picks) does not conflict with that check, but it does with rank 0's store, which listens
# on every address: rank 0 then fails with EADDRINUSE (seen in CI: the replica listener and
# the master port on the same number). ftrun's launchers pick the port on the wildcard
# address instead (IPv6 dual-stack where the host has it), which a listener on any address
# of the host makes busy.


def free_port_any_address() -> int:
    """A TCP port free on every address of this host now (not reserved: it is closed on
    return, like torch's own pick)."""
    import socket

    if socket.has_ipv6:
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind(("::", 0))
                return int(s.getsockname()[1])
        except OSError:
            pass  # no IPv6 on this host: the IPv4 wildcard
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def master_port_free_on_every_address() -> None:
    """Have the rendezvous's master-port pick (``rendezvous.api.get_free_port``, which
    ``RendezvousStoreInfo.build`` calls) choose a port free on every address; once."""
    from torch.distributed.elastic.rendezvous import api

    if getattr(api.get_free_port, "ftrun_any_address", False):
        return

    def get_free_port() -> int:
        return free_port_any_address()

    get_free_port.ftrun_any_address = True  # type: ignore[attr-defined]
    api.get_free_port = get_free_port


# -- a spare does not take a restarting survivor's place ------------------------------------
#
# When the nodes of a round restart (an in-place restart: every process lives on), they leave
# the round one by one and join the next; torch's join lets a spare take a place in the new
# round as soon as it opens, on equal terms. With N places and N survivors, whichever survivor
# joins last finds the round full: its workers, alive and ready, are stopped and it becomes a
# spare, while the spare starts new processes (seen in CI, a survivor that was also its
# group's aggregator lost its place). A spare (a node that was on the redundancy list during
# this join) therefore takes a place in an open round only while the previous round's members
# that are still alive (a keep-alive in the state) and have not joined yet leave room for it,
# and in any case once a keep-alive window (interval x max attempts) has passed: a lost member
# stops counting when its keep-alive expires or the coordinator has it dropped.


class _SparesDeferExecutor:
    """A handler's rendezvous operation executor whose join operations are
    :class:`_SpareDefers`; everything else goes to torch's executor."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor

    def run(self, state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        if isinstance(state_handler, dr._RendezvousJoinOp):
            state_handler = _SpareDefers(state_handler)
        self._executor.run(state_handler, deadline, update_deadline)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


class _SpareDefers:
    """torch's join operation, deferring a spare's ADD_TO_PARTICIPANTS (see above)."""

    def __init__(self, join: Any) -> None:
        self._join = join
        self._spare = False
        self._members: dict[int, set[Any]] = {}  # round -> every node seen a participant
        self._since: tuple[int, float] | None = None  # (round, when it began deferring)

    def __call__(self, ctx: Any, deadline: float) -> Any:
        import time

        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        state = ctx.state
        self._spare = self._spare or ctx.node in state.redundancy_list
        if state.complete:  # (a spare can wait through many rounds: keep the last two)
            self._members.setdefault(int(state.round), set()).update(state.participants)
            for old in [r for r in self._members if r < int(state.round) - 1]:
                del self._members[old]
        action = self._join(ctx, deadline)
        if action != dr._Action.ADD_TO_PARTICIPANTS or not self._spare:
            return action
        expected = [n for n in self._members.get(int(state.round) - 1, ())
                    if n in state.last_heartbeats and n not in state.participants
                    and n != ctx.node]
        if len(state.participants) + len(expected) < ctx.settings.max_nodes:
            return action  # room for this spare once every live member is back
        now = time.monotonic()
        if self._since is None or self._since[0] != int(state.round):
            self._since = (int(state.round), now)
        window = (ctx.settings.keep_alive_interval * ctx.settings.keep_alive_max_attempt)
        if now - self._since[1] >= window.total_seconds():
            log.info("spare %s joins rendezvous round %d: %d live member(s) of the previous "
                     "round did not join within %.0f s", ctx.node, int(state.round),
                     len(expected), window.total_seconds())
            return action
        if self._since[1] == now:
            log.info("spare %s leaves the places of rendezvous round %d to the previous "
                     "round's %d live member(s) still joining", ctx.node, int(state.round),
                     len(expected))
        return dr._Action.KEEP_ALIVE if dr._should_keep_alive(ctx) else dr._Action.SYNC


# -- the Flight Recorder (ftrun.rank.collectives) ----------------------------------------------
#
# torch records every collective of every process group in its Flight Recorder, on gloo too:
# per group, the sequence numbers of the last collective enqueued, started and completed
# (``pg_status``), and a ring buffer of entries (op, sizes, enqueue time). The dump function is
# private; with ``includeCollectives=False`` it returns only ``pg_status`` (a few µs), with
# True the whole ring buffer (tens of ms when full).


def fr_dump(include_collectives: bool) -> dict[str, Any]:
    """The Flight Recorder's JSON dump (``torch._C._distributed_c10d._dump_fr_trace_json``).

    torch keeps two recorders: that generic one (gloo, CPU backends) and, in builds with
    NCCL, ProcessGroupNCCL's own (``_dump_nccl_trace_json``), where NCCL collectives go. Both
    are read and merged: ``pg_status`` by group name (a group in both counts its NCCL
    collectives), ``entries`` appended.
    """
    import json

    from torch._C import _distributed_c10d as c10d

    doc = json.loads(c10d._dump_fr_trace_json(includeCollectives=include_collectives,
                                              onlyActive=False))
    nccl = getattr(c10d, "_dump_nccl_trace_json", None)
    if nccl is not None:
        other = json.loads(nccl(includeCollectives=include_collectives, onlyActive=False))
        doc.setdefault("pg_status", {}).update(other.get("pg_status") or {})
        doc["entries"] = [*(doc.get("entries") or []), *(other.get("entries") or [])]
    return doc


def process_groups() -> dict[str, Any]:
    """The process groups of this process by the name the Flight Recorder keys them by
    (``distributed_c10d._world.pg_names``: group -> name)."""
    from torch.distributed import distributed_c10d

    return {str(name): pg for pg, name in distributed_c10d._world.pg_names.items()}


# torch.distributed.distributed_c10d._abort_process_group(group=None) (private, "experimental",
# present since torch 2.3): aborts every process group of the process (NCCL communicators in
# one group call, so that aborts of several communicators cannot deadlock each other; pending
# collectives return with an error) and clears the module's group registry, so that a new
# default group can be initialised in the same process.


def abort_process_groups() -> None:
    """Abort every process group of this process and forget them all (no-op without one)."""
    from torch.distributed import distributed_c10d as c10d

    if c10d.GroupMember.WORLD is None:
        return
    c10d._abort_process_group(None)


def detach_process_groups() -> Callable[[], None]:
    """Forget every process group of this process now, and return the function that aborts
    them: :func:`abort_process_groups` split in two, so that a new default group can form
    while the old ones are aborted on another thread.

    An NCCL abort costs about a second however little is pending (measured on H100, torch
    2.11), and a new group forms alongside it in 14-19 ms; on gloo an abort costs
    milliseconds and callers abort at once. Clears what ``_abort_process_group(None)``
    clears after its aborts (``_update_default_pg(None)``, ``_world``'s maps, the registry of
    ``_unregister_all_process_groups``, ``_world.group_count``) and aborts the groups in its
    order, inside one NCCL group call.
    """
    import torch
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    if world is None:
        return lambda: None
    groups = sorted(c10d._world.pg_names, key=lambda g: c10d._world.pg_names[g], reverse=True)
    try:
        backend = world._get_backend(torch.device("cuda"))
    except RuntimeError:
        backend = None
    nccl = c10d.is_nccl_available() and isinstance(backend, c10d.ProcessGroupNCCL)
    c10d._update_default_pg(None)
    w = c10d._world
    for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag,
                  w.tags_to_pg, w.pg_coalesce_state):
        table.clear()
    c10d._unregister_all_process_groups()
    w.group_count = 0

    def abort() -> None:
        if nccl:
            backend._group_start()
        try:
            for pg in groups:
                pg.abort()
        finally:
            if nccl:
                backend._group_end()

    return abort


def default_backend() -> str | None:
    """The default process group's backend name ("gloo", "nccl", ...), None without one."""
    from torch.distributed import distributed_c10d as c10d

    if c10d.GroupMember.WORLD is None:
        return None
    return str(c10d.get_backend())


# -- replacing one worker of a running process context (in-process restart) -------------------
#
# torch's LocalElasticAgent keeps all local workers in one ``SubprocessContext``
# (``agent._pcontext``, torch.distributed.elastic.multiprocessing.api): a dict of
# ``SubprocessHandler`` (each holding its ``Popen`` as ``.proc``) by local rank in
# ``subprocess_handlers``, the local ranks still running in ``_running_local_ranks``, the
# failures seen in ``_failures``, and per local rank ``args``, ``envs`` (with the
# TORCHELASTIC_ERROR_FILE reify() set), ``stdouts``, ``stderrs``, ``error_files``. Its
# ``_poll`` closes every process as soon as one failed: ftrun reads the processes' exit codes
# itself first (``worker_processes``) and swaps a new handler in for a dead rank
# (``replace_worker``), so the context then monitors and closes the survivors and the
# replacement alike. A context without these attributes (a function entrypoint's
# MultiprocessContext, a torch that moved them) makes both return None / raise
# ``SeamMissing``: the caller restarts every worker the way torch does.

_CONTEXT_ATTRS = ("subprocess_handlers", "_running_local_ranks", "_failures", "entrypoint",
                  "args", "envs", "stdouts", "stderrs", "error_files")


class SeamMissing(RuntimeError):
    """A torch internal ftrun relies on is missing (another torch version); the message
    names it."""


def _check_context(pcontext: Any) -> None:
    missing = [a for a in _CONTEXT_ATTRS if not hasattr(pcontext, a)]
    if missing:
        raise SeamMissing(f"torch's process context {type(pcontext).__name__} has no "
                          f"{', '.join(missing)}: dead ranks cannot get new processes alone "
                          "(ftrun supports torch 2.11 to 2.15)")
    for handler in pcontext.subprocess_handlers.values():
        if not hasattr(handler, "proc"):
            raise SeamMissing(f"torch's {type(handler).__name__} has no .proc")


def worker_processes(pcontext: Any) -> dict[int, Any] | None:
    """Local rank -> the worker's ``subprocess.Popen``, for a ``SubprocessContext`` (None
    for another context, or a torch without the attributes, logged once)."""
    if pcontext is None:
        return None
    try:
        _check_context(pcontext)
    except SeamMissing as e:
        _warn_once(str(e))
        return None
    return {lr: h.proc for lr, h in pcontext.subprocess_handlers.items()}


def replace_worker(pcontext: Any, local_rank: int, env: dict[str, str]) -> int:
    """Start a new process for ``local_rank`` of ``pcontext`` (whose old process has exited),
    with torch's own entrypoint, arguments and log files and environment ``env`` (plus the
    error file torch gave that rank); the context then monitors and closes it like the
    others. Returns its pid. Raises SeamMissing."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        get_subprocess_handler,
    )

    _check_context(pcontext)
    old = pcontext.subprocess_handlers[local_rank]
    if old.proc.poll() is None:
        raise RuntimeError(f"local rank {local_rank} (pid {old.proc.pid}) still runs")
    for f in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
        if f is not None:
            f.close()
    env = dict(env)
    error_file = pcontext.envs[local_rank].get("TORCHELASTIC_ERROR_FILE")
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
        if error_file:
            with contextlib.suppress(FileNotFoundError):
                import os

                os.unlink(error_file)  # the old process's error is not the new one's
    kwargs: dict[str, Any] = {}
    if "numa_options" in inspect.signature(get_subprocess_handler).parameters:
        kwargs["numa_options"] = getattr(pcontext, "_numa_options", None)  # not in 2.11
    handler = get_subprocess_handler(
        entrypoint=pcontext.entrypoint, args=pcontext.args[local_rank], env=env,
        stdout=pcontext.stdouts[local_rank], stderr=pcontext.stderrs[local_rank],
        local_rank_id=local_rank, **kwargs)
    pcontext.subprocess_handlers[local_rank] = handler
    pcontext._failures.pop(local_rank, None)
    pcontext._running_local_ranks.add(local_rank)
    return int(handler.proc.pid)


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning("%s", msg)


# -- starting a worker from a pre-started interpreter (warm workers) ---------------------------
#
# Every worker process torch's agent starts, at the first start, at a restart of every worker
# and through ``replace_worker``, comes from ``SubprocessHandler.__init__`` (torch.distributed.
# elastic.multiprocessing.subprocess_handler), which opens the rank's log files as
# ``self._stdout``/``self._stderr`` (None: inherit the launcher's), sets
# ``self.local_rank_id`` and then calls ``self._popen(args, env)``: ``args`` the command
# (entrypoint and arguments, possibly wrapped for NUMA binding), ``env`` the launcher's
# environment updated with the worker's. ``_popen`` returns the ``subprocess.Popen`` that
# becomes ``handler.proc`` (polled, waited for, and stopped with ``os.killpg(proc.pid, sig)``:
# torch starts it with ``start_new_session=True``, so it leads a process group).

WorkerStart = Callable[[tuple[str, ...], dict[str, str], Any, Any, int], Any]


def intercept_worker_starts(start: WorkerStart) -> Callable[[], None]:
    """Have every worker process torch's agent starts from now on ask ``start(args, env,
    stdout, stderr, local_rank)`` first: a ``subprocess.Popen`` it returns (a process that
    leads its own session, as torch's would) becomes the worker; None lets torch start the
    process as it always does. Returns the function that undoes this. Raises SeamMissing."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as module,
    )

    cls = getattr(module, "SubprocessHandler", None)
    original = getattr(cls, "_popen", None)
    if cls is None or original is None or \
            list(inspect.signature(original).parameters) != ["self", "args", "env"]:
        raise SeamMissing("torch's SubprocessHandler has no _popen(self, args, env): worker "
                          "processes cannot start from warm interpreters (ftrun supports "
                          "torch 2.11 to 2.15)")

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
        proc = start(tuple(args), env, getattr(self, "_stdout", None),
                     getattr(self, "_stderr", None), int(getattr(self, "local_rank_id", -1)))
        return original(self, args, env) if proc is None else proc

    cls._popen = _popen

    def undo() -> None:
        if cls._popen is _popen:
            cls._popen = original

    return undo


# -- rendezvous backends of ftrun's own (etcd v3) ---------------------------------------------
#
# torch's elastic rendezvous is one state machine, ``DynamicRendezvousHandler``
# (torch.distributed.elastic.rendezvous.dynamic_rendezvous), over two parts a backend supplies:
# a ``RendezvousBackend`` holding the rendezvous state (``get_state()`` and a compare-and-set
# ``set_state(state, token)``; its ``name`` is what the handler reports as its backend) and a
# ``torch.distributed.Store`` that the handler hands to the agent (``RendezvousInfo.store``,
# under a ``PrefixStore`` per round): the agent publishes MASTER_ADDR/MASTER_PORT, its role
# info and assigned ranks, and runs its exit barrier there. ``create_handler(store, backend,
# params)`` reads the timeouts and keep-alive settings from ``params`` as c10d does. Backends
# are found by name in ``rendezvous_handler_registry``; its ``register`` refuses a name already
# taken by another creator (torch registers ``etcd`` and ``etcd-v2``, both on etcd's v2 API).

_registered_backends: dict[str, Callable[[Any], Any]] = {}


def rendezvous_backend_base() -> type:
    """torch's ``RendezvousBackend`` ABC, for a backend to subclass."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    return RendezvousBackend


def rendezvous_connection_error() -> type:
    """``RendezvousConnectionError``: what a backend raises when its service is unreachable."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    return RendezvousConnectionError


def rendezvous_closed_error() -> type:
    """``RendezvousClosedError``: a rendezvous that was closed (its job ended)."""
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    return RendezvousClosedError


def register_rendezvous_backend(name: str, make: Callable[[Any], tuple[Any, Any]],
                                keep_world_retry_s: float | None = None) -> None:
    """Have torch's launcher build, for ``--rdzv-backend name``, its own
    ``DynamicRendezvousHandler`` over ``make(params) -> (backend, store)`` (``params``: the
    launcher's ``RendezvousParameters``). Idempotent for one ``name``.
    ``keep_world_retry_s``: the handlers keep the world while the backend is unreachable
    (:func:`keep_world_while_unreachable`), trying it again every that many seconds."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    if name in _registered_backends:
        return

    def create(params: Any) -> Any:
        backend, store = make(params)
        handler = create_handler(store, backend, params)
        if keep_world_retry_s is not None:
            keep_world_while_unreachable(handler, keep_world_retry_s)
        return handler

    rendezvous_handler_registry.register(name, create)
    _registered_backends[name] = create


class _WaitingWhileUnreachable:
    """``num_nodes_waiting()`` of a handler whose backend may be unreachable for a while
    (see :func:`keep_world_while_unreachable`)."""

    def __init__(self, handler: Any, retry_s: float) -> None:
        self._check = handler.num_nodes_waiting  # torch's bound method
        self._run_id = handler.get_run_id()
        self.retry_s = retry_s
        self.down_since: float | None = None  # monotonic; None while the backend answers
        self._next_try = 0.0

    def __call__(self) -> int:
        import time

        error = rendezvous_connection_error()
        now = time.monotonic()
        if self.down_since is not None and now < self._next_try:
            return 0
        try:
            waiting = int(self._check())
        except error as e:
            self._next_try = time.monotonic() + self.retry_s
            if self.down_since is None:
                self.down_since = now
                log.warning(
                    "the rendezvous of job %s is unreachable (%s): the job keeps training on "
                    "its current world, but cannot recover from a fault (that needs a "
                    "rendezvous) until it is back; trying again every %g s",
                    self._run_id, e, self.retry_s)
            return 0
        if self.down_since is not None:
            log.warning("the rendezvous of job %s is reachable again (after %.1f s)",
                        self._run_id, time.monotonic() - self.down_since)
            self.down_since = None
        return waiting


def keep_world_while_unreachable(handler: Any, retry_s: float) -> None:
    """Keep the current world training while ``handler``'s backend is unreachable.

    torch's agent asks ``rdzv_handler.num_nodes_waiting()`` on every monitor tick while its
    workers are healthy; ``DynamicRendezvousHandler`` syncs its state with the backend there
    and lets a ``RendezvousConnectionError`` propagate out of the agent's loop, which ends
    the launch: a job whose rendezvous service lost its quorum for a moment (etcd) would stop
    every rank although none needs the rendezvous to go on training. Here the handler's
    ``num_nodes_waiting`` (an attribute of the instance, so torch's call finds it) answers 0
    (nobody waits, as far as anyone can tell) while the backend is unreachable, logs that
    once, and tries the backend again only every ``retry_s`` seconds (each try can take the
    backend's request timeout, during which the agent's loop does not watch its workers).
    Everything else still needs the backend: a rendezvous (a fault's recovery) raises as
    before; the keep-alive thread logs its failures as before.
    """
    handler.num_nodes_waiting = _WaitingWhileUnreachable(handler, retry_s)


def discount_keep_alives(state_bits: bytes, outage_s: float, interval_s: float = 0.0) -> bytes:
    """torch's pickled rendezvous state (``_RendezvousState``) with every node's last
    keep-alive (``last_heartbeats``) moved ``outage_s + interval_s`` seconds later, never past
    now.

    For a backend that was unreachable for ``outage_s``: nobody could write a keep-alive
    meanwhile, so without this the first node to read the state afterwards would find every
    keep-alive expired, drop every node (``_sanitize``, on its own copy) and every agent
    would restart its workers. Moved by the outage, each keep-alive is as old as it was when
    the outage began; ``interval_s`` (the keep-alive interval) more covers the keep-alive
    timer's phase: a node writes one only on a tick when its last is an interval old, so
    a live node's keep-alive is up to two intervals old between ticks, and after the outage
    its next tick can come up to one interval later than it would have. A node that had
    stopped before the outage still expires, later by the outage and an interval at most."""
    import pickle
    from datetime import datetime, timedelta, timezone

    state = pickle.loads(state_bits)  # noqa: S301 - torch's own state, from the job's key
    beats = getattr(state, "last_heartbeats", None)
    if not beats:
        return state_bits
    shift = timedelta(seconds=outage_s + interval_s)
    for node, beat in beats.items():
        now = datetime.now(timezone.utc)
        if beat.tzinfo is None:  # torch before 2.6 wrote naive UTC times
            now = now.replace(tzinfo=None)
        beats[node] = min(now, beat + shift)
    return pickle.dumps(state)


def bound_tcp_store(host: str, port: int, bind_host: str, timeout_s: float) -> Any:
    """A ``TCPStore`` server that listens on ``bind_host`` only (port ``port``, 0: the OS
    picks), for clients that reach it at ``host``.

    torch's TCPStore server binds every interface; its ``master_listen_fd`` takes a socket
    bound and listening already, which the server then owns (and closes). Only the libuv
    backend (torch's default since 2.4) takes one; the store is multi-tenant, as torch's
    launcher makes its own. Raises OSError when the address cannot be bound."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        bound_port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns it from here
    try:
        return TCPStore(host, bound_port, is_master=True, multi_tenant=True,
                        wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                        master_listen_fd=fd, use_libuv=True)
    except BaseException:
        import os

        os.close(fd)
        raise
