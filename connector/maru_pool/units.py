"""Parsing of the pool's command-line values: byte sizes and listen/connect URLs.

Kept apart from the CLI so the client and the daemon agree on what a URL means.
"""

from __future__ import annotations

from dataclasses import dataclass

from maru_contracts import poolsize


def parse_size(text: str) -> int:
    """Bytes from a pool size: the grammar MaruPool.spec.size accepts (see :mod:`maru_contracts.poolsize`)."""
    return poolsize.parse_size(text)


@dataclass(frozen=True)
class Endpoint:
    """Where a pool process listens or a client connects: a Unix socket path or a TCP host and port."""

    kind: str  # "unix" or "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def url(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path}"
        return f"tcp://{join_host_port(self.host, self.port)}"


def parse_endpoint(url: str) -> Endpoint:
    """``unix:///abs/path.sock`` or ``tcp://host:port`` (port 0 allowed for listening)."""
    if url.startswith("unix://"):
        path = url[len("unix://") :]
        if not path.startswith("/"):
            raise ValueError(f"{url!r}: unix:// needs an absolute path, e.g. unix:///run/maru/pool.sock")
        return Endpoint(kind="unix", path=path)
    if url.startswith("tcp://"):
        host, port = split_host_port(url[len("tcp://") :], what=url)
        return Endpoint(kind="tcp", host=host, port=port)
    raise ValueError(f"{url!r}: must start with unix:// or tcp://")


def split_host_port(text: str, *, what: str | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) into its parts; port 0 means "pick a free one"."""
    label = what or text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{label!r}: expected host:port with a port in 0..65535")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
