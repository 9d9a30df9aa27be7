"""Slurm support: expand hostlists and derive launcher settings from ``SLURM_*`` variables.

Under Slurm, ``srun --ntasks-per-node=1 ftrun ...`` starts one launcher per node, and each
launcher can work out what torchrun would otherwise need on its command line: the number of
nodes, this node's rank, a rendezvous id shared by every node of the job, and a rendezvous
host (the first node of the step's nodelist). :func:`derive` reads those from the environment
and :func:`parse_hostlist` expands Slurm's compressed hostlists (``gpu[01-04,07]``) without
calling ``scontrol``, so it works on any node and in tests.

Nothing here touches the process environment: both functions are pure.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.errors import ConfigError

__all__ = ["MAX_HOSTS", "SlurmDerived", "derive", "parse_hostlist"]

# Upper bound on the number of hosts one hostlist may expand to; guards against a typo such as
# ``n[1-100000000]`` eating all memory.
MAX_HOSTS = 1_000_000

# Slurm's step ids for the batch script and the "extern" step (SLURM_BATCH_SCRIPT and
# SLURM_EXTERN_CONT in slurm.h); a process in one of them is not inside an srun step.
_NON_SRUN_STEP_IDS = frozenset({"4294967294", "4294967295", "batch", "extern"})

_DIGITS = re.compile(r"[0-9]+")
_LEADING_COUNT = re.compile(r"\s*([0-9]+)")


# --------------------------------------------------------------------------------------------
# Hostlists
# --------------------------------------------------------------------------------------------


def parse_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in the order written.

    Host expressions are separated by commas or whitespace outside brackets. Each may hold
    several bracket groups, expanded as a cartesian product with the leftmost group varying
    slowest (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2). A bracket holds comma-separated numbers
    and ascending ranges ``a-b``; each range is zero padded to the width of its lower bound
    (``n[08-10]`` -> n08 n09 n10). Duplicates are kept.

    Raises:
        ConfigError: the expression is malformed (unbalanced or nested brackets, an empty
            item, a non-numeric or descending range) or expands to more than ``MAX_HOSTS``.
    """
    hosts: list[str] = []
    for token in _split_top_level(expr):
        groups = _parse_host_expression(token, expr)
        count = 1
        for group in groups:
            count *= len(group)
        if len(hosts) + count > MAX_HOSTS:
            raise ConfigError(
                f"hostlist {expr!r} expands to more than {MAX_HOSTS} hosts; check the ranges "
                "for a typo"
            )
        hosts.extend("".join(parts) for parts in itertools.product(*groups))
    return hosts


def _split_top_level(expr: str) -> list[str]:
    """Split at commas and whitespace outside brackets; check bracket balance and nesting."""
    tokens: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in expr:
        if ch == "[":
            if depth:
                raise ConfigError(
                    f"hostlist {expr!r} has nested brackets; Slurm hostlists allow one level, "
                    "e.g. 'n[1-4]' or 'rack[1-2]-n[1-4]'"
                )
            depth = 1
        elif ch == "]":
            if not depth:
                raise ConfigError(
                    f"hostlist {expr!r} has a ']' without a matching '['; balance the brackets"
                )
            depth = 0
        elif depth == 0 and (ch == "," or ch.isspace()):
            if current:
                tokens.append("".join(current))
                current = []
            continue
        current.append(ch)
    if depth:
        raise ConfigError(
            f"hostlist {expr!r} has a '[' without a matching ']'; balance the brackets"
        )
    if current:
        tokens.append("".join(current))
    return tokens


def _parse_host_expression(token: str, expr: str) -> list[list[str]]:
    """Turn one host expression into segments: literal text and expanded bracket groups.

    ``token`` has balanced, unnested brackets (checked by :func:`_split_top_level`).
    """
    groups: list[list[str]] = []
    pos = 0
    while pos < len(token):
        start = token.find("[", pos)
        if start < 0:
            groups.append([token[pos:]])
            break
        if start > pos:
            groups.append([token[pos:start]])
        end = token.index("]", start)
        groups.append(_expand_bracket(token[start + 1 : end], expr))
        pos = end + 1
    return groups


def _expand_bracket(body: str, expr: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. ``"1-3,010-011"``."""
    values: list[str] = []
    for raw_item in body.split(","):
        item = raw_item.strip()
        if not item:
            raise ConfigError(
                f"hostlist {expr!r} has an empty item in '[{body}]'; write numbers or ranges "
                "separated by single commas, e.g. 'n[1-3,7]'"
            )
        low, sep, high = item.partition("-")
        low, high = low.strip(), high.strip()
        if not _DIGITS.fullmatch(low) or (sep and not _DIGITS.fullmatch(high)):
            raise ConfigError(
                f"hostlist {expr!r} has a bad item {item!r} in '[{body}]'; each item must be "
                "a number or a range of two numbers 'a-b', e.g. 'n[01-04,07]'"
            )
        if not sep:
            values.append(low)
            continue
        first, last = int(low), int(high)
        if last < first:
            raise ConfigError(
                f"hostlist {expr!r} has a descending range {item!r}; write it low to high, "
                f"e.g. '{high}-{low}'"
            )
        if last - first + 1 > MAX_HOSTS:
            raise ConfigError(
                f"hostlist {expr!r} has range {item!r} of more than {MAX_HOSTS} hosts; check "
                "it for a typo"
            )
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(first, last + 1))
    return values


# --------------------------------------------------------------------------------------------
# Launcher settings from SLURM_* variables
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmDerived:
    """What the launcher takes from a Slurm environment.

    Attributes:
        nnodes: Number of nodes, as torchrun's ``--nnodes`` string (e.g. ``"4"``).
        node_rank: This node's index within the step (``SLURM_NODEID``).
        rdzv_id: Rendezvous id shared by all nodes: ``<array job>_<task>`` for array jobs,
            else the job id.
        rdzv_host: First host of the step's (or job's) nodelist.
        job_id: ``SLURM_JOB_ID`` as given.
        in_step: Whether this process runs inside an srun job step.
        warnings: Human-readable problems worth telling the user; none is fatal.
    """

    nnodes: str
    node_rank: int
    rdzv_id: str
    rdzv_host: str
    job_id: str
    in_step: bool
    warnings: tuple[str, ...]


def derive(env: Mapping[str, str]) -> SlurmDerived | None:
    """Derive launcher settings from Slurm's environment variables.

    Returns None when ``SLURM_JOB_ID`` is unset or blank (not under Slurm).

    Raises:
        ConfigError: a ``SLURM_*`` variable that must be an integer is not, the node rank is
            outside the node count, or no nodelist variable is set.
    """
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None
    _require_int(env, "SLURM_JOB_ID", job_id)

    warnings: list[str] = []
    in_step = _in_step(env)
    if not in_step:
        warnings.append(
            "SLURM_JOB_ID is set but this process is not in a Slurm job step: ftrun was "
            "started directly in the batch script (or an salloc shell), so only one node "
            "runs a launcher; start it as `srun --ntasks-per-node=1 ftrun ...` so every node "
            "gets exactly one launcher"
        )

    nodelist_names = (
        ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if in_step
        else ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
    )
    nodelist_var, nodelist_raw = _first_set(env, nodelist_names)
    if nodelist_var is None:
        raise ConfigError(
            f"SLURM_JOB_ID={job_id} is set but none of {', '.join(nodelist_names)} is; ftrun "
            "cannot find the rendezvous host. Run ftrun through srun inside a Slurm allocation, "
            "or pass --rdzv-endpoint, --nnodes and --node-rank yourself"
        )
    hosts = parse_hostlist(nodelist_raw)
    if not hosts:
        raise ConfigError(
            f"{nodelist_var} is empty; ftrun cannot find the rendezvous host. Pass "
            "--rdzv-endpoint HOST:PORT"
        )

    count_names = (
        ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        if in_step
        else ("SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    )
    count_var, count_raw = _first_set(env, count_names)
    if count_var is None:
        nnodes = len(hosts)
    else:
        nnodes = _require_int(env, count_var, count_raw)
        if nnodes < 1:
            raise ConfigError(f"{count_var} must be at least 1, got {count_raw!r}")
        if nnodes != len(hosts):
            warnings.append(
                f"{count_var}={nnodes} but {nodelist_var}={nodelist_raw!r} names {len(hosts)} "
                f"hosts; ftrun uses {nnodes} nodes. Pass --nnodes to override"
            )

    rank_raw = env.get("SLURM_NODEID", "0").strip()
    node_rank = _require_int(env, "SLURM_NODEID", rank_raw)
    if node_rank >= nnodes:
        raise ConfigError(
            f"SLURM_NODEID={node_rank} is not below the node count {nnodes} (from "
            f"{count_var or nodelist_var}); pass --node-rank and --nnodes explicitly"
        )

    array_job = env.get("SLURM_ARRAY_JOB_ID", "").strip()
    array_task = env.get("SLURM_ARRAY_TASK_ID", "").strip()
    if array_job and array_task:
        _require_int(env, "SLURM_ARRAY_JOB_ID", array_job)
        _require_int(env, "SLURM_ARRAY_TASK_ID", array_task)
        rdzv_id = f"{array_job}_{array_task}"
    else:
        rdzv_id = job_id

    if in_step:
        per_node_var, per_node_raw = _first_set(
            env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
        )
        if per_node_var is not None:
            match = _LEADING_COUNT.match(per_node_raw)
            if match and int(match.group(1)) > 1:
                warnings.append(
                    f"{per_node_var}={per_node_raw!r}: the step runs more than one task per "
                    "node, so several ftrun launchers share a node and each starts "
                    "--nproc-per-node workers; ftrun needs exactly one launcher per node. Use "
                    "`srun --ntasks-per-node=1 ftrun --nproc-per-node=<GPUs per node> ...`"
                )

    return SlurmDerived(
        nnodes=str(nnodes),
        node_rank=node_rank,
        rdzv_id=rdzv_id,
        rdzv_host=hosts[0],
        job_id=job_id,
        in_step=in_step,
        warnings=tuple(warnings),
    )


def _in_step(env: Mapping[str, str]) -> bool:
    """Whether the process runs inside an srun job step (not the batch or extern step).

    srun sets SLURM_STEP_ID together with SLURM_STEP_NODELIST, and older releases also the
    legacy SLURM_STEPID. Some releases export SLURM_STEP_ID in the batch script as well, so
    SLURM_STEP_ID alone (or holding the batch/extern step id) does not count.
    """
    step_id = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step_id is not None and step_id.strip() in _NON_SRUN_STEP_IDS:
        return False
    if "SLURM_STEPID" in env:
        return True
    return "SLURM_STEP_ID" in env and "SLURM_STEP_NODELIST" in env


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str | None, str]:
    """The first of ``names`` set to a non-blank value, and that value (stripped)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None, ""


def _require_int(env: Mapping[str, str], name: str, raw: str) -> int:
    """Parse a non-negative decimal integer from a SLURM_* variable, or raise ConfigError."""
    if not _DIGITS.fullmatch(raw):
        raise ConfigError(
            f"{name}={env.get(name, raw)!r} is not a non-negative integer; this does not look "
            f"like a Slurm environment. Unset {name} or pass --nnodes, --node-rank and "
            "--rdzv-id explicitly"
        )
    return int(raw)
