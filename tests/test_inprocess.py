"""In-process restart (``@ftrun.resilient``) with real ftrun launchers, gloo on CPU.

examples/user_ddp.py wraps its training function in ``@ftrun.resilient``. A rank that raises
or is SIGKILLed mid-epoch is dead: its process exits, which closes its gloo connections and
so releases the ranks blocked in DDP's all-reduce with it (their wrappers see a peer lost
and wait for the launcher). Its launcher gives only that rank a new process; the survivors,
on its node and on the others, are aborted, re-rendezvous and run the function again in the
same process. The recovery is recorded (event ``recovery``: how, why, phases, new
processes), and the final weights are bit-identical to the fault-free run. (A SIGKILLed rank
on two launchers x two ranks is tests/test_user_ddp.py; a lost host, tests/test_node_loss.py.)
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, Procs, free_port, read_events

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("exact_steps")]

SCRIPT = str(ROOT / "examples" / "user_ddp.py")
# 192 samples / 3 ranks / batch 8 = 8 steps per epoch, 2 epochs.
ARGS = ("--epochs", "2", "--samples", "192", "--batch-size", "8", "--hidden", "64")


def launcher_args(run_id: str, port: int, nproc: int, nnodes: int = 1) -> list[str]:
    return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--max-restarts", "2"]


def run_job(procs: Procs, tmp: Path, *script_args: str,
            env: dict[str, str] | None = None) -> tuple[str, str, str]:
    """One launcher x three ranks; returns (params_xxh3, run id, output)."""
    run_id = f"inproc-{uuid.uuid4().hex[:8]}"
    env = {"FTRUN_STATE_DIR": str(tmp / "state"), **(env or {})}
    p = procs.ftrun(*launcher_args(run_id, free_port(), 3), SCRIPT, *ARGS, "--fault-dir", str(tmp), "--pid-log", str(tmp),
                    *script_args, env=env, name="node0")
    code = procs.wait(p, 240)
    out = procs.output(p)
    assert code == 0, f"exit code {code}\n{out[-6000:]}"
    digests = re.findall(r"user-ddp: step=16 world=3 params_xxh3=([0-9a-f]+)", out)
    assert len(digests) == 1, out[-6000:]
    return digests[0], run_id, out


def pids_by_rank(tmp: Path) -> dict[int, set[int]]:
    out = {}
    for rank in range(3):
        lines = (tmp / f"pids-rank{rank}.log").read_text().splitlines()
        out[rank] = {int(line.split()[1]) for line in lines}  # step pid time
    return out


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("inproc-baseline")
    procs = Procs(tmp)
    try:
        return run_job(procs, tmp)[0]
    finally:
        procs.cleanup()


def assert_only_rank_replaced(tmp: Path, events: list[dict], rank: int) -> dict:
    """One in-place recovery, in which ``rank`` (and only it) got a new process."""
    recoveries = [e for e in events if e["type"] == "recovery"]
    assert recoveries and all(r["how"] == "in_process" for r in recoveries), recoveries
    assert all(r["new_processes"] in ([rank], []) for r in recoveries), recoveries
    assert [rank] in [r["new_processes"] for r in recoveries], recoveries
    assert {"abort_s", "rendezvous_s", "world_s"} <= recoveries[0].keys(), recoveries
    pids = pids_by_rank(tmp)
    assert len(pids[rank]) == 2, pids  # the dead rank's new process
    assert all(len(p) == 1 for r, p in pids.items() if r != rank), pids  # survivors kept
    return recoveries[0]


def test_raised_fault_recovers_in_place(procs: Procs, tmp_path: Path,
                                        fault_free: str) -> None:
    """Rank 1 raises (gloo, every rank under one launcher): it keeps its process like the
    others; the launcher aborts ranks 0 and 2, every rank shuts down the connections it
    accepted, and the three run the function again in their processes."""
    digest, run_id, out = run_job(procs, tmp_path, "--fail-mode", "raise",
                                  "--kill-at-step", "5", "--kill-rank", "1")
    assert (tmp_path / "user-ddp-fault-rank1-step5").exists(), "the fault never fired"
    assert "raising in rank 1 in step 5" in out
    recoveries = [e for e in read_events(tmp_path / "state", run_id) if e["type"] == "recovery"]
    assert [(r["how"], r["new_processes"], sorted(r["kept"])) for r in recoveries] == \
        [("in_process", [], [0, 1, 2])], recoveries
    assert "rank 1 failed" in recoveries[0]["why"] and "injected fault" in recoveries[0]["why"]
    pids = pids_by_rank(tmp_path)
    assert all(len(p) == 1 for p in pids.values()), pids  # every rank kept its process
    assert digest == fault_free


def test_stopped_rank_is_killed_and_replaced_alone(procs: Procs, tmp_path: Path,
                                                  fault_free: str) -> None:
    """A rank frozen by SIGSTOP cannot leave the function: named by the coordinator (the
    others wait for it) or by its launcher (stopped too long), it is killed and gets a new
    process; the others restart in place. Named by the coordinator, the in-place restart
    itself kills it (a stopped survivor, at the start of every in-place restart)."""
    digest, run_id, out = run_job(procs, tmp_path, "--fail-mode", "stop",
                                  "--kill-at-step", "5", "--kill-rank", "1")
    assert (tmp_path / "user-ddp-fault-rank1-step5").exists(), "the fault never fired"
    events = read_events(tmp_path / "state", run_id)
    hang = [e for e in events if e["type"] == "hang_detected" and e["rank"] == 1]
    stopped = [e for e in events if e["type"] == "stopped_rank_killed"]
    rec = assert_only_rank_replaced(tmp_path, events, 1)
    if hang:  # its launcher found it stopped too long and killed it
        assert "rank 1 hung (stopped (SIGSTOP)" in rec["why"] and "killed" in rec["why"], rec
    else:  # the coordinator named it; the restart in place killed it
        named = [e for e in events if e["type"] == "directive_restart" and 1 in e["ranks"]]
        assert named and all(e["in_place"] and e["killed"] == [] for e in named), named
        assert [(e["rank"], e["local_rank"]) for e in stopped] == [(1, 1)], stopped
        assert rec["stopped_killed"] == [1] and rec["why"].startswith("coordinator:"), rec
    assert digest == fault_free


def test_rank_killed_while_its_snapshot_is_half_copied(procs: Procs, tmp_path: Path,
                                                       fault_free: str) -> None:
    """Rank 1 is SIGKILLed from its snapshot copy thread while the snapshot of step 5 is
    half written (the others' copies of step 5 in flight or staged). That step is never
    complete: the restarted world resumes from step 4, the new rank 1 finds its torn buffer
    and does not load it, the survivors keep their processes (their own copies in flight are
    given up by the abort), and the weights are the fault-free run's."""
    digest, run_id, out = run_job(procs, tmp_path, "--fail-mode", "copy",
                                  "--kill-at-step", "5", "--kill-rank", "1")
    assert (tmp_path / "copy-fault-rank1-step5").exists(), "the fault never fired"
    assert "SIGKILL rank 1 in step 5 (copy)" in out, out[-6000:]
    assert "holds step 5 writing: torn or unverified, not loaded" in out, out[-6000:]
    resumed = set(re.findall(r"user-ddp: rank (\d) resumed from step (\d+)", out))
    assert resumed == {("0", "4"), ("1", "4"), ("2", "4")}, resumed
    assert_only_rank_replaced(tmp_path, read_events(tmp_path / "state", run_id), 1)
    assert digest == fault_free


def test_rank_hung_outside_collectives_keeps_its_process_like_everyone(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """Rank 1 hangs in Python code outside any collective (alive, never progressing) while
    the others wait for it in DDP's all-reduce. The coordinator names it; the in-place
    restart aborts every rank, the hung one included (the abort's exception reaches it in
    its sleep), so no rank gets a new process; the weights are the fault-free run's. (Named
    after --busy-hang-timeout, 60 s by default: 8 s here.)"""
    digest, run_id, out = run_job(procs, tmp_path, "--fail-mode", "hang",
                                  "--kill-at-step", "5", "--kill-rank", "1",
                                  env={"FTRUN_BUSY_HANG_TIMEOUT": "8"})
    assert (tmp_path / "user-ddp-fault-rank1-step5").exists(), "the fault never fired"
    events = read_events(tmp_path / "state", run_id)
    recoveries = [e for e in events if e["type"] == "recovery"]
    assert recoveries and all(r["how"] == "in_process" for r in recoveries), recoveries
    assert all(r["new_processes"] == [] for r in recoveries), recoveries
    named = [e for e in events if e["type"] == "directive_restart" and 1 in e["ranks"]]
    assert named, [e["type"] for e in events]
    hangs = [e["evidence"] for e in events if e["type"] == "detection" and e["kind"] == "hang"]
    # Named past --busy-hang-timeout's 8 s (or 10x the group's typical wait), not 60 s.
    assert hangs and all(h["threshold_s"] < 60 for h in hangs), hangs
    pids = pids_by_rank(tmp_path)
    assert all(len(p) == 1 for p in pids.values()), pids  # every rank kept its process
    assert digest == fault_free


def test_rank_that_never_leaves_and_a_second_fault_while_re_forming(
        procs: Procs, tmp_path: Path, fault_free: str) -> None:
    """Rank 1 is SIGKILLed in step 5 while rank 2 is stuck in a C call that no signal
    interrupts: rank 2 cannot leave the function, so after FTRUN_INPLACE_TIMEOUT it is
    killed and gets a new process too (the fallback, logged); rank 0 restarts in place.
    Then the new rank 1 is SIGKILLed right after its restore, while the job re-forms: a
    second in-place restart. Rank 0 keeps its process through both; the weights are the
    fault-free run's."""
    digest, run_id, out = run_job(procs, tmp_path, "--fail-mode", "kill", "--kill-at-step",
                                  "5", "--kill-rank", "1", "--stuck-rank", "2",
                                  "--kill-after-restore-rank", "1")
    for marker in ("user-ddp-fault-rank1-step5", "user-ddp-stuck-rank2-step5",
                   "user-ddp-after-restore-rank1"):
        assert (tmp_path / marker).exists(), f"{marker}: that fault never fired"
    assert "did not leave the training function" in out, out[-6000:]
    recoveries = [e for e in read_events(tmp_path / "state", run_id) if e["type"] == "recovery"]
    assert [r["how"] for r in recoveries] == ["in_process", "in_process"], recoveries
    assert [r["new_processes"] for r in recoveries] == [[1, 2], [1]], recoveries
    assert [r["kept"] for r in recoveries] == [[0], [0, 2]], recoveries
    pids = pids_by_rank(tmp_path)
    # Rank 1's second process died before its first step: it logged none.
    assert (len(pids[0]), len(pids[1]), len(pids[2])) == (1, 2, 2), pids
    assert digest == fault_free


def test_two_nodes_survivors_keep_their_processes(procs: Procs, tmp_path: Path,
                                                   fault_free: str) -> None:
    """Launchers with 1 and 2 ranks; the rank that raises is on one of them: the survivors
    on both nodes keep their processes, and the world re-forms from the launchers' votes
    (pushed: the members stay), not through a new rendezvous round."""
    run_id = f"inproc2-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {"FTRUN_STATE_DIR": str(tmp_path / "state")}
    nodes = [procs.ftrun(*launcher_args(run_id, port, nproc, nnodes=2), SCRIPT, *ARGS,
                         "--fault-dir", str(tmp_path), "--pid-log", str(tmp_path),
                         "--fail-mode", "raise", "--kill-at-step", "5", "--kill-rank", "1",
                         env=env, name=f"node{i}")
             for i, nproc in enumerate((1, 2))]
    outs = []
    for node in nodes:
        code = procs.wait(node, 240)
        outs.append(procs.output(node))
        assert code == 0, f"exit code {code}\n{outs[-1][-6000:]}"
    assert (tmp_path / "user-ddp-fault-rank1-step5").exists(), "the fault never fired"
    digests = re.findall(r"user-ddp: step=16 world=3 params_xxh3=([0-9a-f]+)", "".join(outs))
    assert digests == [fault_free], digests
    events = read_events(tmp_path / "state", run_id)
    recoveries = [e for e in events if e["type"] == "recovery"]
    assert len(recoveries) == 2 and all(r["how"] == "in_process" for r in recoveries), \
        recoveries  # one per launcher
    assert sorted(map(tuple, (r["new_processes"] for r in recoveries))) == [(), (1,)], \
        recoveries
    assert [r["world"] for r in recoveries] == ["pushed", "pushed"], recoveries
    pushed = [e for e in events if e["type"] == "rendezvous" and e.get("pushed")]
    assert len(pushed) == 2, pushed
    pids = pids_by_rank(tmp_path)
    assert len(pids[1]) == 2 and len(pids[0]) == 1 and len(pids[2]) == 1, pids


def test_which_ranks_that_raised_keep_their_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a rank whose function raised may run again in its process: on NCCL (its abort
    releases the peers) yes, unless the error may have left the device unusable; on gloo
    only when the whole world is under its launcher (every rank shuts down the connections
    it accepted), not with ranks on other nodes (only its exit closes every pair there)."""
    import torch

    from ftrun.rank.resilient import _keeps_process, _world_is_local, peer_lost

    assert _keeps_process("nccl", ValueError("bad batch"))
    assert not _keeps_process("gloo", ValueError("bad batch"))
    assert not _keeps_process(None, ValueError("bad batch"))
    assert _keeps_process("gloo", ValueError("bad batch"), world_local=True)
    assert _keeps_process(None, ValueError("bad batch"), world_local=True)
    assert not _keeps_process("gloo", MemoryError(), world_local=True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert _world_is_local()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not _world_is_local()
    monkeypatch.delenv("WORLD_SIZE")
    assert not _world_is_local()
    # A store that cannot listen on MASTER_PORT is this rank's failure, not a lost peer.
    assert not peer_lost(torch.distributed.DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 33327, "
        "code: -98, name: EADDRINUSE, message: address already in use"))
    assert peer_lost(torch.distributed.DistNetworkError("Connection reset by peer"))
    assert peer_lost(RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:4242"))
    assert not _keeps_process("nccl", RuntimeError("CUDA error: an illegal memory access"))
    assert not _keeps_process("nccl", torch.cuda.OutOfMemoryError("CUDA out of memory"))
    try:
        try:
            raise RuntimeError("device-side assert triggered")
        except RuntimeError as inner:
            raise ValueError("in the loss") from inner
    except ValueError as e:
        assert not _keeps_process("nccl", e)  # the cause counts
