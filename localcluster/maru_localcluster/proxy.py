"""kube-proxy of the local cluster: every Service ClusterIP:port forwards TCP to one of its endpoints.

    python -m maru_localcluster.proxy API_URL

A process of its own, so the data path (clients to the router, pool agents and vLLM pods to the
metadata server) never waits on the test's or demo's Python. It watches Services and EndpointSlices
and listens on each ClusterIP and port (in the cluster's network namespace, where it runs); a
connection goes to the next ready endpoint in turn, or, when none is ready, to a serving one that is
terminating (as kube-proxy does), and is closed at once when there is none. Only TCP; NodePort and
LoadBalancer Services get their ClusterIP only.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import signal
import sys
from typing import Any

from maru_localcluster.apiclient import ApiClient, Informer
from maru_localcluster.network import splice

log = logging.getLogger("kube-proxy")

JsonObj = dict[str, Any]
Target = tuple[str, str, str]  # namespace, service, port name


class Proxy:
    def __init__(self, api_url: str) -> None:
        self.api_url = api_url
        self.listeners: dict[tuple[str, int], tuple[Target, asyncio.Server]] = {}
        self._turn = itertools.count()
        self._wake = asyncio.Event()

    def endpoints(self, target: Target) -> list[tuple[str, int]]:
        namespace, service, port_name = target
        ready, fallback = [], []
        for s in self.slices.objects.values():
            meta = s["metadata"]
            if (
                meta.get("namespace") != namespace
                or (meta.get("labels") or {}).get("kubernetes.io/service-name") != service
            ):
                continue
            port = next((p["port"] for p in s.get("ports") or [] if (p.get("name") or "") == port_name), None)
            if port is None:
                continue
            for e in s.get("endpoints") or []:
                conditions = e.get("conditions") or {}
                for address in e.get("addresses") or []:
                    if conditions.get("ready", True):
                        ready.append((address, int(port)))
                    elif conditions.get("serving") and conditions.get("terminating"):
                        fallback.append((address, int(port)))
        return sorted(ready) or sorted(fallback)

    async def _serve(self, target: Target, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        choices = self.endpoints(target)
        if not choices:
            client_w.close()
            return
        host, port = choices[next(self._turn) % len(choices)]
        try:
            server_r, server_w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=10)
        except (OSError, TimeoutError) as err:
            log.info("%s/%s:%s -> %s:%s: %s", *target, host, port, err)
            client_w.close()
            return
        await splice(client_r, client_w, server_r, server_w)

    def wanted(self) -> dict[tuple[str, int], Target]:
        out = {}
        for svc in self.services.objects.values():
            spec = svc.get("spec") or {}
            ip = spec.get("clusterIP")
            if not ip or ip == "None":
                continue
            for port in spec.get("ports") or []:
                if port.get("protocol", "TCP") == "TCP":
                    out[(ip, int(port["port"]))] = (
                        svc["metadata"]["namespace"],
                        svc["metadata"]["name"],
                        port.get("name") or "",
                    )
        return out

    async def sync(self) -> None:
        wanted = self.wanted()
        for key in list(self.listeners):
            if wanted.get(key) != self.listeners[key][0]:
                _, server = self.listeners.pop(key)
                server.close()
        for (ip, port), target in wanted.items():
            if (ip, port) in self.listeners:
                continue

            async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, target: Target = target) -> None:
                await self._serve(target, r, w)

            try:
                server = await asyncio.start_server(handler, host=ip, port=port, reuse_address=True)
            except OSError as err:
                log.error("Service %s/%s: cannot listen on %s:%s: %s", target[0], target[1], ip, port, err)
                continue
            self.listeners[(ip, port)] = (target, server)
            log.info("Service %s/%s port %s: %s:%s", target[0], target[1], target[2] or "-", ip, port)

    async def run(self, stop: asyncio.Event) -> None:
        async with ApiClient(self.api_url) as api:
            self.services = Informer(api, "/api/v1/services", on_change=self._wake.set)
            self.slices = Informer(api, "/apis/discovery.k8s.io/v1/endpointslices", on_change=self._wake.set)
            self.services.start()
            self.slices.start()
            while not stop.is_set():
                waiter = asyncio.ensure_future(self._wake.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                self._wake.clear()
                await self.sync()
            for _, server in self.listeners.values():
                server.close()
            await self.services.stop()
            await self.slices.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m maru_localcluster.proxy API_URL", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s kube-proxy: %(message)s"
    )
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # dies with whoever started the cluster

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Proxy(args[0]).run(stop)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
