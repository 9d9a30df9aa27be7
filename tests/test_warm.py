"""Warm workers (ftrun.launcher.warm): ranks started from interpreters that imported torch
ahead of time.

- A rank SIGKILLed mid-training (examples/user_ddp.py, three ranks, in-process restart) gets
  its new process from a warm interpreter started before the fault, and the run ends with
  weights bit-identical to a fault-free run with every worker started cold
  (``--no-warm-workers``); no interpreter outlives the launcher.
- A process restart of every worker starts them warm too, and a SIGKILLed launcher leaves
  none of its processes behind: warm interpreters, ranks that were warm, the store.
- A warm start runs a script exactly as a cold one: argv, ``__file__``, ``sys.path[0]``,
  ``__main__``'s names, environment, hash seed, session, signal dispositions, open
  descriptors, output, traceback and exit code (``SystemExit(3)``, an uncaught exception,
  ``KeyboardInterrupt``), in script and ``-m`` mode.
- ``import torch`` reads none of the variables a warm interpreter is started without.
- A rank notes the torch modules its first step imported; a waiting interpreter imports them
  (torch's only), and stops when its request arrives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, Procs, free_port, pid_alive, read_events, wait_for

from ftrun.launcher.warm import PER_START, PER_START_PREFIX, WarmPool
from ftrun.testing import cmdline, pids_with_token, tree_pids

SCRIPT = str(ROOT / "examples" / "user_ddp.py")
# 192 samples / 3 ranks / batch 8 = 8 steps per epoch, 2 epochs.
ARGS = ("--epochs", "2", "--samples", "192", "--batch-size", "8", "--hidden", "64")
TOKEN = "WARM_TEST_TOKEN"  # every process of the job has it (an FTRUN_* one warm ones lack)


def launcher_args(run_id: str, nproc: int, max_restarts: int, *extra: str) -> list[str]:
    return ["--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
            "--max-restarts", str(max_restarts), *extra]


def token_env(tmp: Path) -> tuple[dict[str, str], bytes]:
    value = uuid.uuid4().hex
    return ({"FTRUN_STATE_DIR": str(tmp / "state"), TOKEN: value},
            f"{TOKEN}={value}".encode())


def no_process_left(token: bytes) -> None:
    wait_for(lambda: not [p for p in pids_with_token(token) if pid_alive(p)], 30,
             "every process of the job (ranks, warm interpreters, store) to be gone")


# -- a dead rank replaced from a warm interpreter ------------------------------------------------


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
def test_a_killed_rank_is_replaced_warm_and_the_weights_stay_bit_identical(
        procs: Procs, tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir()
    run_dir.mkdir()
    env, token = token_env(ref_dir)
    ref_id = f"warm-ref-{uuid.uuid4().hex[:8]}"
    p = procs.ftrun(*launcher_args(ref_id, 3, 0, "--no-warm-workers"), SCRIPT, *ARGS,
                    env=env, name="reference")
    assert procs.wait(p, 240) == 0, procs.output(p)[-6000:]
    reference = re.findall(r"params_xxh3=([0-9a-f]+)", procs.output(p))
    assert len(reference) == 1, procs.output(p)[-6000:]
    events = read_events(ref_dir / "state", ref_id)
    assert not [e for e in events if e["type"].startswith(("warm_", "worker_warm"))], events
    no_process_left(token)

    env, token = token_env(run_dir)
    run_id = f"warm-{uuid.uuid4().hex[:8]}"
    p = procs.ftrun(*launcher_args(run_id, 3, 2, "--warm-workers"), SCRIPT, *ARGS, "--fault-dir", str(run_dir),
                    "--pid-log", str(run_dir), "--fail-mode", "kill", "--kill-at-step", "5",
                    "--kill-rank", "1", env=env, name="faulted")
    assert procs.wait(p, 240) == 0, procs.output(p)[-6000:]
    out = procs.output(p)
    assert (run_dir / "user-ddp-fault-rank1-step5").exists(), "the fault never fired"
    assert re.findall(r"params_xxh3=([0-9a-f]+)", out) == reference

    events = read_events(run_dir / "state", run_id)
    spawned = [e["pid"] for e in events if e["type"] == "warm_spawned"]
    warm_starts = [e for e in events if e["type"] == "worker_warm_start"]
    recoveries = [e for e in events if e["type"] == "recovery"]
    assert [(r["how"], r["new_processes"]) for r in recoveries] == [("in_process", [1])], \
        recoveries
    pids = [int(line.split()[1])
            for line in (run_dir / "pids-rank1.log").read_text().splitlines()]
    first, replacement = dict.fromkeys(pids)  # rank 1's two processes, in order
    # Both of rank 1's processes, the first start's and the replacement, were pre-started
    # interpreters, and the replacement was started before the fault.
    assert {first, replacement} <= set(spawned), (pids, spawned)
    assert [(e["local_rank"], e["pid"]) for e in warm_starts][3:] == [(1, replacement)], \
        warm_starts
    assert sorted(e["local_rank"] for e in warm_starts[:3]) == [0, 1, 2], warm_starts
    fault = next(e for e in events if e["type"] == "worker_failure")
    spawn_of = {e["pid"]: e["seq"] for e in events if e["type"] == "warm_spawned"}
    assert spawn_of[replacement] < fault["seq"], events
    assert f"local rank 1 runs in warm interpreter {replacement} (ready" in out, out[-6000:]
    assert not [e for e in events if e["type"] == "worker_cold_start"], events
    # The ranks noted the torch modules their first step imported (DDP's constructor
    # imports torch._dynamo) for the waiting interpreters.
    learned = (run_dir / "state" / "jobs" / run_id / "warm-imports.txt").read_text().split()
    assert "torch._dynamo" in learned and all(n.startswith("torch") for n in learned), learned
    # The launcher killed and reaped the interpreters it did not hand out.
    no_process_left(token)
    assert not [pid for pid in spawned if pid_alive(pid)]


LEARN = """import socket, sys
from ftrun.launcher import warm_boot
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
if sys.argv[2] == "wanted":
    ours.send(b"{}")  # a request is waiting already: the rank is wanted now
warm_boot._import_learned(sys.argv[1], theirs)
print(sorted(n for n in ("torch.distributed.checkpoint", "json.tool") if n in sys.modules))
"""


@pytest.mark.parametrize("request_waiting", [False, True])
def test_a_waiting_interpreter_imports_the_learned_torch_modules(
        tmp_path: Path, request_waiting: bool) -> None:
    """warm_boot imports the torch modules the job's ranks noted (not others, not unknown
    ones), and stops as soon as a request waits (the rank imports the rest itself)."""
    learned = tmp_path / "warm-imports.txt"
    learned.write_text("json.tool\ntorch.no_such_module\ntorch.distributed.checkpoint\n")
    out = subprocess.run([sys.executable, "-c", LEARN, str(learned),
                          "wanted" if request_waiting else "idle"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("[]" if request_waiting
                                  else "['torch.distributed.checkpoint']"), out.stdout


NOTE = """import os, sys
import torch.distributed.checkpoint  # noqa: F401
from ftrun.rank import progress
progress.note_imports()
progress.note_imports()  # once per process, and the first writer wins
"""


def test_a_rank_notes_the_torch_modules_it_imported(tmp_path: Path) -> None:
    env = {**os.environ, "FTRUN_JOB_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", NOTE], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    names = (tmp_path / "warm-imports.txt").read_text().split()
    assert "torch" in names and "torch.distributed.checkpoint" in names, names
    assert all(n == "torch" or n.startswith("torch.") for n in names), names
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "warm-imports.txt").write_text("torch\n")  # another rank's, first
    out = subprocess.run([sys.executable, "-c", NOTE], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "warm-imports.txt").read_text() == "torch\n"


# -- a process restart, and a launcher SIGKILLed --------------------------------------------------

RESTARTING = """\
import os, sys, time
import torch  # noqa: F401
restart, local_rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["LOCAL_RANK"]
if restart == "0" and local_rank == "1":
    sys.exit(1)  # the first attempt fails: every worker is restarted as a new process
open(os.path.join(sys.argv[1], f"up-{restart}-{local_rank}-{os.getpid()}"), "w").close()
time.sleep(120)  # until the test kills the launcher
"""


@pytest.mark.integration
def test_a_process_restart_starts_warm_and_a_killed_launcher_leaves_nothing(
        procs: Procs, tmp_path: Path) -> None:
    script = tmp_path / "restarting.py"
    script.write_text(RESTARTING)
    env, token = token_env(tmp_path)
    p = procs.ftrun(*launcher_args(f"warm-kill-{uuid.uuid4().hex[:8]}", 2, 1, "--warm-workers"),
                    str(script),
                    str(tmp_path), env=env, name="launcher")
    ups = wait_for(lambda: (lambda u: u if len(u) == 2 else None)(
        sorted(tmp_path.glob("up-1-*"))), 120, "both ranks up after the restart")
    # The launcher logs each hand-over after it (a rank may be up before its line is written).
    lines = [f"local rank {lr} runs in warm interpreter {pid} (ready"
             for lr, pid in (up.name.split("-")[2:] for up in ups)]
    out = wait_for(lambda: (lambda o: o if all(ln in o for ln in lines) else None)(
        procs.output(p)), 30, f"the launcher's lines {lines}")
    assert "starts cold" not in out, out
    # The launcher's pool has refilled: two idle interpreters besides the two ranks.
    warm = wait_for(lambda: (lambda w: w if len(w) == 4 else None)(
        [pid for pid in tree_pids(p.pid) if pid_alive(pid) and
         "ftrun/launcher/warm_boot.py" in " ".join(cmdline(pid))]), 60,
        "two idle warm interpreters beside the ranks")
    job = [pid for pid in pids_with_token(token) if pid_alive(pid)]
    assert set(warm) <= set(job)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    no_process_left(token)


# -- a warm start is a cold start ---------------------------------------------------------------

SHOW = """\
import json, os, signal, sys
import torch
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "path0": sys.path[0],
    "file": __file__, "name": __name__, "main": sorted(globals()),
    "loader": type(__loader__).__name__, "spec": getattr(__spec__, "name", None),
    "cwd": os.getcwd(),
    "env": dict(os.environ), "hash": hash("ftrun"), "flags": repr(sys.flags),
    "session": os.getsid(0) == os.getpid(), "pgrp": os.getpgrp() == os.getpid(),
    "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)},
    "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "fds": sorted(os.listdir("/proc/self/fd")), "threads": torch.get_num_threads(),
    "start_method": __import__("multiprocessing").get_start_method(allow_none=True),
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "interrupt":
    raise KeyboardInterrupt
sys.exit(int(how))
"""
CASES = [("script", "3"), ("script", "raise"), ("script", "interrupt"), ("module", "0")]


def _start_all(args_of, env: dict[str, str], logs: Path, tag: str) -> list:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        get_subprocess_handler,
    )

    handlers = []
    for i, (mode, how) in enumerate(CASES):
        (logs / tag).mkdir(parents=True, exist_ok=True)
        handlers.append(get_subprocess_handler(
            sys.executable, args_of(mode, how), {"RANK": str(i), "LOCAL_RANK": str(i)},
            str(logs / tag / f"{i}.out"), str(logs / tag / f"{i}.err"), i))
    return handlers


def test_a_warm_start_runs_the_script_exactly_as_a_cold_one(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "show.py").write_text(SHOW)
    monkeypatch.chdir(tmp_path)  # -m finds show.py in the working directory
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    monkeypatch.setenv("FTRUN_LAUNCHER_PID", str(os.getpid()))

    def args_of(mode: str, how: str) -> tuple[str, ...]:
        target = ("-m", "show") if mode == "module" else ("show.py",)
        return ("-m", "ftrun._exec", sys.executable, "-u", *target, how)

    env = dict(os.environ)
    pools = [WarmPool.for_workers(sys.executable, args_of(mode, "x"), env,
                                  sum(m == mode for m, _ in CASES)).start()
             for mode in ("script", "module")]
    handlers = []
    try:
        try:
            assert all(pool.wait_ready(120) for pool in pools)
            idle = {pid for pool in pools for pid in pool.idle_pids()}
            warm = _start_all(args_of, env, tmp_path, "warm")
            handlers += warm
            for h in warm:  # before close(): ranks die with the pool's thread
                h.proc.wait(120)
        finally:
            for pool in pools:
                pool.close()
        cold = _start_all(args_of, env, tmp_path, "cold")
        handlers += cold
        for h in cold:
            h.proc.wait(120)
    finally:
        for h in handlers:
            if h.proc.poll() is None:
                h.close(signal.SIGKILL)
                h.proc.wait(10)
    assert {h.proc.pid for h in warm} <= idle  # every warm case ran in a pre-started one
    assert not idle & {h.proc.pid for h in cold}
    codes = [(h.proc.returncode, c.proc.returncode) for h, c in zip(warm, cold, strict=True)]
    assert codes == [(3, 3), (1, 1), (-signal.SIGINT, -signal.SIGINT), (0, 0)]
    for i, (_mode, how) in enumerate(CASES):
        w_out, c_out = ((tmp_path / tag / f"{i}.out").read_text() for tag in ("warm", "cold"))
        w_err, c_err = ((tmp_path / tag / f"{i}.err").read_text() for tag in ("warm", "cold"))
        w, c = json.loads(w_out), json.loads(c_out)
        assert w == c, {k: (w[k], c[k]) for k in w if w[k] != c.get(k)}
        assert w["env"]["RANK"] == str(i) and w["argv"][-1] == how
        assert w_err == c_err
        assert w_err.startswith("to stderr\n")
        if how == "raise":
            assert 'show.py", line' in w_err and "ValueError: boom" in w_err, w_err
            assert "warm_boot" not in w_err and "<string>" not in w_err, w_err


# -- what import torch reads -----------------------------------------------------------------------

ENV_READS = """\
import os, sys
seen = set()
E = type(os.environ)
get, contains = E.__getitem__, E.__contains__
E.__getitem__ = lambda self, k: (seen.add(k), get(self, k))[1]
E.__contains__ = lambda self, k: (seen.add(k), contains(self, k))[1]
iterate = E.__iter__
def whole(self):  # who walks the whole environment: named, not failed here
    f = sys._getframe(1)
    while f.f_back is not None and f.f_globals.get("__name__") in (
            "_collections_abc", "collections.abc", "os"):
        f = f.f_back  # a mapping view's iteration: the caller is further up
    seen.add("ITERATED_BY:" + f.f_globals.get("__name__", "?"))
    return iterate(self)
E.__iter__ = whole
import torch
print("\\n".join(sorted(seen)))
"""
# Modules that walk the whole environment while torch imports, and why that is safe:
# tqdm (imported by torch.hub when installed) looks for TQDM_-prefixed overrides only.
ITERATE_OK = {"ITERATED_BY:tqdm.utils"}
GETENV_TRACE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
static void note(const char *n) {
    if (!n) return;
    int fd = open(LOG_PATH, O_WRONLY | O_APPEND | O_CREAT, 0600);
    if (fd < 0) return;
    write(fd, n, strlen(n)); write(fd, "\n", 1); close(fd); }
char *getenv(const char *n) {
    static char *(*real)(const char *); if (!real) real = dlsym(RTLD_NEXT, "getenv");
    note(n); return real(n); }
char *secure_getenv(const char *n) {
    static char *(*real)(const char *); if (!real) real = dlsym(RTLD_NEXT, "secure_getenv");
    note(n); return real(n); }
"""


def _per_start(names: set[str]) -> set[str]:
    return {n for n in names if n in PER_START or n.startswith(PER_START_PREFIX)}


def test_importing_torch_reads_no_variable_a_warm_interpreter_lacks(tmp_path: Path) -> None:
    """Warm interpreters import torch without the per-start variables (RANK, MASTER_PORT,
    FTRUN_*, ...): neither Python code nor the C libraries torch loads may read one then.
    Each trace must see what torch does read (OMP_NUM_THREADS, TORCH_LOGS), or it proves
    nothing."""
    # As a warm interpreter starts: without the per-start variables (which CI, for one, sets:
    # FTRUN_REQUIRE_*), so that a walk of the whole environment cannot read one either.
    env = {k: v for k, v in os.environ.items() if not _per_start({k})}
    py = subprocess.run([sys.executable, "-c", ENV_READS], capture_output=True, text=True,
                        timeout=120, check=True, env=env)
    python_reads = set(py.stdout.split())
    walkers = {r for r in python_reads if r.startswith("ITERATED_BY:")}
    assert walkers <= ITERATE_OK, f"a module walks os.environ while torch imports: {walkers}"
    python_reads -= walkers
    assert "TORCH_LOGS" in python_reads, python_reads
    assert not _per_start(python_reads), _per_start(python_reads)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler: the C-level getenv trace needs one (the Python-level "
                    "trace passed)")
    (tmp_path / "trace.c").write_text(GETENV_TRACE)
    lib = tmp_path / "trace.so"
    log = tmp_path / "getenv.log"
    subprocess.run([cc, "-shared", "-fPIC", f'-DLOG_PATH="{log}"', "-o", str(lib),
                    str(tmp_path / "trace.c"), "-ldl"], check=True, timeout=60)
    subprocess.run([sys.executable, "-c", "import torch"], timeout=120, check=True,
                   env={**env, "LD_PRELOAD": str(lib)})
    c_reads = set(log.read_text().split())
    assert "OMP_NUM_THREADS" in c_reads, sorted(c_reads)
    assert not _per_start(c_reads), _per_start(c_reads)
