"""A Kubernetes cluster on one machine that runs what is applied to it: :class:`LocalCluster`.

    with LocalCluster() as cluster:
        cluster.add_node("node-1", labels={"maru.io/pool": "true"})
        cluster.kubectl("apply", "--validate=false", "-f", "crds/")
        ...

Parts, each in its own module:

* the network (``network.py``): a network namespace for the cluster (bridge, node gateways, Service
  range) and one per pod; nothing on the machine's own network changes;
* the API server (``apiserver.py``, in a thread of this process) with graceful pod deletion, Service
  ClusterIPs, ``kubectl logs``, the ServiceAccount, Priority and QoS admission plugins
  (``admission.py``); it answers on the machine's loopback (``kubectl``, tests) and inside the cluster
  network (node components on ``10.244.0.1:8080``, a TLS front on ``10.244.0.1:6443`` that the
  ``default/kubernetes`` Service forwards to, ``pki.py``);
* kube-controller-manager and kube-scheduler (``controllers.py``, ``scheduler.py``), on the API
  server's event loop;
* kube-proxy (``proxy.py``): its own process, in the cluster network;
* one kubelet per node (``kubelet.py``): its own process in the cluster network, running pods with
  ``podrun.py``, volumes from ``volumes.py``, each container from its image in this machine's image
  storage (``imagestore.py``: buildah's, where ``make images`` puts the product's), never from this
  machine's own files.

Needs root: every pod gets its own network namespace, every container its own mount and PID
namespaces, and memory-backed emptyDirs are tmpfs mounts. Nothing is left behind: mounts live in the
kubelets' private mount namespaces, processes die with their kubelet, namespaces with their last
process, and a reaper that outlives this process removes the state folder even after a SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web

from maru_localcluster import admission, network, tools
from maru_localcluster.apiserver import JsonObj
from maru_localcluster.controllers import ControllerManager
from maru_localcluster.kubelet import KubeletConfig
from maru_localcluster.pki import Pki, make_pki
from maru_localcluster.server import KubeEmulator

STOP_TIMEOUT_S = 60.0


class LocalClusterUnavailable(RuntimeError):
    """This machine cannot run the local cluster; the message says why and what to do."""


def unavailable_reason() -> str | None:
    """Why the local cluster cannot run here, or None."""
    if sys.platform != "linux":
        return "the local cluster needs Linux (mount and PID namespaces)"
    if os.geteuid() != 0:
        return (
            "the local cluster needs root: each pod gets its own network namespace, each container its own "
            "mount and PID namespaces, and memory-backed emptyDirs are tmpfs mounts (CI runs as root; run as "
            "root or use sudo)"
        )
    if network.ip_command() is None:
        return "the local cluster needs the 'ip' program (iproute2) for its pods' networks: apt-get install iproute2"
    return None


class LocalCluster:
    def __init__(
        self,
        workdir: Path | None = None,
        *,
        fast_probes: bool = True,
        crashloop_base_s: float = 10.0,
        keep_state: bool = False,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="maru-lc-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.fast_probes = fast_probes
        self.crashloop_base_s = crashloop_base_s
        self.keep_state = keep_state
        self.network: network.ClusterNetwork | None = None
        self.doors: network.Doors | None = None
        self.pki: Pki | None = None
        self.kube: KubeEmulator
        self.controllers: ControllerManager | None = None
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.proxy: subprocess.Popen[bytes] | None = None
        self._inside_servers: list[asyncio.AbstractServer] = []
        self._reaper: subprocess.Popen[bytes] | None = None
        self._socket_links: list[Path] = []  # short names of sockets whose own paths are too long (_csi_plugins)
        self._started = False

    # ------------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        reason = unavailable_reason()
        if reason:
            raise LocalClusterUnavailable(reason)
        os.chmod(self.workdir, 0o755)
        self._reaper = _start_reaper(self.workdir, keep=self.keep_state or not self._own_workdir)
        self.network = network.ClusterNetwork().start()
        self.doors = network.Doors(self.network.path)
        self.pki = make_pki(
            self.workdir / "pki",
            ips=[network.CONTROL_PLANE_ADDRESS, network.KUBERNETES_SERVICE_IP, "127.0.0.1"],
            dns_names=[
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
                "localhost",
            ],
        )
        service_ips = network.service_addresses()
        self.kube = KubeEmulator(
            self.workdir / "api",
            validate_schemas=True,
            graceful_pod_deletion=True,
            service_ip_allocator=lambda: next(service_ips),
            pod_log_reader=self._read_pod_log,
        )
        (self.workdir / "api").mkdir(exist_ok=True)
        self.kube.start()
        self._started = True
        self.kube.call(admission.install, self.kube.emulator)
        self.kube.call(_printer_columns, self.kube.emulator)
        self._listen_inside()
        self._register_kubernetes_service()
        self.controllers = ControllerManager(self.kube, ca_pem=self.pki.ca_pem)
        self.controllers.__enter__()
        self.proxy = self._spawn(
            "kube-proxy", [sys.executable, "-m", "maru_localcluster.proxy", self.inside_api_url], inside=True
        )
        self._wait_tcp(network.KUBERNETES_SERVICE_IP, 443, self.proxy, "kube-proxy")
        return self

    def stop(self) -> None:
        """Stop every node (their pods get SIGTERM, then SIGKILL), the proxy and the API server."""
        for proc in self.nodes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.nodes.items():
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                print(
                    f"local cluster: kubelet of {name} did not stop in {STOP_TIMEOUT_S:.0f}s; killed", file=sys.stderr
                )
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.send_signal(signal.SIGTERM)
            try:
                self.proxy.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        if self._started:
            if self.controllers is not None:
                self.controllers.__exit__()
            self._stop_listening_inside()
            self.kube.stop()
            self._started = False
        if self.doors is not None:
            self.doors.close()
            self.doors = None
        if self.network is not None:
            self.network.stop()
            self.network = None
        for link in self._socket_links:
            link.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                link.parent.rmdir()
        self._socket_links = []
        if not self.keep_state and self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._reaper is not None:
            # Its pipe closes: it ends whatever still names the folder (an operator left running) and exits.
            with contextlib.suppress(OSError):
                assert self._reaper.stdin is not None
                self._reaper.stdin.close()
            self._reaper = None

    def _spawn(self, name: str, argv: list[str], *, inside: bool = False) -> subprocess.Popen[bytes]:
        """A component process, inside the cluster network when ``inside`` (as node components run)."""
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(tools.package_roots())}
        netns = self.network.path if inside and self.network is not None else None
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=(lambda: network.enter_in_child(netns)) if netns else None,
            )
        finally:
            log.close()

    def _wait_tcp(self, host: str, port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
        """Wait until ``host:port`` of the cluster network accepts connections."""
        assert self.network is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}); see {self.workdir / (what + '.log')}")
            with contextlib.closing(network.socket_in(self.network.path)) as sock:
                sock.settimeout(1)
                with contextlib.suppress(OSError):
                    sock.connect((host, port))
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not listen on {host}:{port} within {timeout:.0f}s")

    # ------------------------------------------------------------------------------------ API server

    @property
    def inside_api_url(self) -> str:
        """The API server as processes inside the cluster network reach it (plain HTTP, as admin)."""
        return f"http://{network.CONTROL_PLANE_ADDRESS}:{network.API_HTTP_PORT}"

    def _listen_inside(self) -> None:
        """The API server inside the cluster network: HTTP for node components, TLS behind ``kubernetes``."""
        assert self.pki is not None and self.network is not None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.pki.cert_file, self.pki.key_file)
        sockets = [
            (network.listener_in(self.network.path, network.CONTROL_PLANE_ADDRESS, port), tls)
            for port, tls in ((network.API_HTTP_PORT, None), (network.API_TLS_PORT, context))
        ]

        async def start() -> None:
            for sock, tls in sockets:
                server = aiohttp.web.Server(self.kube.emulator)
                self._inside_servers.append(await asyncio.get_running_loop().create_server(server, sock=sock, ssl=tls))

        asyncio.run_coroutine_threadsafe(start(), self.kube._loop).result(30)  # type: ignore[arg-type]
        tools.write_kubeconfig(self.inside_api_url, self.inside_kubeconfig)

    def _stop_listening_inside(self) -> None:
        servers, self._inside_servers = self._inside_servers, []

        async def stop() -> None:
            for server in servers:
                server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.kube._loop).result(10)  # type: ignore[arg-type]

    def _register_kubernetes_service(self) -> None:
        """``default/kubernetes``, whose endpoint kube-apiserver itself maintains."""
        self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"component": "apiserver", "provider": "kubernetes"},
                },
                "spec": {
                    "clusterIP": network.KUBERNETES_SERVICE_IP,
                    "type": "ClusterIP",
                    "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": network.API_TLS_PORT}],
                },
            }
        )
        self.kube.create(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"kubernetes.io/service-name": "kubernetes"},
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [network.CONTROL_PLANE_ADDRESS], "conditions": {"ready": True}}],
                "ports": [{"name": "https", "port": network.API_TLS_PORT, "protocol": "TCP"}],
            }
        )

    # ------------------------------------------------------------------------------------ nodes

    def add_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        *,
        taints: list[JsonObj] | None = None,
        devices: Mapping[str, Path] | None = None,
        timeout: float = 60,
    ) -> None:
        """Start a kubelet for node ``name`` and wait until its Node is Ready.

        ``devices`` maps device paths (``/dev/dax0.0``) to files standing in for them: each is linked
        into the node's root, and the kubelet accepts it where a pod asks for a ``CharDevice``. Give two
        nodes the same file and they share the "device", as CXL hosts share memory.
        """
        assert self.network is not None and self.pki is not None
        index = len(self.nodes) + 1
        self.network.add_node(index)
        state = self.workdir / "nodes" / name
        root = state / "root"
        root.mkdir(parents=True, exist_ok=True)
        for path, source in (devices or {}).items():
            link = root / path.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            try:
                os.link(source, link)
            except OSError:
                link.symlink_to(Path(source).resolve())
        config = KubeletConfig(
            node=name,
            api_url=self.inside_api_url,
            state_dir=str(state),
            node_address=network.node_address(index),
            pod_cidr=str(network.pod_network(index)),
            ca_file=str(self.pki.ca_file),
            labels=dict(labels or {}),
            taints=list(taints or []),
            standin_devices=sorted(devices or {}),
            kubernetes_service=(network.KUBERNETES_SERVICE_IP, 443),
            fast_probes=self.fast_probes,
            crashloop_base_s=self.crashloop_base_s,
            python=sys.executable,
            csi_plugins=_csi_plugins(state, name, self._socket_links),
        )
        config_file = state / "kubelet.json"
        config_file.write_text(json.dumps(config.__dict__, indent=1))
        proc = self._spawn(
            f"kubelet-{name}", [sys.executable, "-m", "maru_localcluster.kubelet", str(config_file)], inside=True
        )
        self.nodes[name] = proc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the kubelet of {name} exited ({proc.returncode}):\n"
                    + self.component_log(f"kubelet-{name}")[-3000:]
                )
            node = self.kube.get("nodes", name)
            if node and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in node.get("status", {}).get("conditions") or []
            ):
                return
            time.sleep(0.1)
        raise RuntimeError(f"node {name} did not become Ready within {timeout:.0f}s")

    def node_root(self, name: str) -> Path:
        """The node's root folder: where its hostPath volumes live."""
        return self.workdir / "nodes" / name / "root"

    # ------------------------------------------------------------------------------------ clients

    @property
    def kubeconfig(self) -> Path:
        return self.kube.kubeconfig

    @property
    def inside_kubeconfig(self) -> Path:
        """A kubeconfig for processes inside the cluster network (:meth:`inside_preexec`)."""
        return self.workdir / "kubeconfig-inside"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a process outside the cluster (kubectl, helm): its KUBECONFIG."""
        return self.kube.env(**extra)

    def inside_env(self, **extra: str) -> dict[str, str]:
        """Environment for a process started with :meth:`inside_preexec`: the API server as seen from inside."""
        return {**self.kube.env(**extra), "KUBECONFIG": str(self.inside_kubeconfig)}

    def inside_preexec(self) -> Callable[[], None]:
        """``preexec_fn`` for a process that runs on the cluster's network, as a node's host-network process
        does (the operator in the demo and tests): it reaches pods and Services at their own addresses."""
        assert self.network is not None
        netns = self.network.path
        return lambda: network.enter_in_child(netns)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.kube.kubectl(*args, check=check, input=input, timeout=timeout)

    def service_url(self, namespace: str, name: str, port: str | int | None = None, scheme: str = "http") -> str:
        """``scheme://127.0.0.1:<door>``: how a process on this machine reaches a Service's ClusterIP and port
        (as through ``kubectl port-forward svc/NAME``; the cluster network has no route from the machine)."""
        svc = self.kube.get("services", name, namespace)
        if svc is None:
            raise LookupError(f"Service {namespace}/{name} does not exist")
        ports = svc["spec"].get("ports") or []
        chosen = next((p for p in ports if port in (None, p.get("name"), p.get("port"))), None)
        if chosen is None:
            raise LookupError(f"Service {namespace}/{name} has no port {port!r}")
        return self.address_url(svc["spec"]["clusterIP"], int(chosen["port"]), scheme)

    def pod_url(self, namespace: str, name: str, port: int, scheme: str = "http") -> str:
        """``scheme://127.0.0.1:<door>`` to the pod's own address and ``port`` (``kubectl port-forward pod/NAME``)."""
        pod = self.kube.get("pods", name, namespace)
        ip = ((pod or {}).get("status") or {}).get("podIP")
        if not ip:
            raise LookupError(f"pod {namespace}/{name} has no address (yet)")
        return self.address_url(ip, port, scheme)

    def address_url(self, ip: str, port: int, scheme: str = "http") -> str:
        """A door from this machine to ``ip:port`` of the cluster network."""
        assert self.doors is not None
        host, local = self.doors.open(ip, port)
        return f"{scheme}://{host}:{local}"

    # ------------------------------------------------------------------------------------ inspection

    def component_log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _pod_log_dir(self, pod: JsonObj) -> Path:
        meta = pod["metadata"]
        node = (pod.get("spec") or {}).get("nodeName") or ""
        return self.workdir / "nodes" / node / "logs" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"

    def _read_pod_log(self, pod: JsonObj, query: dict[str, str]) -> str | None:
        containers = [c["name"] for c in (pod.get("spec") or {}).get("containers") or []]
        name = query.get("container") or (containers[0] if len(containers) == 1 else None)
        if name is None:
            return None
        statuses = {s["name"]: s for s in (pod.get("status") or {}).get("containerStatuses") or []}
        restarts = int((statuses.get(name) or {}).get("restartCount", 0))
        if query.get("previous") in ("true", "1"):
            restarts -= 1
        path = self._pod_log_dir(pod) / name / f"{restarts}.log"
        if restarts < 0 or not path.exists():
            return None
        text = path.read_text(errors="replace")
        if query.get("tailLines"):
            text = "\n".join(text.splitlines()[-int(query["tailLines"]) :]) + "\n"
        return text

    def pod_log(self, namespace: str, name: str, container: str | None = None, previous: bool = False) -> str:
        pod = self.kube.get("pods", name, namespace)
        if pod is None:
            raise LookupError(f"pod {namespace}/{name} does not exist")
        query = {"previous": "true" if previous else "false", **({"container": container} if container else {})}
        return self._read_pod_log(pod, query) or ""

    def container_pid(self, namespace: str, name: str, container: str) -> int | None:
        """Host pid of the container's PID 1 (its current run), or None when it is not running."""
        pod = self.kube.get("pods", name, namespace)
        if pod is None or not (pod.get("spec") or {}).get("nodeName"):
            return None
        status = next(
            (s for s in (pod.get("status") or {}).get("containerStatuses") or [] if s["name"] == container), None
        )
        if status is None or "running" not in (status.get("state") or {}):
            return None
        pid_file = (
            self.workdir
            / "nodes"
            / pod["spec"]["nodeName"]
            / "pods"
            / pod["metadata"]["uid"]
            / "containers"
            / container
            / str(status.get("restartCount", 0))
            / "pid"
        )
        try:
            return int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def pid_namespaces(self, pod: JsonObj) -> set[str]:
        """The PID namespaces (``pid:[inode]@<start time of its PID 1>``) any container of ``pod`` ever ran in."""
        spaces = set()
        base = (
            self.workdir
            / "nodes"
            / ((pod.get("spec") or {}).get("nodeName") or "")
            / "pods"
            / pod["metadata"]["uid"]
            / "containers"
        )
        for pid_file in base.glob("*/*/pid"):
            lines = pid_file.read_text().split()
            if len(lines) >= 2:
                spaces.add(lines[1])
        return spaces

    def collect_logs(self, dest: Path) -> None:
        """Copy every component and container log, plus what kubectl shows, into ``dest`` (for failures)."""
        dest.mkdir(parents=True, exist_ok=True)
        for path in self.workdir.glob("*.log"):
            shutil.copy2(path, dest / path.name)
        for path in self.workdir.glob("nodes/*/*.log"):  # the nodes' CSI plugins
            shutil.copy2(path, dest / f"{path.parent.name}-{path.name}")
        for node_logs in (self.workdir / "nodes").glob("*/logs"):
            for pod_dir in node_logs.iterdir():
                for log in pod_dir.glob("*/*.log"):
                    target = dest / "pods" / pod_dir.name / f"{log.parent.name}-{log.stem}.log"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(log, target)
        if self._started:
            for args, file in (
                (("get", "all,mpool,ig,events", "-A", "-o", "wide"), "kubectl-get.txt"),
                (("describe", "pods", "-A"), "kubectl-describe-pods.txt"),
            ):
                out = self.kubectl(*args, check=False)
                (dest / file).write_text(out.stdout + out.stderr)


def _start_reaper(workdir: Path, *, keep: bool) -> subprocess.Popen[bytes]:
    """The reaper (``reaper.py``): it outlives this process and cleans up when it ends without ``stop()``."""
    argv = [
        sys.executable,
        "-m",
        "maru_localcluster.reaper",
        str(os.getpid()),
        str(workdir),
        *(["--keep"] if keep else []),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(tools.package_roots())}
    env.pop("KUBECONFIG", None)
    # Its own session and no parent-death signal: it must outlive us. Only its stdin ties it to this process.
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        cwd="/",
    )


def processes_in(namespaces: set[str]) -> list[int]:
    """Live processes of the PID namespaces ``namespaces`` (``pid:[inode]@<start of its PID 1>``, as
    :meth:`LocalCluster.pid_namespaces` gives them). A dead namespace's inode goes to the next namespace the
    kernel makes, another cluster's pod on a machine running two: a namespace whose PID 1 started at another
    time is not the one asked about."""
    inodes = {space.split("@")[0] for space in namespaces}
    members: dict[str, list[int]] = {}
    init_start: dict[str, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            inode = os.readlink(entry / "ns" / "pid")
            if inode not in inodes:
                continue
            stat = (entry / "stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            if fields[0] == "Z":
                continue
            members.setdefault(inode, []).append(int(entry.name))
            status = (entry / "status").read_text()
            nspid = next((line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:")), "")
            if nspid == "1":
                init_start[inode] = fields[19]
        except OSError:
            continue
    found = []
    for inode, pids in members.items():
        # Without its PID 1 a namespace is dying (the kernel kills the rest): its stragglers count as its own.
        if inode not in init_start or f"{inode}@{init_start[inode]}" in namespaces:
            found += pids
    return sorted(found)


# What `kubectl get` shows for the workloads (kube-apiserver prints them from Go code; JSONPath here).
_COLUMNS: dict[tuple[str, str], list[JsonObj]] = {
    ("", "pods"): [
        {"name": "Status", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.containerStatuses[*].restartCount"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "IP", "type": "string", "jsonPath": ".status.podIP", "priority": 1},
        {"name": "Node", "type": "string", "jsonPath": ".spec.nodeName", "priority": 1},
    ],
    ("apps", "deployments"): [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Up-to-date", "type": "integer", "jsonPath": ".status.updatedReplicas"},
        {"name": "Available", "type": "integer", "jsonPath": ".status.availableReplicas"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
    ("", "services"): [
        {"name": "Type", "type": "string", "jsonPath": ".spec.type"},
        {"name": "Cluster-IP", "type": "string", "jsonPath": ".spec.clusterIP"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ],
}


def _printer_columns(emulator: Any) -> None:
    for (group, plural), columns in _COLUMNS.items():
        rt = emulator.resource_type(group, plural)
        rt.columns = {version: list(columns) for version in rt.versions}


# A Unix socket's path holds at most 107 bytes; a cluster's folder under a test runner's temporary folders can be
# longer than that leaves room for.
SOCKET_PATH_MAX = 107


def _csi_plugins(state: Path, node: str, links: list[Path]) -> list[JsonObj]:
    """The product's CSI node plugin (csi.maru.io), run by each kubelet from the pool image.

    Its socket lives in the node's folder; where that path is too long for a socket, the plugin is given a short
    link to the folder (appended to ``links``, removed when the cluster stops).
    """
    from maru_contracts.csi import DEFAULT_SOCKET_ROOT, DRIVER_NAME
    from maru_operator.images import DEFAULT_POOL_IMAGE

    socket_root = state / "root" / DEFAULT_SOCKET_ROOT.lstrip("/")
    socket_root.mkdir(parents=True, exist_ok=True)
    folder = state / "plugins" / DRIVER_NAME
    folder.mkdir(parents=True, exist_ok=True)
    if len(str(folder / "csi.sock")) > SOCKET_PATH_MAX:
        link = Path(tempfile.mkdtemp(prefix="maru-csi-")) / "plugin"
        link.symlink_to(folder, target_is_directory=True)
        links.append(link)
        folder = link
    endpoint = f"unix://{folder / 'csi.sock'}"
    return [
        {
            "driver": DRIVER_NAME,
            "endpoint": endpoint,
            # The chart's node plugin: `maru-csi` of the pool image, under the reference the chart renders.
            "image": DEFAULT_POOL_IMAGE,
            "argv": [
                "maru-csi",
                "--endpoint",
                endpoint,
                "--node-id",
                node,
                "--socket-root",
                str(socket_root),
            ],
            # The pool's socketDir names a directory of the node: under the node's root folder here.
            "node_path_attributes": ["socketDir"],
        }
    ]
