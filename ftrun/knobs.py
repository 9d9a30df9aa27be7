"""Every environment variable ftrun reads or sets, in one table.

Precedence everywhere is: command-line flag > environment variable > default. Launcher flags
map onto the ``FTRUN_*`` names below (``--hang-timeout`` <-> ``FTRUN_HANG_TIMEOUT``); the
``worker`` variables are set by the launcher for the ``ftrun`` library inside each rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Knob:
    name: str
    type: str
    default: str
    meaning: str
    scope: str = "launcher"  # launcher | worker | any

    def get(self, environ: dict[str, str] | None = None) -> str:
        env = os.environ if environ is None else environ
        return env.get(self.name, self.default)

    def enabled(self, environ: dict[str, str] | None = None) -> bool:
        """A ``bool`` knob's value: 1/true/yes/on (any case) is True."""
        return self.get(environ).strip().lower() in ("1", "true", "yes", "on")


def whole_number(text: str) -> int | None:
    """``text`` as a whole number >= 0; None when it is not one (the caller says why)."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 0 else None


STATE_DIR = Knob(
    "FTRUN_STATE_DIR", "path", "~/.ftrun",
    "Where job files (endpoint, secret, event log) live; `ftrun status` looks here.", "any",
)
SECRET = Knob(
    "FTRUN_SECRET", "str", "",
    "The job secret that authenticates control-plane messages. Unset: read or create "
    "<state dir>/jobs/<run id>/secret (mode 0600).", "any",
)
COORDINATOR = Knob(
    "FTRUN_COORDINATOR", "HOST:PORT", "",
    "Endpoint of the job's coordinator. Launchers find it through the rendezvous store when "
    "unset; set for the ranks by the launcher.", "any",
)
HEARTBEAT_INTERVAL = Knob(
    "FTRUN_HEARTBEAT_INTERVAL", "seconds", "1.0",
    "How often each launcher reports to the coordinator.",
)
NODE_TIMEOUT = Knob(
    "FTRUN_NODE_TIMEOUT", "seconds", "10.0",
    "A node silent for this long is reported lost by the coordinator.",
)
AGGREGATE_GROUP = Knob(
    "FTRUN_AGGREGATE_GROUP", "int", "16",
    "Launchers per aggregation group, read where the coordinator runs: one launcher of each "
    "group sends its group's heartbeats to the coordinator in one message per interval, so "
    "the coordinator's work grows with the groups, not the nodes. Starts above this many "
    "nodes; 0 or 1: every launcher reports directly.",
)
HANG_TIMEOUT = Knob(
    "FTRUN_HANG_TIMEOUT", "seconds", "0",
    "Kill a rank (and so restart the workers) when it reported progress before and then none "
    "for this long, or sat stopped (SIGSTOP) for a third of it (at least 1 s). 0 turns the "
    "progress check off; stopped ranks are then killed after 10 s.",
)
BUSY_HANG_TIMEOUT = Knob(
    "FTRUN_BUSY_HANG_TIMEOUT", "seconds", "60",
    "How long the ranks of a group may wait in a collective for a rank that is alive and in "
    "no collective (saving, evaluating, or spinning in Python) before the coordinator names "
    "it hung. Stopped, dead or silent ranks, and ranks stuck in another collective, are named "
    "after 3 s.",
)
ON_HANG = Knob(
    "FTRUN_ON_HANG", "warn|restart|isolate", "restart",
    "What the coordinator does when its collective analysis names a hung rank: warn (log and "
    "record it), restart (kill the culprit ranks; every node restarts from the snapshot) or "
    "isolate (also exclude the culprit's host: its launcher exits with code 8).",
)
ON_SLOW = Knob(
    "FTRUN_ON_SLOW", "warn|isolate", "warn",
    "What the coordinator does when its analysis names a slow rank, host or link: warn, or "
    "isolate the host (its launcher exits with code 8; the others restart without it).",
)
ON_CORRUPTION = Knob(
    "FTRUN_ON_CORRUPTION", "warn|restart|isolate", "restart",
    "What the coordinator does when the replicas of a snapshot step disagree (silent data "
    "corruption: ftrun.coordinator.corruption): warn (record it; the step is never restored), "
    "restart (kill the diverging ranks; the job resumes from the newest step the replicas "
    "agreed on; a host named again is isolated) or isolate (exclude the diverging host now).",
)
ISOLATE_HOOK = Knob(
    "FTRUN_ISOLATE_HOOK", "command", "",
    "Shell command the coordinator runs with an isolated host's name as its argument (for "
    "example a Slurm drain). Unset: none.",
)
LOG_LEVEL = Knob(
    "FTRUN_LOG_LEVEL", "str", "INFO", "Log level of ftrun's own logger.", "any",
)
# Set by the launcher for the ranks.
RUN_ID = Knob("FTRUN_RUN_ID", "str", "", "The job's run id (equals TORCHELASTIC_RUN_ID).", "worker")
JOB_DIR = Knob(
    "FTRUN_JOB_DIR", "path", "", "Per-job directory on this host, private to the user.", "worker",
)
NODE_ID = Knob("FTRUN_NODE_ID", "str", "", "Identity of this rank's launcher (host/pid).", "worker")
PROGRESS_FILE = Knob(
    "FTRUN_PROGRESS_FILE", "path", "",
    "Per-rank file through which `ftrun.progress()` tells the launcher the rank is alive.",
    "worker",
)

ALL: tuple[Knob, ...]  # filled in at the end of the module


def state_dir(override: str | None = None) -> Path:
    """The state directory: flag > FTRUN_STATE_DIR > ~/.ftrun."""
    return Path(os.path.expanduser(override or STATE_DIR.get())).resolve()

# Snapshots (launcher flags map onto these; the launcher passes them on to ranks and store).
PERSIST_DIR = Knob(
    "FTRUN_PERSIST_DIR", "path", "",
    "Where the snapshot stores write committed steps to disk (torch.distributed.checkpoint "
    "format; every node writes the same steps, chosen by the coordinator); restore falls back "
    "to it, newest complete and verified step first, when memory holds nothing usable.", "any",
)
PERSIST_EVERY = Knob(
    "FTRUN_PERSIST_EVERY", "steps", "0", "Persist the committed step each time committed "
    "steps pass a multiple of N (N=100: steps 100, 200, ..., or the first step committed "
    "after one that was not) (0: only on SIGTERM/SIGUSR1, at the end, and per "
    "--persist-interval).",
)
PERSIST_INTERVAL = Knob(
    "FTRUN_PERSIST_INTERVAL", "seconds", "0", "Also persist when this long has passed since the "
    "last write (0: off).",
)
PERSIST_KEEP = Knob(
    "FTRUN_PERSIST_KEEP", "count", "3",
    "Complete persisted steps to keep (partial ones older than the newest complete are removed).",
)
START_FRESH = Knob(
    "FTRUN_START_FRESH", "bool", "0",
    "1: when the persist dir holds steps but none can be restored (all partial or corrupt), "
    "or a restart finds nothing after the job had a durable step (a committed one with "
    "--replicas 1), start from step 0 anyway instead of stopping with an error. An empty or "
    "missing persist dir always starts fresh.", "any",
)
SNAPSHOT_EVERY = Knob(
    "FTRUN_SNAPSHOT_EVERY", "steps|auto", "1",
    "Snapshot every K-th step; auto: as often as keeps the measured slowdown at or below 3%, "
    "and no more often than the job's failure rate makes worth it (Young's interval, at most "
    "60 s of training apart; FTRUN_GPU_MTBF_HOURS); the ranks agree on the interval every 32 "
    "steps. Snapshotter(every=...) overrides it.",
    "any",
)
GPU_MTBF_HOURS = Knob(
    "FTRUN_GPU_MTBF_HOURS", "hours", "50700",
    "Under --snapshot-every auto: the expected hours between unexpected interruptions per "
    "rank (GPU) of your fleet; the job's is this divided by its world size. The default is "
    "Llama 3's published rate (419 in 54 days on 16,384 GPUs). 0: ignore the failure rate "
    "(the 3% cost target alone).", "any",
)
SNAPSHOT_WAIT = Knob(
    "FTRUN_SNAPSHOT_WAIT", "seconds", "0",
    "How long optimizer.step() may wait for the store to release a snapshot buffer (the "
    "previous snapshot is not committed yet) before that snapshot is skipped. 0: never; a "
    "buffer not released by the next optimizer.step() costs that snapshot, not time.", "any",
)
STORE_THREADS = Knob(
    "FTRUN_STORE_THREADS", "count", "0",
    "Threads each node's snapshot store uses to verify chunks (xxh3 runs without the GIL); "
    "0: one per 8 CPUs, at least 2 and at most 8.",
)
REPLICAS = Knob(
    "FTRUN_REPLICAS", "count", "2",
    "Copies of every committed snapshot shard kept in memory across the job: the node's own "
    "and m-1 replicas in peer nodes' stores (Gemini's group placement). 1: no replication; "
    "a job with no peer node (one node) replicates nothing and says so.",
)
REDUNDANCY = Knob(
    "FTRUN_REDUNDANCY", "scheme", "",
    "How committed snapshots survive a lost node: replicas:M (M copies of every shard in "
    "memory across the job, as FTRUN_REPLICAS) or ec:K+M (erasure coding: groups of at least "
    "K+M nodes, M parity fragments per stripe of K nodes' data, (1 + M/K)x the state in host "
    "memory, any M lost nodes of a group rebuilt). Unset: replicas:FTRUN_REPLICAS.",
)
REPLICA_ADDR = Knob(
    "FTRUN_REPLICA_ADDR", "host", "",
    "Address (interface) each node's store takes replicas on. Unset: this node's address "
    "toward the rendezvous endpoint (the endpoint's host on the node that hosts it).",
)
BIND_HOST = Knob(
    "FTRUN_BIND_HOST", "host", "",
    "Address the job-wide services a launcher hosts listen on: the c10d rendezvous store "
    "(when it hosts it) and the coordinator (when it runs it). Unset: the store on every "
    "interface, as torchrun; the coordinator on the address the rendezvous host resolves to.",
)
REPLICA_RATE = Knob(
    "FTRUN_REPLICA_RATE", "MB/s", "0",
    "Cap on the rate each node's store sends replicas at (0: no cap).",
)
STORE = Knob(
    "FTRUN_STORE", "endpoint", "", "The node's snapshot store (ipc) for the ranks.", "worker",
)
LAUNCHER_PID = Knob(
    "FTRUN_LAUNCHER_PID", "int", "", "PID of the rank's launcher: workers and the store die "
    "with it (parent-death signal) and snapshot segments record it as their owner.", "worker",
)
SHM_DIR = Knob(
    "FTRUN_SHM_DIR", "path", "/dev/shm",
    "Where snapshot segments live (a tmpfs). Every process of a job on a host must agree.", "any",
)
DETECT = Knob(
    "FTRUN_DETECT", "HOST:PORT", "",
    "Where each rank's collective monitor reports: its launcher's relay, which passes the "
    "reports on to the coordinator's detection endpoint (set for the ranks by the launcher; "
    "empty: no monitor).", "worker",
)
COLL_SUMMARY_RANKS = Knob(
    "FTRUN_COLL_SUMMARY_RANKS", "int", "1024",
    "From this world size on, a launcher sends the coordinator a summary of its ranks' "
    "collective reports every 0.25 s (through its aggregation group's aggregator, which "
    "merges its group's) instead of every report: the hang analysis at scale. Smaller jobs "
    "send every report (slow ranks and slow links are found from them too). 0: always "
    "summarise.",
)
COLL_INTERVAL = Knob(
    "FTRUN_COLL_INTERVAL", "seconds", "0.02",
    "How often each rank's collective monitor reads torch's Flight Recorder counts (the "
    "resolution of every collective duration it reports) while collectives keep ranks "
    "waiting 50 ms or more; five times less often otherwise.", "worker",
)

RANK_CONTROL = Knob(
    "FTRUN_RANK_CONTROL", "path", "",
    "Set by a launcher that restarts ranks in place: the base path of this rank's control "
    "socket (<path>.sock) and state file (<path>.json) for @ftrun.resilient. Unset: the "
    "resilient wrapper calls the training function once.", "worker",
)
RANK_GENERATION = Knob(
    "FTRUN_RANK_GENERATION", "integer", "0",
    "Set by a launcher that restarts ranks in place: the generation of the world a new "
    "process joins (how many restarts in place the launcher ran before it started).",
    "worker",
)
INPLACE_TIMEOUT = Knob(
    "FTRUN_INPLACE_TIMEOUT", "seconds", "5",
    "In-process restart for @ftrun.resilient scripts (0 turns it off: every restart starts "
    "new processes). How long a launcher waits for a failed rank's process to exit, for the "
    "surviving ranks to leave the training function after rank_abort and to start it again "
    "after rank_world. A rank that does not exit or leave in time (blocked inside a C call) "
    "is killed and gets a new process; one that does not start again falls back to a "
    "process restart of every local rank.",
)
PUSHED_WORLD = Knob(
    "FTRUN_PUSHED_WORLD", "bool", "1",
    "1 (the default): a restart in place that keeps the membership (a rank failed; no node "
    "lost, none waiting; c10d rendezvous) re-forms the world from votes in the round's store "
    "instead of a new rendezvous round: every node keeps its ranks, the master gets a new "
    "port. Any node that cannot (or a vote missing after FTRUN_INPLACE_TIMEOUT) sends every "
    "node through torch's rendezvous, as with 0.",
)
INPLACE_WAIT = Knob(
    "FTRUN_INPLACE_WAIT", "seconds", "1800",
    "How long a rank that left its training function because a peer failed (or on its "
    "launcher's abort) waits for its launcher's decision (run again, or exit) before it "
    "exits with an error.", "worker",
)
WARM_WORKERS = Knob(
    "FTRUN_WARM_WORKERS", "bool|auto", "auto",
    "1: keep one interpreter per local rank started ahead, with torch imported (no CUDA "
    "context, no process group): a worker start (a dead rank replaced, a restart) takes one "
    "instead of starting Python and importing torch. A start whose environment or command "
    "differs from the interpreters' starts cold, logged. 0: every worker starts cold. auto "
    "(the default): on where the launcher has at least 4 usable CPUs per local rank (the "
    "interpreters' imports then do not compete with the ranks'), off otherwise, logged.",
)
PARKED_WORKERS = Knob(
    "FTRUN_PARKED_WORKERS", "bool", "0",
    "1: each warm interpreter also runs the script up to its ``@ftrun.resilient`` function "
    "(module-level code, imports, argument parsing) and waits there for a rank; a dead rank's "
    "replacement then starts where a survivor restarts. Implies warm workers. The code before "
    "the decorated call runs without a rank identity: reading RANK, LOCAL_RANK, WORLD_SIZE, "
    "MASTER_ADDR, ... there ends that interpreter (logged) and turns parking off for the job; "
    "it must have no side effects a second run would repeat (it runs once per interpreter).",
)
WARM_IMPORTS = Knob(
    "FTRUN_WARM_IMPORTS", "MOD,MOD", "",
    "Modules the warm interpreters import besides torch (comma-separated), e.g. the "
    "script's heavy libraries. Only modules without import-time side effects that depend on "
    "the rank (RANK, LOCAL_RANK, ... are not set yet) or on the working directory.",
)
ALL = tuple(v for v in list(globals().values()) if isinstance(v, Knob))
