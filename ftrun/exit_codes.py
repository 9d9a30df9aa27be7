"""Exit codes of every ``ftrun`` command, documented in docs/reference/exit-codes.md
(generated from this module by ``python -m ftrun.cli.docs``)."""

from __future__ import annotations

OK = 0  # success; for `status`: the job is healthy (or finished successfully)
FAILED = 1  # the launched job failed (workers exhausted their restarts), or an error
USAGE = 2  # bad flags or arguments
DEGRADED = 3  # `status`: the job runs, but a node is lost, workers restart or a rank is suspect
JOB_FAILED = 4  # `status`: the job reports failed workers and no restarts left
UNREACHABLE = 5  # the coordinator did not answer in time
AUTH = 6  # the coordinator refused the secret
NOT_FOUND = 7  # no such job in the state directory
# The launcher's host was isolated by the coordinator (ftrun.coordinator.detect: a hung or
# slow rank, or a slow link, named on this host; or the host is on the job's exclude list).
ISOLATED = 8


def for_error(e: BaseException) -> int:
    """The exit code for an ftrun error, the same for every command."""
    from ftrun import errors

    for cls, code in (
        (errors.AuthError, AUTH),
        (errors.UnreachableError, UNREACHABLE),
        (errors.JobNotFoundError, NOT_FOUND),
        (errors.ConfigError, USAGE),
    ):
        if isinstance(e, cls):
            return code
    return FAILED
