"""Launcher flags: torchrun's own parser, plus ftrun's options.

The parser *is* ``torch.distributed.run.get_args_parser()`` with one extra argument group, so
every torchrun flag keeps its spellings, defaults, ``PET_*`` environment variables and error
messages. ftrun's flags are checked at import time never to collide with torchrun's, and each
also reads an ``FTRUN_*`` variable (flag > environment > default).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from ftrun import knobs
from ftrun.coordinator.placement import Redundancy, parse_redundancy
from ftrun.errors import ConfigError
from ftrun.snapshot.api import PersistConfig

FTRUN_EPILOG = """\
ftrun subcommands: `ftrun status [RUN_ID]` shows a job, `ftrun inspect (RUN_ID | PATH)` shows
its snapshots or a persisted checkpoint, `ftrun coordinator` runs a job's coordinator and
rendezvous store on a host of your choice, `ftrun completions SHELL` prints shell completions.
Each takes --help.
"""


# What the coordinator may do about a hung rank, and about a slow rank, host or link.
ON_HANG_CHOICES = ("warn", "restart", "isolate")
ON_SLOW_CHOICES = ("warn", "isolate")
ON_CORRUPTION_CHOICES = ("warn", "restart", "isolate")


@dataclass(frozen=True)
class FtrunOptions:
    """ftrun's own launcher options, validated."""

    state_dir: str | None
    coordinator: str | None
    hang_timeout_s: float
    heartbeat_interval_s: float
    node_timeout_s: float
    persist: PersistConfig = PersistConfig()
    start_fresh: bool = False
    snapshot_every: str = "1"
    snapshot_wait_s: float = 0.0
    store_threads: int = 0
    replicas: int = 2
    redundancy: str | None = None  # replicas:M or ec:K+M; None: replicas:<replicas>
    replica_addr: str | None = None
    bind_host: str | None = None
    replica_rate_mb_s: float = 0.0
    on_hang: str = "restart"
    on_slow: str = "warn"
    on_corruption: str = "restart"
    isolate_hook: str | None = None
    busy_hang_s: float = 60.0
    warm_workers: bool | None = None  # None: auto (ftrun.launcher.warm.auto_warm)
    warm_imports: tuple[str, ...] = ()

    def plan(self) -> Redundancy:
        """The redundancy in force: --redundancy, else replicas:<--replicas>."""
        if self.redundancy is None:
            return Redundancy("replicas", copies=self.replicas)
        return parse_redundancy(self.redundancy)

    def __post_init__(self) -> None:
        every = self.snapshot_every.strip().lower()
        if every != "auto" and not (every.isdigit() and int(every) >= 1):
            raise ConfigError(
                f"--snapshot-every must be a number of steps >= 1 or 'auto', got "
                f"{self.snapshot_every!r}"
            )
        if not (self.snapshot_wait_s >= 0 and math.isfinite(self.snapshot_wait_s)):
            raise ConfigError(
                f"--snapshot-wait must be a number of seconds >= 0 (0: never wait), got "
                f"{self.snapshot_wait_s}"
            )
        if self.hang_timeout_s < 0:
            raise ConfigError(
                f"--hang-timeout must be >= 0 seconds (0 turns it off), got {self.hang_timeout_s}"
            )
        if not (self.busy_hang_s > 0 and math.isfinite(self.busy_hang_s)):
            raise ConfigError(
                f"--busy-hang-timeout must be a number of seconds > 0, got {self.busy_hang_s}"
            )
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(
                f"--heartbeat-interval must be > 0 seconds, got {self.heartbeat_interval_s}"
            )
        if self.node_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"--node-timeout ({self.node_timeout_s} s) must exceed --heartbeat-interval "
                f"({self.heartbeat_interval_s} s), or every node looks lost"
            )
        if self.store_threads < 0:
            raise ConfigError(
                f"--store-threads must be >= 0 (0: the default for this host), got "
                f"{self.store_threads}"
            )
        if self.replicas < 1:
            raise ConfigError(
                f"--replicas must be >= 1 copies of every shard (1: no replication, 2: one "
                f"replica on a peer node), got {self.replicas}"
            )
        self.plan()  # refuses a --redundancy that cannot be read
        if not (self.replica_rate_mb_s >= 0 and math.isfinite(self.replica_rate_mb_s)):
            raise ConfigError(
                f"--replica-rate must be MB/s >= 0 (0: no cap), got {self.replica_rate_mb_s}"
            )
        if self.on_hang not in ON_HANG_CHOICES:
            raise ConfigError(
                f"--on-hang must be one of {', '.join(ON_HANG_CHOICES)}, got {self.on_hang!r}"
            )
        if self.on_slow not in ON_SLOW_CHOICES:
            raise ConfigError(
                f"--on-slow must be one of {', '.join(ON_SLOW_CHOICES)}, got {self.on_slow!r}"
            )
        if self.on_corruption not in ON_CORRUPTION_CHOICES:
            raise ConfigError(
                f"--on-corruption must be one of {', '.join(ON_CORRUPTION_CHOICES)}, got "
                f"{self.on_corruption!r}"
            )
        if self.isolate_hook is not None and not self.isolate_hook.strip():
            raise ConfigError("--isolate-hook is empty; give a shell command, or leave it out")
        bad = [m for m in self.warm_imports
               if not all(part.isidentifier() for part in m.split("."))]
        if bad:
            raise ConfigError(
                f"--warm-imports takes module names separated by commas (e.g. numpy,"
                f"transformers), got {', '.join(map(repr, bad))}"
            )
        if self.coordinator is not None and ":" not in self.coordinator:
            raise ConfigError(
                f"--coordinator must be HOST:PORT, got {self.coordinator!r}"
            )


# (flag, knob, type, help). Flags are spelled with dashes; the underscore spelling is
# accepted too, as torchrun does.
_FTRUN_FLAGS: tuple[tuple[str, knobs.Knob, type, str], ...] = (
    ("--state-dir", knobs.STATE_DIR, str,
     "Directory for job files (secret, coordinator endpoint, event log)."),
    ("--coordinator", knobs.COORDINATOR, str,
     "HOST:PORT of a coordinator started with `ftrun coordinator`; by default the launcher "
     "that hosts the rendezvous store runs it."),
    ("--hang-timeout", knobs.HANG_TIMEOUT, float,
     "Seconds a rank may go without calling ftrun.progress() (after its first call), or sit "
     "stopped, before the launcher kills it and restarts the workers. 0 turns it off."),
    ("--busy-hang-timeout", knobs.BUSY_HANG_TIMEOUT, float,
     "Seconds the others may wait in a collective for a rank that is alive and in no "
     "collective (saving, evaluating, spinning) before the coordinator names it hung "
     "(default 60; stopped, dead or silent ranks are named after 3 s)."),
    ("--on-hang", knobs.ON_HANG, str,
     "What to do when the coordinator's collective analysis names a hung rank: warn, "
     "restart (kill it; every node restarts from the snapshot) or isolate (also exclude its "
     "host, whose launcher exits with code 8)."),
    ("--on-slow", knobs.ON_SLOW, str,
     "What to do when the analysis names a slow rank, host or link: warn, or isolate the "
     "host."),
    ("--on-corruption", knobs.ON_CORRUPTION, str,
     "What to do when data-parallel replicas hold different parameters at a snapshot (silent "
     "data corruption): warn, restart (kill the diverging ranks; the job resumes from the "
     "newest step the replicas agreed on; a host named twice is isolated) or isolate."),
    ("--isolate-hook", knobs.ISOLATE_HOOK, str,
     "Shell command the coordinator runs with an isolated host's name as its argument, e.g. "
     "to drain it in Slurm."),
    ("--heartbeat-interval", knobs.HEARTBEAT_INTERVAL, float,
     "Seconds between the launcher's reports to the coordinator."),
    ("--node-timeout", knobs.NODE_TIMEOUT, float,
     "Seconds of silence after which the coordinator reports a node lost."),
    ("--persist-dir", knobs.PERSIST_DIR, str,
     "Directory where the snapshot stores write committed steps (torch.distributed.checkpoint "
     "format; every node writes the same steps); restore falls back to it, newest complete "
     "and verified step first, when memory holds nothing usable."),
    ("--persist-every", knobs.PERSIST_EVERY, int,
     "Persist the committed step each time committed steps pass a multiple of N (N=100: "
     "steps 100, 200, ..., or the first step committed after one that was not) (0: only at "
     "the end, on SIGTERM/SIGUSR1, and per --persist-interval)."),
    ("--persist-interval", knobs.PERSIST_INTERVAL, float,
     "Also persist when this many seconds passed since the last write (0: off)."),
    ("--persist-keep", knobs.PERSIST_KEEP, int,
     "Complete persisted steps to keep; partial ones older than the newest complete step are "
     "removed."),
    ("--snapshot-every", knobs.SNAPSHOT_EVERY, str,
     "Snapshot every K-th step, or 'auto': as often as keeps the measured slowdown at or "
     "below 3%, and no more often than the job's failure rate makes worth it (at most 60 s "
     "apart; FTRUN_GPU_MTBF_HOURS). Snapshotter(every=...) in the script overrides it."),
    ("--snapshot-wait", knobs.SNAPSHOT_WAIT, float,
     "Seconds optimizer.step() may wait for the store to release a snapshot buffer (the "
     "previous snapshot not yet committed) before that snapshot is skipped; 0 (the default): "
     "never wait, skip it (counted in ftrun status)."),
    ("--store-threads", knobs.STORE_THREADS, int,
     "Threads each node's snapshot store uses to verify chunks (0: one per 8 CPUs, at least "
     "2, at most 8)."),
    ("--replicas", knobs.REPLICAS, int,
     "Copies of every committed snapshot shard in memory across the job: the node's own and "
     "m-1 replicas in peer nodes' stores, placed in disjoint groups of m (default 2; 1: no "
     "replication; a one-node job has no peer and replicates nothing)."),
    ("--redundancy", knobs.REDUNDANCY, str,
     "How committed snapshots survive a lost node: replicas:M (as --replicas M, its long "
     "form) or ec:K+M: erasure coding over groups of at least K+M nodes, each stripe of K "
     "nodes' data with M parity fragments built store to store, (1 + M/K)x the state in host "
     "memory instead of Mx; any M lost nodes of a group are rebuilt from the rest, verified. "
     "Needs at least K+M nodes (--nnodes). Default: replicas:<--replicas>."),
    ("--replica-addr", knobs.REPLICA_ADDR, str,
     "Address (interface) this node's store takes replicas on; default: this node's address "
     "toward the rendezvous endpoint."),
    ("--bind-host", knobs.BIND_HOST, str,
     "Address the job-wide services this launcher hosts listen on: the c10d rendezvous store "
     "(when it hosts it) and the coordinator (when it runs it); default: the store on every "
     "interface (as torchrun), the coordinator on the address the rendezvous host resolves "
     "to. Rank 0's process-group store listens on every interface whatever this says (torch "
     "gives its env:// initialisation no address to bind)."),
    ("--replica-rate", knobs.REPLICA_RATE, float,
     "Cap, in MB/s, on the rate this node's store sends replicas at (0: no cap)."),
    ("--start-fresh", knobs.START_FRESH, bool,
     "Start from step 0 when --persist-dir holds steps but none can be restored (all partial "
     "or corrupt), or when a restart finds nothing after the job had a durable step (a "
     "committed one with --replicas 1); without it such a job stops with an error that says "
     "what is missing."),
    ("--warm-workers", knobs.WARM_WORKERS, bool,
     "Keep one interpreter per local rank started ahead with torch imported, so that a "
     "replaced or restarted rank skips starting Python and importing torch; a start that "
     "differs from them (environment, command) starts cold, logged. By default on where the "
     "launcher has at least 4 usable CPUs per local rank (FTRUN_WARM_WORKERS=auto), off "
     "otherwise; --no-warm-workers: every worker starts cold."),
    ("--warm-imports", knobs.WARM_IMPORTS, str,
     "Modules the warm interpreters import besides torch, comma-separated (only modules "
     "whose import does not depend on the rank)."),
)

# Switches that take a --no- form too (on by default, or meant to be).
_NEGATABLE = frozenset({"--warm-workers"})


# Flags whose values come from a fixed set: argparse checks them on the command line and
# shell completion offers them (FtrunOptions checks the FTRUN_* value as well).
_CHOICES: dict[str, tuple[str, ...]] = {"--on-hang": ON_HANG_CHOICES, "--on-slow": ON_SLOW_CHOICES,
                                         "--on-corruption": ON_CORRUPTION_CHOICES}


def _max_nodes(nnodes: str | None) -> int | None:
    """The most nodes of torchrun's ``--nnodes`` (N or MIN:MAX); None when unreadable."""
    text = str(nnodes or "1").split(":")[-1].strip()
    return int(text) if text.isdigit() else None


def _tristate(knob: knobs.Knob) -> bool | None:
    """A negatable switch's variable (its default where unset): True, False, or None for
    ``auto``."""
    raw = knob.get().strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return knob.enabled()
    raise ConfigError(f"{knob.name} must be 1, 0 or auto, got {knob.get()!r}")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _spellings(flag: str) -> list[str]:
    """The dash spelling and, when it differs, the underscore one (as torchrun accepts)."""
    return list(dict.fromkeys([flag, "--" + _dest(flag)]))


def ftrun_flag_names() -> list[str]:
    return [s for flag, *_ in _FTRUN_FLAGS for s in _spellings(flag)]


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with ftrun's option group added."""
    from ftrun._torch import torchrun_parser

    parser = torchrun_parser()
    parser.prog = "ftrun"
    parser.description = (
        "ftrun: a fault-tolerant drop-in for torchrun. Every torchrun flag works as it does "
        "in torchrun; ftrun's own options are listed last."
    )
    parser.epilog = FTRUN_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    taken = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:
        if action.dest == "rdzv_backend":
            action.help = (
                "Rendezvous backend: c10d, static (torch's default) or etcd: ftrun's "
                "backend on etcd's v3 API (also named etcd-v3), with --rdzv-endpoint "
                "HOST:PORT[,HOST:PORT...] listing the etcd members; there the launchers elect "
                "the one that runs the coordinator. torch's etcd-v2 (v2 API) is not supported."
            )
    group = parser.add_argument_group("ftrun options (each also read from FTRUN_<NAME>)")
    for flag, knob, typ, help_text in _FTRUN_FLAGS:
        spellings = _spellings(flag)
        clash = taken.intersection(spellings)
        if clash:  # torch grew a flag of the same name: fail loudly, never shadow it
            raise ConfigError(f"ftrun flag {sorted(clash)} collides with a torchrun flag")
        if typ is bool and flag in _NEGATABLE:  # neither flag: the variable (ftrun_options)
            group.add_argument(*spellings, dest=_dest(flag),
                               action=argparse.BooleanOptionalAction, default=None,
                               help=f"{help_text} [env {knob.name}]".replace("%", "%%"))
            continue
        if typ is bool:  # a switch: no value on the command line
            group.add_argument(*spellings, dest=_dest(flag), action="store_true",
                               default=knob.enabled(),
                               help=f"{help_text} [env {knob.name}=1]".replace("%", "%%"))
            continue
        default = os.environ.get(knob.name) or None
        group.add_argument(
            *spellings, dest=_dest(flag), type=typ, default=default,
            # argparse expands %-formats in help texts: a literal % must be doubled.
            choices=_CHOICES.get(flag),
            help=f"{help_text} [env {knob.name}]".replace("%", "%%"),
        )
    return parser


def _redundancy(ns: argparse.Namespace) -> str | None:
    """--redundancy (or FTRUN_REDUNDANCY), checked against --replicas: a value that cannot
    be read, or one that contradicts an explicit --replicas, is refused with the fix (the
    node count is checked once Slurm's is known: :func:`check_redundancy`)."""
    raw = getattr(ns, "redundancy", None)
    if not raw or not str(raw).strip():
        return None
    plan = parse_redundancy(str(raw))
    replicas = getattr(ns, "replicas", None)
    if replicas is not None and str(replicas).strip():
        short = f"replicas:{replicas}"
        if str(plan) != short:
            raise ConfigError(f"--redundancy {raw} and --replicas {replicas} (or "
                              f"{knobs.REPLICAS.name}) disagree: give one of them")
    return str(plan)


def check_redundancy(opts: FtrunOptions, ns: argparse.Namespace) -> None:
    """Refuse an ``ec:K+M`` that the job's nodes (torchrun's ``--nnodes``, its most; under
    Slurm as set from the allocation) cannot hold."""
    nodes = _max_nodes(getattr(ns, "nnodes", None))
    if nodes is not None:
        opts.plan().check_nodes(nodes)


def ftrun_options(ns: argparse.Namespace) -> FtrunOptions:
    def num(dest: str, knob: knobs.Knob) -> float:
        raw = getattr(ns, dest)
        raw = knob.default if raw is None else raw
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{knob.name}/--{dest.replace('_', '-')} must be a number, got {raw!r}") from None

    return FtrunOptions(
        state_dir=ns.state_dir,
        coordinator=ns.coordinator or None,
        hang_timeout_s=num("hang_timeout", knobs.HANG_TIMEOUT),
        heartbeat_interval_s=num("heartbeat_interval", knobs.HEARTBEAT_INTERVAL),
        node_timeout_s=num("node_timeout", knobs.NODE_TIMEOUT),
        persist=PersistConfig(
            dir=ns.persist_dir or None,
            every=int(num("persist_every", knobs.PERSIST_EVERY)),
            interval_s=num("persist_interval", knobs.PERSIST_INTERVAL),
            keep=int(num("persist_keep", knobs.PERSIST_KEEP)),
        ),
        start_fresh=bool(ns.start_fresh),
        snapshot_every=str(ns.snapshot_every or knobs.SNAPSHOT_EVERY.default),
        snapshot_wait_s=num("snapshot_wait", knobs.SNAPSHOT_WAIT),
        store_threads=int(num("store_threads", knobs.STORE_THREADS)),
        replicas=int(num("replicas", knobs.REPLICAS)),
        redundancy=_redundancy(ns),
        replica_addr=ns.replica_addr or None,
        bind_host=ns.bind_host or None,
        replica_rate_mb_s=num("replica_rate", knobs.REPLICA_RATE),
        on_hang=str(ns.on_hang or knobs.ON_HANG.default).strip().lower(),
        on_slow=str(ns.on_slow or knobs.ON_SLOW.default).strip().lower(),
        on_corruption=str(ns.on_corruption or knobs.ON_CORRUPTION.default).strip().lower(),
        isolate_hook=ns.isolate_hook or None,
        busy_hang_s=num("busy_hang_timeout", knobs.BUSY_HANG_TIMEOUT),
        warm_workers=_tristate(knobs.WARM_WORKERS) if ns.warm_workers is None
        else ns.warm_workers,
        warm_imports=tuple(m.strip() for m in (ns.warm_imports or "").split(",") if m.strip()),
    )


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests the user set on the command line (before the script) or through PET_*."""
    actions = {s: a for a in parser._actions for s in a.option_strings}
    given: set[str] = set()
    tokens = iter(argv)
    for token in tokens:
        if not token.startswith("-"):
            break  # the training script: everything after it belongs to the script
        flag, has_value = token.split("=", 1)[0], "=" in token
        action = actions.get(flag)
        if action is None:
            continue
        given.add(action.dest)
        if action.nargs != 0 and not has_value:
            next(tokens, None)  # the flag's value
    for action in parser._actions:
        if os.environ.get(f"PET_{action.dest.upper()}") is not None:
            given.add(action.dest)
    return given
