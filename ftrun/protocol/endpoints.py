"""Coordinator endpoints: ``host:port`` strings, and the ZeroMQ URLs they stand for."""

from __future__ import annotations

from ftrun.errors import ConfigError


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> (host, port)."""
    host, sep, port_s = endpoint.strip().rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError(f"endpoint {endpoint!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_s)


def join_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def zmq_url(endpoint: str) -> str:
    host, port = split_endpoint(endpoint)
    return f"tcp://{join_endpoint(host, port)}"
