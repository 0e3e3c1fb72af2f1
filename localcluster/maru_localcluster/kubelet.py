"""The kubelet of one emulated node: runs the pods bound to it as local processes.

    python -m maru_localcluster.kubelet CONFIG.json

One process per node, talking to the API server over HTTP as a kubelet does: it registers its Node,
watches the pods with ``spec.nodeName`` = its name, and for each pod

* gives it a network namespace of its own (held by a sandbox process, as a pause container holds it),
  with an address from the node's range on a veth to the cluster's bridge (``status.podIP``;
  ``hostNetwork`` pods share the node's), a hosts file with its own name and the cluster's Services
  (the cluster DNS of this local cluster), a hostname and a 64Mi ``/dev/shm``;
* sets up its volumes (``volumes.py``), retrying with FailedMount events while that fails;
* runs init containers in order, then every container through ``podrun`` (its own mount, PID and
  UTS namespaces and root filesystem), with logs under ``logs/``;
* runs startup, readiness and liveness probes (httpGet, tcpSocket, exec), which drive the Ready
  condition and restarts; restarts per ``restartPolicy`` with CrashLoopBackOff (10 s doubling to 5
  minutes, reset after 10 minutes of running);
* on deletion: SIGTERM to each container's PID 1, SIGKILL after the grace period, volumes torn
  down, then removes the pod object (grace 0), as the second half of a graceful deletion.

The process lives in a mount namespace of its own, so the tmpfs of memory-backed emptyDirs are
invisible to the machine and vanish with the process; its containers die with it (parent-death
signal). On SIGTERM it stops every pod (grace at most ``shutdown_grace_s``) and marks its node
NotReady.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from maru_localcluster import events, imagestore, network
from maru_localcluster.apiclient import ApiClient, ApiError, Informer
from maru_localcluster.containers import ContainerConfigError, Sandbox, container_env, decode_secret, podrun_spec
from maru_localcluster.images import Image, ImageNotFound
from maru_localcluster.podrun import (
    CLONE_NEWNS,
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_PRIVATE,
    MS_REC,
    MS_SHARED,
    SetupError,
    mount,
    umount,
    unshare,
)
from maru_localcluster.probes import exec_prefix, run_probe, setting
from maru_localcluster.volumes import CsiPlugin, MountError, PodContext, handler_for

log = logging.getLogger("kubelet")

JsonObj = dict[str, Any]
POD_SHM_SIZE = 64 << 20  # the container runtime's default /dev/shm
BACKOFF_CAP_S = 300.0
BACKOFF_RESET_S = 600.0
# With fast probes, startup and readiness probes run at least this often (liveness keeps its period).
FAST_PROBE_PERIOD_S = 1.0


@dataclasses.dataclass
class KubeletConfig:
    node: str
    api_url: str
    state_dir: str
    node_address: str
    pod_cidr: str
    ca_file: str
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    taints: list[JsonObj] = dataclasses.field(default_factory=list)
    standin_devices: list[str] = dataclasses.field(default_factory=list)
    # CSI node plugins this node runs: {driver, endpoint (unix://), argv, node_path_attributes}.
    csi_plugins: list[JsonObj] = dataclasses.field(default_factory=list)
    kubernetes_service: tuple[str, int] | None = None
    fast_probes: bool = True
    crashloop_base_s: float = 10.0
    shutdown_grace_s: float = 5.0
    python: str = sys.executable

    @classmethod
    def load(cls, path: str) -> KubeletConfig:
        data = json.loads(Path(path).read_text())
        if data.get("kubernetes_service"):
            data["kubernetes_service"] = tuple(data["kubernetes_service"])
        return cls(**data)


# Kubernetes gives a container whose preStop hook took its whole grace period 2 s more to stop.
PRE_STOP_EXTRA_GRACE_S = 2.0
PID_POLL_S = 0.02  # how often a starting container's pid file is looked for


def _stamp() -> str:
    return events.now()


def _machine_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 8 << 30


def pod_key(pod: JsonObj) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}/{meta['name']}"


# ------------------------------------------------------------------------------------------ container


@dataclasses.dataclass
class Terminated:
    exit_code: int
    reason: str
    started_at: str
    finished_at: str
    container_id: str
    message: str = ""

    def as_state(self) -> JsonObj:
        out = {
            "exitCode": self.exit_code,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
            "containerID": self.container_id,
        }
        if self.exit_code > 128:
            out["signal"] = self.exit_code - 128
        if self.message:
            out["message"] = self.message
        return out


class ContainerRunner:
    """One container of a pod: (re)starts it, probes it, reports its state."""

    def __init__(self, worker: PodWorker, spec: JsonObj, *, init: bool = False) -> None:
        self.worker = worker
        self.spec = spec
        self.name: str = spec["name"]
        self.init = init
        self.restart_count = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.host_pid: int | None = None
        self.container_id = ""
        self.started_at = ""
        self.started_mono = 0.0
        self.ready = False
        self.started = False  # startup probe passed (or none)
        self.waiting: tuple[str, str] | None = ("ContainerCreating", "")
        self.terminated: Terminated | None = None
        self.last_terminated: Terminated | None = None
        self.done = False  # will not run again (init container succeeded, or restart policy says so)
        self.kill_reason = ""  # why the kubelet stopped it (liveness, startup), for the termination record
        self.uid = self.gid = 0
        self.rootfs_name = ""  # the mounted working container of a stored image, while it runs
        self.starting = False  # between the decision to start and the process's existence
        self.image_id = ""
        self._backoff = 0.0
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle

    def start_task(self) -> asyncio.Task[None]:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"{self.worker.key}/{self.name}")
        return self._task

    async def run(self) -> None:
        worker = self.worker
        while not worker.terminating:
            failure: Exception | None = None
            self.starting = True
            try:
                await self._start()
            except (ContainerConfigError, ImageNotFound, MountError, imagestore.UserNotFound) as err:
                failure = err
            finally:
                self.starting = False
            if failure is not None:
                await self._failed_to_start(failure)
                continue
            worker.changed()
            code = await self._supervise()
            if worker.terminating:
                return
            should_restart = worker.restart_policy == "Always" or (worker.restart_policy == "OnFailure" and code != 0)
            if self.init and code == 0:
                self.done = True
                worker.changed()
                return
            if self.init and worker.restart_policy == "Always":
                should_restart = True  # init containers of Always pods restart on failure (OnFailure rules)
            if not should_restart:
                self.done = True
                worker.changed()
                return
            delay = self._next_backoff()
            if delay > 0:
                self.waiting = (
                    "CrashLoopBackOff",
                    f"back-off {delay:g}s restarting failed container={self.name} "
                    f"pod={worker.name}_{worker.namespace}({worker.uid})",
                )
                await worker.event(
                    "Warning",
                    "BackOff",
                    "Back-off restarting failed container "
                    f"{self.name} in pod {worker.name}_{worker.namespace}({worker.uid})",
                    container=self.name,
                )
                worker.changed()
                await worker.sleep(delay)
            self.restart_count += 1

    async def _failed_to_start(self, err: Exception) -> None:
        """As a node reports it: ErrImagePull once, then ImagePullBackOff while it waits to try again."""
        worker = self.worker
        if isinstance(err, ImageNotFound):
            image = self.spec.get("image", "")
            await worker.event("Warning", "Failed", f"Failed to pull image {image!r}: {err}", container=self.name)
            self.waiting = ("ErrImagePull", str(err))
            worker.changed()
            delay = self._next_backoff()
            await worker.sleep(min(1.0, delay))
            self.waiting = ("ImagePullBackOff", f'Back-off pulling image "{image}": ErrImagePull: {err}')
            await worker.event("Normal", "BackOff", f'Back-off pulling image "{image}"', container=self.name)
            worker.changed()
            await worker.sleep(max(delay - 1.0, 0.0))
            return
        reason = "CreateContainerError" if isinstance(err, imagestore.UserNotFound) else "CreateContainerConfigError"
        self.waiting = (reason, str(err))
        await worker.event("Warning", "Failed", f"Error: {err}", container=self.name)
        worker.changed()
        await worker.sleep(self._next_backoff())

    def _next_backoff(self) -> float:
        base = self.worker.kubelet.config.crashloop_base_s
        if self.started_mono and time.monotonic() - self.started_mono > BACKOFF_RESET_S:
            self._backoff = 0.0
        # The first restart waits the base delay, each further one twice the last, up to 5 minutes.
        self._backoff = base if self._backoff == 0 else min(self._backoff * 2, BACKOFF_CAP_S)
        return self._backoff

    async def _start(self) -> None:
        worker, kubelet = self.worker, self.worker.kubelet
        image = await kubelet.resolve_image(self.spec.get("image", ""))
        box = worker.sandbox()
        env = await container_env(self.spec, image, box, kubelet.lookup)
        self.container_id = uuid.uuid4().hex
        cdir = worker.pod_dir / "containers" / self.name / str(self.restart_count)
        shutil.rmtree(cdir, ignore_errors=True)  # a container restart starts from a fresh writable layer
        for sub in ("upper", "work", "rootfs"):
            (cdir / sub).mkdir(parents=True, exist_ok=True)
        self.rootfs_name, lower = await asyncio.to_thread(imagestore.checkout, image, self.container_id)
        try:
            uid, gid = imagestore.user_ids(image.user, lower)
            image = dataclasses.replace(image, uid=uid, gid=gid)
            layers = {
                "lower": lower,
                "upper": str(cdir / "upper"),
                "work": str(cdir / "work"),
                "mountpoint": str(cdir / "rootfs"),
            }
            spec = podrun_spec(self.spec, image, env, box, layers=layers, pid_file=str(cdir / "pid"))
        except BaseException:
            await self.release_rootfs()
            raise
        self.image_id = image.image_id
        self.uid, self.gid = spec["uid"], spec["gid"]
        (cdir / "spec.json").write_text(json.dumps(spec, indent=1))
        log_path = worker.log_dir / self.name / f"{self.restart_count}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                kubelet.config.python,
                "-m",
                "maru_localcluster.podrun",
                "run",
                str(cdir / "spec.json"),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": os.environ.get("PATH", "")},
            )
        self.pid_file = cdir / "pid"
        self.host_pid = None
        # Running means PID 1 runs in the container's root (podrun reports it then, or exits if it cannot):
        # before that an exec, a probe or a preStop hook would have no process to enter.
        while self.pid() is None and self.proc.returncode is None:
            await asyncio.sleep(PID_POLL_S)
        self.started_at = _stamp()
        self.started_mono = time.monotonic()
        self.waiting = None
        if self.terminated is not None:  # the previous run becomes lastState
            self.last_terminated, self.terminated = self.terminated, None
        self.kill_reason = ""
        self.ready = False
        self.started = not self.spec.get("startupProbe")
        await worker.event("Normal", "Created", f"Created container: {self.name}", container=self.name)
        await worker.event("Normal", "Started", f"Started container {self.name}", container=self.name)

    async def _supervise(self) -> int:
        """Wait for the container to exit while its probes run; returns its exit code."""
        assert self.proc is not None
        probes = (
            []
            if self.init
            else [
                asyncio.get_running_loop().create_task(self._probe_loop(kind))
                for kind in ("startupProbe", "readinessProbe", "livenessProbe")
                if self.spec.get(kind)
            ]
        )
        if not self.init and not self.spec.get("readinessProbe"):
            self.ready = self.started
        code = await self.proc.wait()
        for task in probes:
            task.cancel()
        for task in probes:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        message = self._log_tail() if code != 0 else ""
        self.terminated = Terminated(
            code,
            "Completed" if code == 0 else "Error",
            self.started_at,
            _stamp(),
            f"local://{self.container_id}",
            message,
        )
        self.ready = False
        self.proc = None
        self.host_pid = None
        self.worker.changed()
        # Only after the termination is recorded: removing the root can wait seconds on buildah's storage
        # lock, and a status published meanwhile must not show the container as never started.
        await self.release_rootfs()
        return code

    async def release_rootfs(self) -> None:
        """The image's working container goes with the container (its mount with it)."""
        name, self.rootfs_name = self.rootfs_name, ""
        if name:
            # Shielded: a pod's teardown cancels its containers' tasks, and the removal must still happen.
            await asyncio.shield(asyncio.to_thread(imagestore.release, name))

    def _log_tail(self) -> str:
        path = self.worker.log_dir / self.name / f"{self.restart_count}.log"
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-5:])[-1024:]

    def pid(self) -> int | None:
        """The host pid of the container's PID 1, once podrun reported it."""
        if self.host_pid is None:
            try:
                self.host_pid = int(self.pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError, AttributeError):
                return None
        return self.host_pid

    def _exec_prefix(self, pid: int) -> list[str]:
        return exec_prefix(pid, self.uid, self.gid, str(self.pid_file.parent / "spec.json"))

    async def stop(self, grace: float, reason: str = "") -> None:
        """The preStop hook, then SIGTERM to PID 1 (through podrun), SIGKILL once ``grace`` seconds passed
        since the hook started (at least 2 s after a hook that took the whole grace period, as the kubelet)."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        self.kill_reason = self.kill_reason or reason
        started = time.monotonic()
        await self._pre_stop(grace)
        grace = max(grace - (time.monotonic() - started), PRE_STOP_EXTRA_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=max(grace, 0.0))
        except TimeoutError:
            pid = self.pid()
            for target in (pid, proc.pid):
                if target:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(target, signal.SIGKILL)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=10)

    async def _pre_stop(self, grace: float) -> None:
        """Run the container's ``lifecycle.preStop`` (exec, httpGet or sleep) within ``grace`` seconds; a
        failing hook is reported as an Event and the container is stopped all the same."""
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        pid = self.pid()
        if not hook or pid is None or grace <= 0:
            return
        if "sleep" in hook:
            await asyncio.sleep(min(float(hook["sleep"].get("seconds", 0)), grace))
            return
        probe = {**hook, "timeoutSeconds": grace}
        ok, detail = await run_probe(probe, self.spec, self.worker.ip, self._exec_prefix(pid))
        if not ok:
            await self.worker.event(
                "Warning", "FailedPreStopHook", f"PreStopHook failed: {detail}", container=self.name
            )

    # --- probes

    async def _probe_loop(self, kind: str) -> None:
        probe = self.spec[kind]
        worker, fast = self.worker, self.worker.kubelet.config.fast_probes
        period = setting(probe, "periodSeconds")
        failure_threshold = setting(probe, "failureThreshold")
        if fast and kind in ("startupProbe", "readinessProbe") and period > FAST_PROBE_PERIOD_S:
            # Same time budget, probed more often: a pod is Ready within a second of answering.
            failure_threshold = (
                max(failure_threshold, failure_threshold * period / FAST_PROBE_PERIOD_S)
                if kind == "startupProbe"
                else failure_threshold
            )
            period = FAST_PROBE_PERIOD_S
        success_threshold = setting(probe, "successThreshold")
        await asyncio.sleep(setting(probe, "initialDelaySeconds"))
        if kind != "startupProbe":
            while not self.started:
                await asyncio.sleep(0.2)
        successes = failures = 0
        while True:
            pid = self.pid()
            argv = self._exec_prefix(pid) if pid else None
            ok, detail = await run_probe(probe, self.spec, worker.ip, argv)
            if ok:
                successes, failures = successes + 1, 0
            else:
                failures, successes = failures + 1, 0
                if kind != "startupProbe" or failures >= failure_threshold:
                    await worker.event(
                        "Warning", "Unhealthy", f"{kind[:-5].capitalize()} probe failed: {detail}", container=self.name
                    )
            if kind == "startupProbe":
                if ok:
                    self.started = True
                    if not self.spec.get("readinessProbe"):
                        self.ready = True
                    worker.changed()
                    return
                if failures >= failure_threshold:
                    await self._restart_for("failed startup probe, will be restarted")
                    return
            elif kind == "readinessProbe":
                if ok and successes >= success_threshold and not self.ready:
                    self.ready = True
                    worker.changed()
                elif not ok and failures >= failure_threshold and self.ready:
                    self.ready = False
                    worker.changed()
            elif not ok and failures >= failure_threshold:
                await self._restart_for("failed liveness probe, will be restarted")
                return
            await asyncio.sleep(period)

    async def _restart_for(self, why: str) -> None:
        await self.worker.event("Normal", "Killing", f"Container {self.name} {why}", container=self.name)
        await self.stop(self.worker.grace_seconds(), reason=why)

    # --- status

    def status(self) -> JsonObj:
        state: JsonObj
        if self.proc is not None and self.proc.returncode is None and self.waiting is None:
            state = {"running": {"startedAt": self.started_at}}
        elif self.waiting is not None and not self.done:
            state = {
                "waiting": {"reason": self.waiting[0], **({"message": self.waiting[1]} if self.waiting[1] else {})}
            }
        elif self.terminated is not None:
            state = {"terminated": self.terminated.as_state()}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        out = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
            "ready": self.ready,
            "restartCount": self.restart_count,
            "started": bool(self.proc is not None and self.started),
            "state": state,
            "lastState": {},
        }
        # While waiting to restart, the run that just ended is the last state; otherwise the one before.
        last = self.terminated if "waiting" in state and self.terminated else self.last_terminated
        if last is not None:
            out["lastState"] = {"terminated": last.as_state()}
        if self.container_id:
            out["containerID"] = f"local://{self.container_id}"
        return out


# ------------------------------------------------------------------------------------------ pod


class PodWorker:
    """Everything about one pod on this node, from its first sighting to its removal."""

    def __init__(self, kubelet: Kubelet, pod: JsonObj) -> None:
        self.kubelet = kubelet
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.name: str = meta["name"]
        self.namespace: str = meta["namespace"]
        self.key = pod_key(pod)
        self.pod_dir = Path(kubelet.config.state_dir) / "pods" / self.uid
        self.log_dir = Path(kubelet.config.state_dir) / "logs" / f"{self.namespace}_{self.name}_{self.uid}"
        self.ip = ""
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        self.sandbox_proc: asyncio.subprocess.Process | None = None
        self.hostname = (pod["spec"].get("hostname") or self.name)[:63]
        self.volume_paths: dict[str, str] = {}
        self.init_runners = [ContainerRunner(self, c, init=True) for c in pod["spec"].get("initContainers") or []]
        self.runners = [ContainerRunner(self, c) for c in pod["spec"].get("containers") or []]
        self.gone = False  # the pod object disappeared (force deletion): stop at once
        self.started_at = ""
        self.sandbox_ready = False
        self.sandbox_removed = False  # the pod's folder is gone; the worker lives on until its final delete
        self.initialized = not self.init_runners
        self._wake = asyncio.Event()
        self._dirty = asyncio.Event()
        self._last_status: JsonObj | None = None
        self._task: asyncio.Task[None] | None = None
        self._status_task: asyncio.Task[None] | None = None

    @property
    def restart_policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy") or "Always")

    @property
    def terminating(self) -> bool:
        return self.gone or self.kubelet.shutting_down or bool(self.pod["metadata"].get("deletionTimestamp"))

    def grace_seconds(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", 30)
        if self.kubelet.shutting_down:
            grace = min(float(grace), self.kubelet.config.shutdown_grace_s)
        return float(grace) if not self.gone else 0.0

    def update(self, pod: JsonObj) -> None:
        self.pod = pod
        self._wake.set()

    def changed(self) -> None:
        self._dirty.set()
        self._wake.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake early when the pod is being deleted."""
        deadline = time.monotonic() + seconds
        while not self.terminating and (left := deadline - time.monotonic()) > 0:
            self._wake.clear()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=left)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self.run(), name=f"pod {self.key}")
        self._status_task = loop.create_task(self._status_writer(), name=f"status {self.key}")

    async def event(self, type_: str, reason: str, message: str, container: str | None = None) -> None:
        path = f"spec.containers{{{container}}}" if container else None
        await self.kubelet.record(self.pod, type_, reason, message, field_path=path)

    # --- main flow

    async def run(self) -> None:
        main = asyncio.get_running_loop().create_task(self._run_pod(), name=f"run {self.key}")
        try:
            # Runs until the pod is deleted (or the node shuts down), or its containers are done for good.
            while not self.terminating and not main.done():
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait([waiter, main], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            if main.done() and not main.cancelled() and main.exception() is not None:
                log.error("pod %s: unexpected kubelet error", self.key, exc_info=main.exception())
            while not self.terminating and main.done():
                # Completed (restartPolicy Never/OnFailure): keep the status until the pod is deleted.
                self._wake.clear()
                await self._wake.wait()
        finally:
            await self._finish()
            if not main.done():
                main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await main

    async def _run_pod(self) -> None:
        self.ip = self.kubelet.config.node_address if self.host_network else self.kubelet.addresses.take()
        self.started_at = _stamp()
        self._make_sandbox()
        while not self.terminating and not self.host_network:
            try:
                await self._make_network()
                break
            except (network.NetworkSetupError, OSError) as err:
                await self._remove_network()
                await self.event("Warning", "FailedCreatePodSandBox", f"Failed to create pod sandbox: {err}")
                await self.sleep(2.0)
        self.changed()
        while not self.terminating:
            try:
                await self._setup_volumes()
                break
            except MountError as err:
                await self.event("Warning", "FailedMount", f"MountVolume.SetUp failed: {err}")
                await self.sleep(2.0)
        if self.terminating:
            return
        for runner in self.init_runners:
            await runner.start_task()
            if not runner.done or (runner.terminated and runner.terminated.exit_code != 0):
                return  # the pod failed (restartPolicy Never) or is going away
        self.initialized = True
        self.changed()
        tasks = [r.start_task() for r in self.runners]
        await asyncio.gather(*tasks)

    def _make_sandbox(self) -> None:
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.pod_dir / "hostname").write_text(self.hostname + "\n")
        host_resolv = Path("/etc/resolv.conf")
        (self.pod_dir / "resolv.conf").write_text(host_resolv.read_text() if host_resolv.exists() else "")
        self.write_hosts()
        shm = self.pod_dir / "shm"
        shm.mkdir(exist_ok=True)
        if not os.path.ismount(shm):
            mount("tmpfs", str(shm), "tmpfs", MS_NOSUID | MS_NODEV, f"size={POD_SHM_SIZE},mode=1777")

    async def _make_network(self) -> None:
        """The pod's network namespace, held by its sandbox process, attached to the cluster's bridge."""
        log = open(self.pod_dir / "sandbox.log", "ab")  # noqa: SIM115 - the child's from here on
        try:
            self.sandbox_proc = await asyncio.create_subprocess_exec(
                *network.sandbox_argv(self.kubelet.config.python),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=network.sandbox_env(),
                start_new_session=True,
            )
        finally:
            log.close()
        deadline = time.monotonic() + 60
        while not network.has_own_netns(self.sandbox_proc.pid):
            if self.sandbox_proc.returncode is not None or time.monotonic() > deadline:
                tail = (self.pod_dir / "sandbox.log").read_text(errors="replace").strip()[-300:]
                raise network.NetworkSetupError(f"the sandbox process did not get its namespace: {tail}")
            await asyncio.sleep(0.01)
        cidr = self.kubelet.addresses.network
        await network.attach_pod(
            self.sandbox_proc.pid, self.uid, self.ip, cidr.prefixlen, self.kubelet.config.node_address
        )

    async def _remove_network(self) -> None:
        """The sandbox ends; with its last process the namespace goes, and the veth with it."""
        proc, self.sandbox_proc = self.sandbox_proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def write_hosts(self) -> None:
        """The pod's /etc/hosts: localhost, the pod itself, every Service (rewritten in place when they change)."""
        if not self.ip or self.sandbox_removed:
            # A Service changing while a deleted pod waited for its final delete rewrote the hosts file
            # of a removed folder: FileNotFoundError ended the kubelet, and every pod of its node.
            return
        lines = [
            "# Kubernetes-managed hosts file (local cluster): this pod and the cluster's Services.",
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{self.ip}\t{self.hostname}",
        ]
        for svc in sorted(self.kubelet.services.objects.values(), key=Informer.key):
            ip = (svc.get("spec") or {}).get("clusterIP")
            if not ip or ip == "None":
                continue
            name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
            names = [f"{name}.{ns}.svc.cluster.local", f"{name}.{ns}.svc", f"{name}.{ns}"]
            if ns == self.namespace:
                names.append(name)  # the search path of a pod in that namespace
            lines.append(f"{ip}\t{' '.join(names)}")
        data = ("\n".join(lines) + "\n").encode()
        path = self.pod_dir / "hosts"
        # In place (same inode): the containers see it through a bind mount.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

    def context(self) -> PodContext:
        kubelet = self.kubelet
        return PodContext(
            pod=self.pod,
            pod_dir=self.pod_dir,
            node_root=kubelet.node_root,
            api=kubelet.api,
            ca_pem=kubelet.ca_pem,
            standin_devices=frozenset(kubelet.config.standin_devices),
            memory_bytes=kubelet.memory,
            csi_plugins=kubelet.csi_plugins,
        )

    async def _setup_volumes(self) -> None:
        ctx = self.context()
        for volume in self.pod["spec"].get("volumes") or []:
            if volume["name"] not in self.volume_paths:
                self.volume_paths[volume["name"]] = await handler_for(volume).setup(ctx, volume)

    def sandbox(self) -> Sandbox:
        services = [s for s in self.kubelet.services.objects.values() if s["metadata"]["namespace"] == self.namespace]
        # The kubelet knows the pod's addresses before the API does: the downward API reads them from here.
        addresses = {
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "hostIP": self.kubelet.config.node_address,
            "hostIPs": [{"ip": self.kubelet.config.node_address}],
        }
        pod = {**self.pod, "status": {**(self.pod.get("status") or {}), **addresses}}
        netns = network.netns_path(self.sandbox_proc.pid) if self.sandbox_proc is not None else None
        return Sandbox(
            pod=pod,
            pod_ip=self.ip,
            netns=netns,
            hostname=self.hostname,
            hosts_file=str(self.pod_dir / "hosts"),
            hostname_file=str(self.pod_dir / "hostname"),
            resolv_file=str(self.pod_dir / "resolv.conf"),
            shm_dir=str(self.pod_dir / "shm"),
            volume_paths=dict(self.volume_paths),
            services=services,
            kubernetes_service=self.kubelet.config.kubernetes_service,
            node_cpus=os.cpu_count() or 1,
            node_memory=self.kubelet.memory,
        )

    async def _finish(self) -> None:
        grace = self.grace_seconds()
        runners = [r for r in (*self.init_runners, *self.runners)]
        # A container being started (its image checked out, its process spawned) gets its process first, so
        # that it is stopped with the others instead of outliving the pod.
        deadline = time.monotonic() + 60
        while any(r.starting for r in runners) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if any(r.proc is not None for r in runners):
            for r in runners:
                if r.proc is not None:
                    await self.event("Normal", "Killing", f"Stopping container {r.name}", container=r.name)
            await asyncio.gather(*(r.stop(grace) for r in runners))
        for r in runners:
            if r._task is not None:
                r._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await r._task
            await r.release_rootfs()
        self.changed()
        await self._flush_status()
        ctx = self.context()
        for volume in self.pod["spec"].get("volumes") or []:
            path = self.volume_paths.get(volume["name"])
            if path is not None:
                try:
                    await handler_for(volume).teardown(ctx, volume, path)
                except Exception as err:
                    log.warning("pod %s: tearing down volume %s failed: %s", self.key, volume["name"], err)
        shm = self.pod_dir / "shm"
        if os.path.ismount(shm):
            _umount(str(shm))
        await self._remove_network()
        self.sandbox_removed = True
        shutil.rmtree(self.pod_dir, ignore_errors=True)
        if self.ip and not self.host_network:
            self.kubelet.addresses.give_back(self.ip)
        if self._status_task is not None:
            self._status_task.cancel()
        if self.pod["metadata"].get("deletionTimestamp") and not self.gone and not self.kubelet.shutting_down:
            try:
                await self.kubelet.api.delete(
                    f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                    {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
                )
            except ApiError as err:
                if err.status != 409:
                    log.warning("pod %s: final delete failed: %s", self.key, err)
        self.kubelet.forget(self)

    # --- status

    def status(self) -> JsonObj:
        old = self.pod.get("status") or {}
        containers = [r.status() for r in self.runners]
        inits = [r.status() for r in self.init_runners]
        policy = self.restart_policy
        all_done = bool(self.runners) and all(r.done for r in self.runners)
        if all_done and policy != "Always":
            failed = any(r.terminated and r.terminated.exit_code != 0 for r in self.runners)
            phase = "Failed" if failed else "Succeeded"
        elif any(r.proc is not None or r.terminated is not None for r in self.runners):
            phase = "Running"
        else:
            phase = "Pending"
        init_failed = any(r.done and r.terminated and r.terminated.exit_code != 0 for r in self.init_runners)
        if init_failed and policy == "Never":
            phase = "Failed"
        ready = bool(self.runners) and all(r.ready for r in self.runners) and not self.terminating
        conds = {c.get("type"): c for c in old.get("conditions") or []}

        def cond(type_: str, ok: bool, reason: str = "") -> JsonObj:
            prev = conds.get(type_) or {}
            status = "True" if ok else "False"
            out = {
                "type": type_,
                "status": status,
                "lastTransitionTime": prev.get("lastTransitionTime") if prev.get("status") == status else _stamp(),
                "lastProbeTime": None,
            }
            if reason and not ok:
                out["reason"] = reason
            return out

        not_ready = [r.name for r in self.runners if not r.ready]
        reason = "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"
        conditions = [
            cond("PodReadyToStartContainers", bool(self.ip)),
            cond("Initialized", self.initialized, "ContainersNotInitialized"),
            cond("Ready", ready, reason),
            cond("ContainersReady", ready, reason),
        ]
        if not_ready and not ready:
            for c in conditions[2:]:
                c["message"] = f"containers with unready status: [{' '.join(not_ready)}]"
        conditions.append(conds.get("PodScheduled") or cond("PodScheduled", True))
        status: JsonObj = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": self.kubelet.config.node_address,
            "hostIPs": [{"ip": self.kubelet.config.node_address}],
            "startTime": self.started_at or old.get("startTime") or _stamp(),
            "containerStatuses": containers,
        }
        if self.ip:
            status.update(podIP=self.ip, podIPs=[{"ip": self.ip}])
        if inits:
            status["initContainerStatuses"] = inits
        if old.get("qosClass"):
            status["qosClass"] = old["qosClass"]
        return status

    async def _status_writer(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(0.05)  # coalesce bursts
            self._dirty.clear()
            await self._flush_status()

    async def _flush_status(self) -> None:
        if self.gone:
            return
        status = self.status()
        comparable = {
            **status,
            "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]],
        }
        if comparable == self._last_status:
            return
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "status": status,
        }
        try:
            updated = await self.kubelet.api.replace(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status", body
            )
            self._last_status = comparable
            if isinstance(updated, dict) and updated.get("metadata", {}).get("uid") == self.uid:
                self.pod = {**self.pod, "status": updated.get("status", status)}
        except ApiError as err:
            if err.status == 404:
                self.gone = True
                self._wake.set()
            else:
                log.warning("pod %s: status update failed: %s", self.key, err)
                self._dirty.set()
        except Exception as err:
            log.warning("pod %s: status update failed: %s", self.key, err)
            self._dirty.set()


def _umount(path: str) -> None:
    from maru_localcluster.podrun import SetupError, umount

    with contextlib.suppress(SetupError):
        umount(path)


# ------------------------------------------------------------------------------------------ node


class Kubelet:
    def __init__(self, config: KubeletConfig) -> None:
        self.config = config
        self.node_root = Path(config.state_dir) / "root"
        self.ca_pem = Path(config.ca_file).read_text()
        self.memory = _machine_memory()
        self.addresses = network.PodAddresses(ipaddress.IPv4Network(config.pod_cidr))
        self.csi_plugins = {
            p["driver"]: CsiPlugin(p["driver"], p["endpoint"], tuple(p.get("node_path_attributes", ())))
            for p in config.csi_plugins
        }
        self.workers: dict[str, PodWorker] = {}
        self.shutting_down = False
        self._wake = asyncio.Event()
        self._services_changed = False
        self._recorder = events.Recorder()
        self.api: ApiClient
        self.pods: Informer
        self.services: Informer

    async def resolve_image(self, reference: str) -> Image:
        """The image stored under exactly this reference in this machine's image storage (nothing is pulled)."""
        image = await asyncio.to_thread(imagestore.inspect, reference)
        if image is None:
            raise ImageNotFound(f"{reference!r} is not in this machine's image storage (buildah images); no registry")
        return image

    # --- API helpers

    async def lookup(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        plural = "configmaps" if kind == "configMap" else "secrets"
        obj = await self.api.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        if obj is None:
            return None
        data = obj.get("data") or {}
        return dict(data) if kind == "configMap" else decode_secret(data)

    async def record(
        self, obj: JsonObj, type_: str, reason: str, message: str, *, field_path: str | None = None
    ) -> None:
        try:
            repeat = self._recorder.repeat_of(obj, reason, message)
            ns = obj["metadata"].get("namespace") or "default"
            if repeat is not None:
                ns, name, count = repeat
                await self.api.merge_patch(
                    f"/api/v1/namespaces/{ns}/events/{name}", {"count": count + 1, "lastTimestamp": _stamp()}
                )
                self._recorder.remember(obj, reason, message, ns, name, count + 1)
                return
            body = events.event_body(
                obj, reason, message, component="kubelet", type_=type_, host=self.config.node, field_path=field_path
            )
            created = await self.api.create(f"/api/v1/namespaces/{ns}/events", body)
            self._recorder.remember(obj, reason, message, ns, created["metadata"]["name"], 1)
        except Exception as err:  # events are best effort
            log.debug("event %s for %s not recorded: %s", reason, obj["metadata"].get("name"), err)

    # --- node

    def _node_status(self, ready: bool, message: str) -> JsonObj:
        cpus = str(os.cpu_count() or 1)
        memory = f"{self.memory // 1024}Ki"
        capacity = {"cpu": cpus, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"}
        stamp = _stamp()
        conditions = [
            {
                "type": t,
                "status": "False",
                "reason": f"KubeletHas{r}",
                "message": m,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
            for t, r, m in (
                ("MemoryPressure", "SufficientMemory", "kubelet has sufficient memory available"),
                ("DiskPressure", "NoDiskPressure", "kubelet has no disk pressure"),
                ("PIDPressure", "SufficientPID", "kubelet has sufficient PID available"),
            )
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True" if ready else "Unknown",
                "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        )
        return {
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": self.config.node_address},
                {"type": "Hostname", "address": self.config.node},
            ],
            "capacity": capacity,
            "allocatable": capacity,
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "kubeletVersion": "v1.35.0-local",
                "containerRuntimeVersion": "podrun://1",
                "operatingSystem": "linux",
                "architecture": os.uname().machine,
                "kernelVersion": os.uname().release,
                "osImage": "maru local cluster",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kubeProxyVersion": "",
            },
        }

    async def register(self) -> None:
        name = self.config.node
        labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
            **self.config.labels,
        }
        spec: JsonObj = {"podCIDR": self.config.pod_cidr, "podCIDRs": [self.config.pod_cidr]}
        if self.config.taints:
            spec["taints"] = self.config.taints
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": labels},
            "spec": spec,
            "status": self._node_status(True, "kubelet is posting ready status"),
        }
        existing = await self.api.get(f"/api/v1/nodes/{name}")
        if existing is None:
            await self.api.create("/api/v1/nodes", body)
        else:
            await self.api.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": labels}, "spec": spec})
            await self.api.replace(f"/api/v1/nodes/{name}/status", body)

    async def mark_not_ready(self) -> None:
        name = self.config.node
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name},
            "status": self._node_status(False, "Kubelet stopped posting node status."),
        }
        with contextlib.suppress(Exception):
            await self.api.replace(f"/api/v1/nodes/{name}/status", body)

    # --- pods

    def wake(self) -> None:
        self._wake.set()

    def services_changed(self) -> None:
        self._services_changed = True
        self._wake.set()

    def forget(self, worker: PodWorker) -> None:
        if self.workers.get(worker.uid) is worker:
            del self.workers[worker.uid]
        self._recorder.forget(worker.uid)
        self._wake.set()

    def sync(self) -> None:
        seen = set()
        for pod in list(self.pods.objects.values()):
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            worker = self.workers.get(uid)
            if worker is not None:
                worker.update(pod)
                continue
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp"):
                continue
            worker = PodWorker(self, pod)
            self.workers[uid] = worker
            worker.start()
        for uid, worker in list(self.workers.items()):
            if uid not in seen and not worker.gone:
                worker.gone = True
                worker.update(worker.pod)
        if self._services_changed:
            self._services_changed = False
            for worker in self.workers.values():
                worker.write_hosts()

    async def run(self, stop: asyncio.Event) -> None:
        async with ApiClient(self.config.api_url) as api:
            self.api = api
            await self.register()
            self.services = Informer(api, "/api/v1/services", on_change=self.services_changed)
            self.pods = Informer(
                api, "/api/v1/pods", field_selector=f"spec.nodeName={self.config.node}", on_change=self.wake
            )
            self.services.start()
            await self.services.synced.wait()
            self.pods.start()
            log.info("kubelet of node %s ready (pods %s)", self.config.node, self.config.pod_cidr)
            while not stop.is_set():
                waiter = asyncio.ensure_future(self._wake.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                self._wake.clear()
                if not stop.is_set():
                    self.sync()
            log.info("kubelet of node %s: shutting down its pods", self.config.node)
            self.shutting_down = True
            workers = list(self.workers.values())
            for worker in workers:
                worker.update(worker.pod)
            await asyncio.gather(*(w._task for w in workers if w._task is not None), return_exceptions=True)
            await self.mark_not_ready()
            await self.pods.stop()
            await self.services.stop()


def _private_mounts() -> None:
    """Every mount this kubelet makes stays in its own namespace and goes away with it."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)


@dataclasses.dataclass
class RunningPlugin:
    proc: subprocess.Popen[bytes]
    working_container: str  # the image's working container (imagestore), released when the plugin stops
    binds: list[str]  # mount points inside its root, detached before the release


def start_csi_plugins(config: KubeletConfig) -> list[RunningPlugin]:
    """The node's CSI plugins, from their image (the chart's: the pool image), in the kubelet's mount namespace.

    In a cluster each is a DaemonSet pod, privileged, with the kubelet's directory mounted with Bidirectional
    propagation (its NodePublish bind mounts reach the kubelet), registered by node-driver-registrar (an
    upstream image no registry here serves). Here the kubelet starts the plugin's program from the image's own
    root filesystem (a working container, as for a pod), changed root into it, as root, with this node's folder
    bound at its own path as a shared mount: the plugin's mounts under it propagate to the kubelet's view, as
    Bidirectional propagation does. A plugin whose image is not in the storage does not start, and pods with
    its volumes fail to mount, as on a node where its DaemonSet pod cannot pull.
    """

    def die_with_kubelet() -> None:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)

    running = []
    for plugin in config.csi_plugins:
        image = imagestore.inspect(plugin["image"])
        if image is None:
            log.warning(
                "CSI plugin %s: image %s is not in this machine's image storage (make images); this node runs "
                "no %s plugin and pods with its volumes will not start",
                plugin["driver"],
                plugin["image"],
                plugin["driver"],
            )
            continue
        name, root = imagestore.checkout(image, uuid.uuid4().hex)
        binds = _plugin_root(root, config.state_dir, plugin["endpoint"].removeprefix("unix://"))
        socket_path = plugin["endpoint"].removeprefix("unix://")
        Path(socket_path).parent.mkdir(parents=True, exist_ok=True)
        env = {**image.env, "HOME": "/root"}

        def enter(root: str = root) -> None:
            die_with_kubelet()
            os.chroot(root)
            os.chdir("/")

        with open(Path(config.state_dir) / f"csi-{plugin['driver']}.log", "ab") as out:
            proc = subprocess.Popen(
                plugin["argv"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=enter,
            )
        running.append(RunningPlugin(proc, name, binds))
        deadline = time.monotonic() + 60
        while not os.path.exists(socket_path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"CSI plugin {plugin['driver']} did not start; see csi-{plugin['driver']}.log")
            time.sleep(0.05)
    return running


def _plugin_root(root: str, state_dir: str, socket_path: str) -> list[str]:
    """Bind into the plugin's root what it works on, at the same paths: this node's folder (shared, so mounts
    go both ways), and /proc, /sys and /dev, as a privileged container has them."""
    state = os.path.realpath(state_dir)
    # A shared mount of the node's folder (in the kubelet's own namespace): a bind of it joins its peer group.
    mount(state, state, None, MS_BIND | MS_REC)
    mount(None, state, None, MS_SHARED | MS_REC)
    binds = []
    for source in (state, "/proc", "/sys", "/dev"):
        target = root + source
        os.makedirs(target, exist_ok=True)
        mount(source, target, None, MS_BIND | MS_REC)
        binds.append(target)
    # The endpoint may be a short link to the plugin's folder (socket paths are limited): the same link inside.
    link = os.path.dirname(socket_path)
    if os.path.islink(link):
        os.makedirs(root + os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(root + link):
            os.symlink(os.readlink(link), root + link)
    return binds


def stop_csi_plugins(plugins: list[RunningPlugin]) -> None:
    for plugin in plugins:
        plugin.proc.terminate()
        try:
            plugin.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            plugin.proc.kill()
            plugin.proc.wait()
        for target in reversed(plugin.binds):
            with contextlib.suppress(SetupError):
                umount(target)
        imagestore.release(plugin.working_container)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m maru_localcluster.kubelet CONFIG.json", file=sys.stderr)
        return 2
    config = KubeletConfig.load(args[0])
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s kubelet[{config.node}] %(name)s: %(message)s",
    )
    # Die with whoever started the cluster: a SIGTERM, so the pods still get their shutdown.
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)
    _private_mounts()
    imagestore.sweep()
    Path(config.state_dir, "root").mkdir(parents=True, exist_ok=True)
    plugins = start_csi_plugins(config)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Kubelet(config).run(stop)

    try:
        asyncio.run(serve())
    finally:
        stop_csi_plugins(plugins)
    return 0


if __name__ == "__main__":
    sys.exit(main())
