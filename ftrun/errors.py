"""The small hierarchy of errors ftrun raises.

Library code raises these; only the CLI turns them into a one-line message and an exit code
(see ``ftrun.exit_codes``). Each message names the bad value and what to do about it.
"""

from __future__ import annotations


class FtrunError(Exception):
    """Base of every error ftrun raises on purpose."""


class ConfigError(FtrunError):
    """A flag, environment variable or file holds a value ftrun cannot use."""


class ProtocolError(FtrunError):
    """A control-plane message is malformed, too large, or of an unknown version."""


class AuthError(ProtocolError):
    """A control-plane message does not carry proof of the job secret."""


class StaleTermError(ProtocolError):
    """A message signed for another coordinator term than the receiver's (a failover)."""


class UnreachableError(FtrunError):
    """A coordinator or store did not answer within its timeout."""


class FtrunTimeoutError(FtrunError):
    """A bounded wait ran out."""


class IntegrityError(FtrunError):
    """Snapshot bytes do not match the hash recorded for them."""


class JobNotFoundError(FtrunError):
    """No job with the given run id is known in the state directory."""


class RestoreError(FtrunError):
    """Snapshots exist but none can be restored; the message says why each one was refused."""
