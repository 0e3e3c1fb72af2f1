"""Container probes as the kubelet runs them: httpGet, tcpSocket and exec, against the pod's address."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import aiohttp

JsonObj = dict[str, Any]

DEFAULTS = {
    "initialDelaySeconds": 0,
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}


def setting(probe: JsonObj, key: str) -> float:
    value = probe.get(key)
    return float(DEFAULTS[key] if value is None else value)


def resolve_port(port: int | str, container: JsonObj) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} is not a port of container {container.get('name')!r}")


async def run_probe(probe: JsonObj, container: JsonObj, pod_ip: str, exec_argv: list[str] | None) -> tuple[bool, str]:
    """(success, what happened) for one probe attempt."""
    timeout = setting(probe, "timeoutSeconds")
    try:
        if "httpGet" in probe:
            return await _http(probe["httpGet"], container, pod_ip, timeout)
        if "tcpSocket" in probe:
            return await _tcp(probe["tcpSocket"], container, pod_ip, timeout)
        if "exec" in probe:
            if exec_argv is None:
                return False, "container not running"
            return await _exec([*exec_argv, *probe["exec"]["command"]], timeout)
    except ValueError as err:
        return False, str(err)
    return False, f"probe handler {sorted(k for k in probe if k not in DEFAULTS)} is not supported"


async def _http(get: JsonObj, container: JsonObj, pod_ip: str, timeout: float) -> tuple[bool, str]:
    port = resolve_port(get.get("port", 80), container)
    scheme = (get.get("scheme") or "HTTP").lower()
    host = get.get("host") or pod_ip
    path = get.get("path") or "/"
    url = f"{scheme}://{host}:{port}{path if path.startswith('/') else '/' + path}"
    headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
    headers.setdefault("User-Agent", "kube-probe/1.35")
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url, headers=headers, ssl=False, allow_redirects=False) as resp,
        ):
            await resp.read()
            ok = 200 <= resp.status < 400
            return ok, f"HTTP probe {url} answered {resp.status}"
    except TimeoutError:
        return False, f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)'
    except (aiohttp.ClientError, OSError) as err:
        return False, f'Get "{url}": {err}'


async def _tcp(sock: JsonObj, container: JsonObj, pod_ip: str, timeout: float) -> tuple[bool, str]:
    port = resolve_port(sock.get("port", 0), container)
    host = sock.get("host") or pod_ip
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError) as err:
        return False, f"dial tcp {host}:{port}: {err or 'i/o timeout'}"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True, f"dial tcp {host}:{port}: connected"


async def _exec(argv: list[str], timeout: float) -> tuple[bool, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return False, f"command timed out after {timeout:g}s"
    text = out.decode(errors="replace").strip()[-500:]
    return proc.returncode == 0, f"exit code {proc.returncode}" + (f": {text}" if text else "")


def exec_prefix(host_pid: int, uid: int, gid: int, spec_path: str) -> list[str]:
    """argv prefix that runs a command inside a running container (see ``podrun exec``); ``spec_path`` is the
    container's podrun spec, whose environment the command gets."""
    return [
        sys.executable,
        "-m",
        "maru_localcluster.podrun",
        "exec",
        str(host_pid),
        str(uid),
        str(gid),
        spec_path,
        "--",
    ]
