"""Job files in the state directory: the secret, the coordinator endpoint, the event log.

Layout, all private to the user (directories 0700, files 0600)::

    <state dir>/jobs/<run id>/secret       32 random bytes, hex; or FTRUN_SECRET wins
    <state dir>/jobs/<run id>/job.json     coordinator endpoint, host, pid, start time
    <state dir>/jobs/<run id>/events.jsonl the coordinator's structured event log

On a cluster with a shared home every node and ``ftrun status`` find the same secret here.
Without one, set ``FTRUN_SECRET`` in the job script (the sbatch examples do); the launcher
that runs the coordinator then writes it here too, for ``ftrun status``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftrun import knobs
from ftrun.errors import ConfigError, JobNotFoundError

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def job_dir(run_id: str, state: str | None = None) -> Path:
    """The directory of one job, created private to the user."""
    if not run_id:
        raise ConfigError("empty run id: pass --rdzv-id or use --standalone")
    name = _SAFE.sub("_", run_id)
    return _private_dir(knobs.state_dir(state) / "jobs" / name)


def _write_private_atomic(path: Path, data: bytes, exclusive: bool = False) -> bool:
    """Write ``data`` to ``path`` atomically with mode 0600.

    With ``exclusive`` the file is only created when absent (first writer wins) and the
    return value says whether this call created it.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            return True
        os.replace(tmp, path)
        return True
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_private_json(path: Path, obj: Any) -> None:
    """``obj`` as JSON in ``path``, written atomically with mode 0600 (OSError on failure)."""
    _write_private_atomic(path, json.dumps(obj, default=str).encode())


def load_secret(run_id: str, state: str | None = None, create: bool = True) -> bytes:
    """The job secret: FTRUN_SECRET if set, else the job's secret file (created if asked)."""
    env = knobs.SECRET.get()
    if env:
        return env.encode()
    path = job_dir(run_id, state) / "secret"
    if create and not path.exists():
        _write_private_atomic(path, secrets.token_hex(32).encode(), exclusive=True)
    try:
        st = path.stat()
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{path} is readable by other users (mode {oct(st.st_mode & 0o777)}); "
                f"run: chmod 600 {path}"
            )
        secret = path.read_bytes().strip()
    except FileNotFoundError:
        raise JobNotFoundError(
            f"no secret for job {run_id!r} in {path.parent}; set FTRUN_SECRET to the job's "
            "secret or point --state-dir/FTRUN_STATE_DIR at the job's state directory"
        ) from None
    if len(secret) < 16:
        raise ConfigError(f"{path} holds a secret shorter than 16 bytes; delete it to regenerate")
    return secret


def write_secret(run_id: str, secret: bytes, state: str | None = None) -> Path:
    """Record the job's secret in its secret file (0600), replacing an older one.

    The launcher that runs the coordinator calls this when the secret came from FTRUN_SECRET,
    so that ``ftrun status RUN_ID`` works wherever the job's state directory is visible, as it
    does for a job whose launchers created the file themselves.
    """
    path = job_dir(run_id, state) / "secret"
    _write_private_atomic(path, secret)
    return path


@dataclass(frozen=True)
class JobFile:
    run_id: str
    endpoint: str  # coordinator HOST:PORT
    host: str
    pid: int
    started_at: float
    rdzv_endpoint: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def write_job_file(job: JobFile, state: str | None = None) -> Path:
    path = job_dir(job.run_id, state) / "job.json"
    _write_private_atomic(path, job.to_json().encode())
    return path


def read_job_file(run_id: str, state: str | None = None) -> JobFile:
    path = knobs.state_dir(state) / "jobs" / _SAFE.sub("_", run_id) / "job.json"
    try:
        raw = json.loads(path.read_text())
        return JobFile(**raw)
    except FileNotFoundError:
        raise JobNotFoundError(
            f"no job {run_id!r} in {path.parent.parent}; list jobs with `ftrun status`"
        ) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not a valid ftrun job file ({e}); delete it") from e


def list_jobs(state: str | None = None) -> list[JobFile]:
    """Every job with a readable job file, newest first."""
    root = knobs.state_dir(state) / "jobs"
    jobs: list[JobFile] = []
    if not root.is_dir():
        return jobs
    for entry in root.iterdir():
        try:
            jobs.append(JobFile(**json.loads((entry / "job.json").read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(jobs, key=lambda j: j.started_at, reverse=True)


def store_url_path(run_id: str, node_id: str, state: str | None = None) -> Path:
    """Where a launcher records its node's store endpoint (for ``ftrun inspect`` on its host)."""
    return _private_dir(job_dir(run_id, state) / "stores") / f"{_SAFE.sub('_', node_id)}.url"


def write_store_url(run_id: str, node_id: str, url: str, state: str | None = None) -> Path:
    path = store_url_path(run_id, node_id, state)
    _write_private_atomic(path, json.dumps({"node_id": node_id, "url": url}).encode())
    return path


def store_urls(run_id: str, state: str | None = None) -> list[dict[str, str]]:
    """The store endpoints launchers of ``run_id`` recorded on this host (maybe stale)."""
    out = []
    for path in sorted((knobs.state_dir(state) / "jobs" / _SAFE.sub("_", run_id) / "stores")
                       .glob("*.url")):
        try:
            doc = json.loads(path.read_text())
            out.append({"node_id": str(doc["node_id"]), "url": str(doc["url"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def events_path(run_id: str, state: str | None = None) -> Path:
    return job_dir(run_id, state) / "events.jsonl"


def now() -> float:
    return time.time()
