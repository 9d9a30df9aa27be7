"""Two or more network namespaces on one Linux bridge, for benchmarks (needs root and ``ip``).

Each namespace gets a veth pair, one end inside with its own address ``10.<b>.<c>.<i + 1>/24``,
the other end on a bridge in the initial namespace; processes run inside with ``ip netns exec``
(:meth:`Namespaces.wrap`). Names carry this process's id, so concurrent runs do not collide;
:meth:`Namespaces.close` removes everything it made (a namespace's veth goes with it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], text=True, capture_output=True, timeout=30,
                          check=check)


def available() -> str:
    """Why namespaces cannot be made here, or "" when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return ""


class Namespaces:
    """``n`` namespaces on one bridge; use as a context manager."""

    def __init__(self, n: int, tag: str = "ftb") -> None:
        pid = os.getpid()
        self.bridge = f"{tag}br{pid % 100000}"
        self.names = [f"{tag}{pid}-{i}" for i in range(n)]
        subnet = f"10.{200 + pid % 50}.{pid // 50 % 250}"
        self.addresses = [f"{subnet}.{i + 1}" for i in range(n)]
        self._made: list[tuple[str, ...]] = []

    def __enter__(self) -> Namespaces:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        why = available()
        if why:
            raise RuntimeError(f"cannot make network namespaces: {why}")
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", ns)
            self._made.append(("netns", "del", ns))
            outer, inner = f"{self.bridge}v{i}", f"{self.bridge}n{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", "del", outer))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")

    def wrap(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside namespace ``i`` (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.names[i], *cmd]

    def close(self) -> None:
        for args in reversed(self._made):
            _ip(*args, check=False)
        self._made.clear()
