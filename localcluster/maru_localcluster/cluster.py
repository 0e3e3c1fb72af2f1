"""A Kubernetes cluster on one machine that runs what is applied to it: :class:`LocalCluster`.

    with LocalCluster() as cluster:
        cluster.add_node("node-1", labels={"maru.io/pool": "true"})
        cluster.kubectl("apply", "--validate=false", "-f", "crds/")
        ...

Parts, each in its own module:

* the API server (``apiserver.py``, in a thread of this process) with graceful pod deletion, Service
  ClusterIPs from the cluster's loopback block, ``kubectl logs``, the ServiceAccount, Priority and
  QoS admission plugins (``admission.py``), and a TLS front on ``127.B.0.1:6443`` that the
  ``default/kubernetes`` Service forwards to (``pki.py``);
* kube-controller-manager and kube-scheduler (``controllers.py``, ``scheduler.py``), on the API
  server's event loop;
* kube-proxy (``proxy.py``): its own process;
* one kubelet per node (``kubelet.py``): its own process, running pods with ``podrun.py``, volumes
  from ``volumes.py`` and images from ``images.py``.

Needs root: every container gets its own mount and PID namespaces, and memory-backed emptyDirs are
tmpfs mounts. Nothing is left behind: mounts live in the kubelets' private mount namespaces,
processes die with their kubelet, and Service addresses are loopback aliases that need no setup.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp.web

from maru_localcluster import admission
from maru_localcluster.addresses import AddressBlock
from maru_localcluster.apiserver import JsonObj
from maru_localcluster.controllers import ControllerManager
from maru_localcluster.images import ImageTable, package_roots
from maru_localcluster.kubelet import KubeletConfig
from maru_localcluster.pki import Pki, make_pki
from maru_localcluster.server import KubeEmulator

API_TLS_PORT = 6443
STOP_TIMEOUT_S = 60.0


class LocalClusterUnavailable(RuntimeError):
    """This machine cannot run the local cluster; the message says why and what to do."""


def unavailable_reason() -> str | None:
    """Why the local cluster cannot run here, or None."""
    if sys.platform != "linux":
        return "the local cluster needs Linux (mount and PID namespaces)"
    if os.geteuid() != 0:
        return ("the local cluster needs root: each container gets its own mount and PID namespaces and "
                "memory-backed emptyDirs are tmpfs mounts (CI runs as root; run as root or use sudo)")
    return None


class LocalCluster:
    def __init__(self, workdir: Path | None = None, *, images: ImageTable | None = None, fast_probes: bool = True,
                 crashloop_base_s: float = 10.0, keep_state: bool = False) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="maru-lc-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.images = images or ImageTable()
        self.fast_probes = fast_probes
        self.crashloop_base_s = crashloop_base_s
        self.keep_state = keep_state
        self.block: AddressBlock | None = None
        self.pki: Pki | None = None
        self.kube: KubeEmulator
        self.controllers: ControllerManager | None = None
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.proxy: subprocess.Popen[bytes] | None = None
        self._tls_server: asyncio.AbstractServer | None = None
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
        self.block = AddressBlock()
        self.pki = make_pki(self.workdir / "pki", ips=[self.block.api_server, self.block.kubernetes_service,
                                                        "127.0.0.1"],
                            dns_names=["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                       "kubernetes.default.svc.cluster.local", "localhost"])
        self.kube = KubeEmulator(self.workdir / "api", validate_schemas=True, graceful_pod_deletion=True,
                                 service_ip_allocator=self.block.next_service_ip,
                                 pod_log_reader=self._read_pod_log)
        (self.workdir / "api").mkdir(exist_ok=True)
        self.kube.start()
        self._started = True
        self.kube.call(admission.install, self.kube.emulator)
        self.kube.call(_printer_columns, self.kube.emulator)
        self._start_tls_front()
        self._register_kubernetes_service()
        self.controllers = ControllerManager(self.kube, ca_pem=self.pki.ca_pem)
        self.controllers.__enter__()
        self.proxy = self._spawn("kube-proxy", [sys.executable, "-m", "maru_localcluster.proxy", self.kube.url])
        self._wait_tcp(self.block.kubernetes_service, 443, self.proxy, "kube-proxy")
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
                print(f"local cluster: kubelet of {name} did not stop in {STOP_TIMEOUT_S:.0f}s; killed",
                      file=sys.stderr)
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
            self._stop_tls_front()
            self.kube.stop()
            self._started = False
        if self.block is not None:
            self.block.release()
            self.block = None
        if not self.keep_state and self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(package_roots())}
        try:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        finally:
            log.close()

    def _wait_tcp(self, host: str, port: int, proc: subprocess.Popen[bytes], what: str,
                  timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}); see {self.workdir / (what + '.log')}")
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not listen on {host}:{port} within {timeout:.0f}s")

    # ------------------------------------------------------------------------------------ API server

    def _start_tls_front(self) -> None:
        assert self.pki is not None and self.block is not None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.pki.cert_file, self.pki.key_file)
        host = self.block.api_server

        async def start() -> None:
            server = aiohttp.web.Server(self.kube.emulator)
            self._tls_server = await asyncio.get_running_loop().create_server(server, host, API_TLS_PORT,
                                                                              ssl=context)

        future = asyncio.run_coroutine_threadsafe(start(), self.kube._loop)  # type: ignore[arg-type]
        future.result(30)

    def _stop_tls_front(self) -> None:
        if self._tls_server is None:
            return
        server = self._tls_server

        async def stop() -> None:
            server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.kube._loop).result(10)  # type: ignore[arg-type]
        self._tls_server = None

    def _register_kubernetes_service(self) -> None:
        """``default/kubernetes``, whose endpoint kube-apiserver itself maintains."""
        assert self.block is not None
        self.kube.create({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "kubernetes", "namespace": "default",
                         "labels": {"component": "apiserver", "provider": "kubernetes"}},
            "spec": {"clusterIP": self.block.kubernetes_service, "type": "ClusterIP",
                     "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": API_TLS_PORT}]},
        })
        self.kube.create({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "kubernetes"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.block.api_server], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": API_TLS_PORT, "protocol": "TCP"}],
        })

    # ------------------------------------------------------------------------------------ nodes

    def add_node(self, name: str, labels: Mapping[str, str] | None = None, *, taints: list[JsonObj] | None = None,
                 devices: Mapping[str, Path] | None = None, timeout: float = 60) -> None:
        """Start a kubelet for node ``name`` and wait until its Node is Ready.

        ``devices`` maps device paths (``/dev/dax0.0``) to files standing in for them: each is linked
        into the node's root, and the kubelet accepts it where a pod asks for a ``CharDevice``. Give two
        nodes the same file and they share the "device", as CXL hosts share memory.
        """
        assert self.block is not None and self.pki is not None
        index = len(self.nodes) + 1
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
            node=name, api_url=self.kube.url, state_dir=str(state), node_address=self.block.node_address(index),
            pod_cidr=str(self.block.pod_network(index)), ca_file=str(self.pki.ca_file), labels=dict(labels or {}),
            taints=list(taints or []), standin_devices=sorted(devices or {}), image_files=self.images.to_json(),
            kubernetes_service=(self.block.kubernetes_service, 443), fast_probes=self.fast_probes,
            crashloop_base_s=self.crashloop_base_s, python=sys.executable, csi_plugins=_csi_plugins(state, name),
        )
        config_file = state / "kubelet.json"
        config_file.write_text(json.dumps(config.__dict__, indent=1))
        proc = self._spawn(f"kubelet-{name}", [sys.executable, "-m", "maru_localcluster.kubelet", str(config_file)])
        self.nodes[name] = proc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the kubelet of {name} exited ({proc.returncode}):\n"
                                   + self.component_log(f"kubelet-{name}")[-3000:])
            node = self.kube.get("nodes", name)
            if node and any(c.get("type") == "Ready" and c.get("status") == "True"
                            for c in node.get("status", {}).get("conditions") or []):
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

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a process outside the cluster (the operator, kubectl): its KUBECONFIG."""
        return self.kube.env(**extra)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.kube.kubectl(*args, check=check, input=input, timeout=timeout)

    def service_url(self, namespace: str, name: str, port: str | int | None = None, scheme: str = "http") -> str:
        """``scheme://<ClusterIP>:<port>`` of a Service: how a process outside the pods reaches it."""
        svc = self.kube.get("services", name, namespace)
        if svc is None:
            raise LookupError(f"Service {namespace}/{name} does not exist")
        ports = svc["spec"].get("ports") or []
        chosen = next((p for p in ports if port in (None, p.get("name"), p.get("port"))), None)
        if chosen is None:
            raise LookupError(f"Service {namespace}/{name} has no port {port!r}")
        return f"{scheme}://{svc['spec']['clusterIP']}:{chosen['port']}"

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
            text = "\n".join(text.splitlines()[-int(query["tailLines"]):]) + "\n"
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
        status = next((s for s in (pod.get("status") or {}).get("containerStatuses") or []
                       if s["name"] == container), None)
        if status is None or "running" not in (status.get("state") or {}):
            return None
        pid_file = (self.workdir / "nodes" / pod["spec"]["nodeName"] / "pods" / pod["metadata"]["uid"] / "containers"
                    / container / str(status.get("restartCount", 0)) / "pid")
        try:
            return int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def pid_namespaces(self, pod: JsonObj) -> set[str]:
        """The PID namespaces (``pid:[inode]``) any container of ``pod`` ever ran in."""
        spaces = set()
        base = self.workdir / "nodes" / ((pod.get("spec") or {}).get("nodeName") or "") / "pods" / \
            pod["metadata"]["uid"] / "containers"
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
            for args, file in ((("get", "all,mpool,ig,events", "-A", "-o", "wide"), "kubectl-get.txt"),
                               (("describe", "pods", "-A"), "kubectl-describe-pods.txt")):
                out = self.kubectl(*args, check=False)
                (dest / file).write_text(out.stdout + out.stderr)


def processes_in(namespaces: set[str]) -> list[int]:
    """Live processes whose PID namespace is one of ``namespaces``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "pid") in namespaces:
                state = (entry / "stat").read_text()
                if state[state.rfind(")") + 2:].split()[:1] != ["Z"]:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


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


def _csi_plugins(state: Path, node: str) -> list[JsonObj]:
    """The product's CSI node plugin (csi.maru.io), when its gRPC dependencies are installed."""
    try:
        import grpc  # noqa: F401

        from maru_connector.csi.contract import DEFAULT_SOCKET_ROOT, DRIVER_NAME
    except ImportError:
        return []
    socket_root = state / "root" / DEFAULT_SOCKET_ROOT.lstrip("/")
    socket_root.mkdir(parents=True, exist_ok=True)
    endpoint = f"unix://{state / 'plugins' / DRIVER_NAME / 'csi.sock'}"
    return [{
        "driver": DRIVER_NAME, "endpoint": endpoint,
        "argv": [sys.executable, "-m", "maru_connector.csi", "--endpoint", endpoint, "--node-id", node,
                 "--socket-root", str(socket_root)],
        # The pool's socketDir names a directory of the node: under the node's root folder here.
        "node_path_attributes": ["socketDir"],
    }]
