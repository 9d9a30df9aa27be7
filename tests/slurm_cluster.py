"""Test helper: a real Slurm cluster on one host, from Debian's slurm-wlm and munge packages.

One munged, one slurmctld and one ``slurmd -N <node>`` per node, each on its own port; the
node names resolve to 127.0.0.1 through a marked line in /etc/hosts. Everything lives in one
directory (config, munge key, state, spool, logs), every daemon is a child of this process
(run in the foreground), and :meth:`SlurmCluster.stop` cancels the jobs, ends the daemons and
whatever the jobs left running, by PID, and removes the /etc/hosts line, also after a failure.

Needs root (slurmd starts job steps as their user) and the packages; :func:`unavailable`
says why a cluster cannot run here.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from conftest import free_port, wait_for

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue", "srun")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# ftrun-slurm-test"
# ftrun's launchers rendezvous on node 0's port 29500 under Slurm.
RDZV_PORT = 29500
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def which(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def unavailable() -> str | None:
    """Why a single-host Slurm cannot run here, or None when it can."""
    missing = [b for b in DAEMONS + CLIENTS if which(b) is None]
    if missing:
        return (f"Slurm/munge programs not found: {', '.join(missing)}; install them with "
                "`bash scripts/setup-slurm.sh` (apt-get install slurm-wlm munge, as root)")
    if os.geteuid() != 0:
        return "a single-host Slurm needs root (slurmd starts job steps as the job's user)"
    if not os.access(HOSTS_FILE, os.W_OK):
        return f"{HOSTS_FILE} is not writable; the test's node names resolve through it"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: TIME_WAIT is fine
        try:
            s.bind(("0.0.0.0", RDZV_PORT))
        except OSError as e:
            return (f"port {RDZV_PORT}, which ftrun's launchers use under Slurm, is taken here "
                    f"({e})")
    return None


@contextlib.contextmanager
def exclusive(timeout_s: float) -> Iterator[None]:
    """One single-host cluster at a time on this machine: they share /etc/hosts and a port.

    The lock is an advisory lock on /etc/hosts itself, so no lock file is left behind.
    """
    with open(HOSTS_FILE) as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"another single-host Slurm test held a lock on {HOSTS_FILE} for "
                        f"{timeout_s} s"
                    ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class SlurmCluster:
    """munged + slurmctld + ``nodes`` slurmds on this host, configured under ``root``."""

    def __init__(self, root: Path, nodes: int = 3, prefix: str = "ftrunci") -> None:
        self.root = root
        self.names = [f"{prefix}{i}" for i in range(1, nodes + 1)]
        self.nodelist = f"{prefix}[1-{nodes}]"
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.sock"
        self.daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.job_ids: list[int] = []
        self._hosts_added = False

    # -- environment for clients and jobs ----------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Slurm commands; sbatch passes it on to the job."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "FTRUN_", "PET_"))}
        # This interpreter's bin directory first: jobs run `ftrun` from it.
        path = os.pathsep.join([str(Path(sys.executable).parent), SEARCH_PATH])
        env.update(SLURM_CONF=str(self.conf), PATH=path, PYTHONUNBUFFERED="1",
                   TMPDIR=str(self.root / "tmp"))
        env.update(extra)
        return env

    def cmd(self, *argv: str, timeout_s: float = 30, check: bool = True,
            **kw: object) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(argv, env=kw.pop("env", None) or self.env(), text=True,
                              capture_output=True, timeout=timeout_s, **kw)  # type: ignore[call-overload]
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}{proc.stderr}\n{self.logs()}")
        return proc

    # -- start -------------------------------------------------------------------------------
    def start(self) -> None:
        for sub in ("munge", "ctld", "spool", "log", "tmp"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        self._add_hosts()
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn("munged", "-F", "--force", f"--socket={self.munge_socket}",
                    f"--key-file={key}", f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                    f"--log-file={self.root / 'log' / 'munged.log'}",
                    f"--seed-file={self.root / 'munge' / 'munged.seed'}")
        wait_for(self.munge_socket.exists, 20, "munged's socket")
        self._write_conf()
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        wait_for(lambda: self.cmd("scontrol", "ping", check=False).returncode == 0, 30,
                 f"slurmctld to answer\n{self.logs()}")
        for name in self.names:
            self._spawn("slurmd", "-D", "-N", name, "-f", str(self.conf))
        wait_for(self._all_idle, 60, f"{len(self.names)} idle nodes\n{self.logs()}", 0.5)

    def _spawn(self, program: str, *args: str) -> None:
        log = open(self.root / "log" / f"{program}-{len(self.daemons)}.out", "wb")  # noqa: SIM115
        with log:
            proc = subprocess.Popen([which(program) or program, *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env(),
                                    start_new_session=True)
        self.daemons.append((program, proc))

    def _write_conf(self) -> None:
        r = self.root
        ctld_port = free_port()
        node_lines = "\n".join(
            f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={free_port()} "
            f"CPUs={os.cpu_count() or 1} State=UNKNOWN"
            for name in self.names
        )
        # Plugins that need no cgroups, no accounting and no PMI: they work in a container.
        # cred_expire is also how long a requeued job waits before it may start again, and
        # sched_interval how often the scheduler looks at it again (60 s by default).
        self.conf.write_text(f"""\
ClusterName=ftrunci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r / 'ctld'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'ctld' / 'slurmctld.pid'}
SlurmdPidFile={r / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
KillWait=30
MinJobAge=600
{node_lines}
PartitionName=ci Nodes={self.nodelist} Default=YES MaxTime=INFINITE State=UP
""")

    def _all_idle(self) -> bool:
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return all(states.get(name) == "idle" for name in self.names)

    def _add_hosts(self) -> None:
        self._remove_hosts()  # a line left by a run that was killed
        with open(HOSTS_FILE, "a") as f:
            f.write(f"127.0.0.1 {' '.join(self.names)} {HOSTS_MARK}\n")
        self._hosts_added = True

    @staticmethod
    def _remove_hosts() -> None:
        text = HOSTS_FILE.read_text()
        kept = [ln for ln in text.splitlines(keepends=True) if not ln.rstrip().endswith(HOSTS_MARK)]
        if "".join(kept) != text:
            # In place: /etc/hosts is often a bind mount that a rename would not update.
            with open(HOSTS_FILE, "w") as f:
                f.write("".join(kept))

    # -- jobs --------------------------------------------------------------------------------
    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (),
               cwd: Path, env: dict[str, str]) -> int:
        out = self.cmd("sbatch", "--parsable", *options, str(script), *args, cwd=cwd,
                       env=env).stdout
        job_id = int(out.strip().split(";")[0])
        self.job_ids.append(job_id)
        return job_id

    def job(self, job_id: int) -> dict[str, str]:
        """Fields of ``scontrol show job`` (JobState, Restarts, ExitCode, ...)."""
        line = self.cmd("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_done(self, job_id: int, timeout_s: float) -> dict[str, str]:
        """Wait until the job has ended for good; its fields then."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                 "BOOT_FAIL", "DEADLINE", "PREEMPTED")
        fields: dict[str, str] = {}

        def done() -> bool:
            fields.update(self.job(job_id))
            return fields.get("JobState") in ended

        try:
            wait_for(done, timeout_s, f"job {job_id} to end", 0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}; last seen {fields.get('JobState')}\n{self.logs()}") from None
        return fields

    def logs(self, tail: int = 1500) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel the jobs, end every daemon and job process, undo /etc/hosts, remove the
        cluster's directory. Every step runs even when an earlier one failed; the failures
        are raised together at the end."""
        steps: list[tuple[str, Callable[[], None]]] = []
        if self.job_ids and self.daemons:
            steps.append(("cancelling the jobs", self.cancel_all))
        steps += [(f"stopping {program} (pid {proc.pid})", functools.partial(_end, proc))
                  for program, proc in reversed(self.daemons)]
        steps.append(("ending what the jobs left running", self._kill_job_leftovers))
        if self._hosts_added:
            steps.append((f"removing the test's line from {HOSTS_FILE}", self._remove_hosts))
        # Config, munge key, controller state, spool and logs (failures quote the logs).
        steps.append((f"removing {self.root}", lambda: shutil.rmtree(self.root)))
        errors = []
        for what, step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - reported below, after every step ran
                errors.append(f"{what}: {type(e).__name__}: {e}")
        if errors:
            raise AssertionError("stopping the Slurm cluster: " + "; ".join(errors))

    def cancel_all(self) -> None:
        """Cancel every job submitted here; wait until the queue is empty."""
        if not self.job_ids:
            return
        self.cmd("scancel", *map(str, self.job_ids), check=False)
        wait_for(lambda: not self.cmd("squeue", "-h", check=False).stdout.strip(), 60,
                 "cancelled jobs to leave the queue", 0.5)

    def _kill_job_leftovers(self) -> None:
        """Processes the jobs started that outlived slurmd (they carry our SLURM_CONF)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in env:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 15 s; reap. Raises when SIGTERM was not enough."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)
        raise AssertionError("ignored SIGTERM for 15 s; killed") from None


def launcher_pid_slurm_node(pid: int) -> int | None:
    """SLURM_NODEID of a running process, from its environment."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"SLURM_NODEID="):
            return int(item.split(b"=", 1)[1])
    return None
