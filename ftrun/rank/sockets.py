"""Closing a gloo process group's connections, which gloo's own abort does not do (Linux).

A gloo collective blocked on a peer returns only when that peer's connection closes;
``ProcessGroup.abort()`` does not close it, and neither does destroying the group while
anything still holds it. In an in-process restart the survivors keep their processes, so
a survivor blocked on another survivor would wait until that one's process exits. What
releases it is shutting the connections down.

Which sockets are gloo's: those this process created while the training function ran (not
there when it was entered) that were accepted by a listening socket also created then,
other than the job store's (``MASTER_PORT``): gloo's device listens once and every pair of
ranks is one TCP connection accepted by one of its two ends. So when every rank shuts down
the connections it accepted, every pair is closed from one end; the rank blocked on it sees
the peer go away, whichever end it is. Sockets the process had before (ftrun's, the user's
set-up outside the function) and outgoing connections of the function (a logger's HTTP
session) are left alone; a server the function itself starts would lose its clients, which
is why this runs only for a function that is being aborted anyway.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

TCP_LISTEN = "0A"  # /proc/net/tcp state column


def socket_inodes(pid: int | str = "self") -> set[int]:
    """The inodes of the open sockets of process ``pid`` (this one by default)."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def _tcp_table() -> dict[int, tuple[int, str]]:
    """inode -> (local port, state) for this network namespace's TCP sockets."""
    table: dict[int, tuple[int, str]] = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) < 10:
                        continue
                    table[int(cols[9])] = (int(cols[1].rpartition(":")[2], 16), cols[3])
        except OSError:
            continue
    return table


def shut_down_accepted(before: set[int], keep_port: int | None) -> int:
    """Shut down (both ways) every TCP connection this process accepted on a listening
    socket it opened since ``before`` was taken, except on port ``keep_port``; returns how
    many. Never raises."""
    try:
        table = _tcp_table()
        fds: dict[int, int] = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inode = int(link[8:-1])
                if inode not in before and inode in table:
                    fds.setdefault(inode, int(fd))
        listening = {table[i][0] for i in fds if table[i][1] == TCP_LISTEN} - {keep_port}
        done = 0
        for inode, fd in fds.items():
            port, state = table[inode]
            if state == TCP_LISTEN or port not in listening:
                continue
            try:
                dup = os.dup(fd)
            except OSError:
                continue
            s = socket.socket(fileno=dup)
            try:
                s.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
            finally:
                s.close()
        return done
    except Exception as e:  # noqa: BLE001 - best effort: the launcher's deadline is the backstop
        log.warning("could not close the process group's connections: %s: %s",
                    type(e).__name__, e)
        return 0
