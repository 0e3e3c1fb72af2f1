"""Start one container as a container runtime would, from a JSON spec the kubelet writes.

    python -m maru_localcluster.podrun run SPEC.json          # the container (this process stays its shim)
    python -m maru_localcluster.podrun exec PID UID GID SPEC.json -- CMD...  # a command in a running container

``run`` creates private mount, PID and UTS namespaces, builds the container's root filesystem, then
forks the container's first process (PID 1 of the new PID namespace) and waits for it:

* the root filesystem is an overlay whose lower layer is the image's root filesystem (a mounted
  working container of an image in this machine's image storage, ``imagestore``), and whose upper
  layer is a fresh directory per container start, so writes never reach the image or the host, a
  restart starts clean, and ``readOnlyRootFilesystem`` is a read-only
  remount of that overlay;
* ``/proc`` is the new PID namespace's own, ``/sys`` the host's read-only, ``/dev`` a small tmpfs
  with the usual device nodes; the pod's volumes, ``/dev/shm``, ``/etc/hosts``, ``/etc/hostname``
  and ``/etc/resolv.conf`` are bind mounts the kubelet prepared;
* the process gets the pod's name as host name, the container's user, groups and capability
  bounding set (root in a container keeps only the runtime's default capabilities), and
  ``no_new_privs`` when privilege escalation is off.

The shim forwards SIGTERM (and other catchable signals) to the container's PID 1. When PID 1 exits the
kernel kills everything else in its PID namespace, and the mounts vanish with the namespace; when the
shim is killed, PID 1 gets SIGKILL (parent-death signal). The shim exits with PID 1's status (128 +
signal when it was killed), and writes PID 1's host pid into ``pid_file`` for the kubelet.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import signal
import sys
from pathlib import Path
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWPID = 0x20000000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_SHARED = 0x100000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

# Device nodes every container gets (what runc puts into a container's /dev).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# The capability bounding set containerd gives a root container by default.
DEFAULT_CAPABILITIES = frozenset(
    {
        "CHOWN",
        "DAC_OVERRIDE",
        "FSETID",
        "FOWNER",
        "MKNOD",
        "NET_RAW",
        "SETGID",
        "SETUID",
        "SETFCAP",
        "SETPCAP",
        "NET_BIND_SERVICE",
        "SYS_CHROOT",
        "KILL",
        "AUDIT_WRITE",
    }
)
CAPABILITY_NUMBERS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "DAC_READ_SEARCH": 2,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "SETPCAP": 8,
    "LINUX_IMMUTABLE": 9,
    "NET_BIND_SERVICE": 10,
    "NET_BROADCAST": 11,
    "NET_ADMIN": 12,
    "NET_RAW": 13,
    "IPC_LOCK": 14,
    "IPC_OWNER": 15,
    "SYS_MODULE": 16,
    "SYS_RAWIO": 17,
    "SYS_CHROOT": 18,
    "SYS_PTRACE": 19,
    "SYS_PACCT": 20,
    "SYS_ADMIN": 21,
    "SYS_BOOT": 22,
    "SYS_NICE": 23,
    "SYS_RESOURCE": 24,
    "SYS_TIME": 25,
    "SYS_TTY_CONFIG": 26,
    "MKNOD": 27,
    "LEASE": 28,
    "AUDIT_WRITE": 29,
    "AUDIT_CONTROL": 30,
    "SETFCAP": 31,
    "MAC_OVERRIDE": 32,
    "MAC_ADMIN": 33,
    "SYSLOG": 34,
    "WAKE_ALARM": 35,
    "BLOCK_SUSPEND": 36,
    "AUDIT_READ": 37,
    "PERFMON": 38,
    "BPF": 39,
    "CHECKPOINT_RESTORE": 40,
}
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


class SetupError(Exception):
    """The container could not be created; the message says which step and why."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {source or fstype} on {target}",
    )


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option})")


def _pivot_root(new_root: str, put_old: str) -> None:
    number = _PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise SetupError(f"pivot_root: unknown syscall number on {platform.machine()}")
    _check(_libc.syscall(number, new_root.encode(), put_old.encode()), f"pivot_root {new_root}")


# --------------------------------------------------------------------------------------------- run


def _target(root: str, path: str) -> str:
    """``path`` inside ``root``, following symlinks as the container will see them (``/var/run`` ->
    ``/run`` stays inside ``root``), so a mount point is never made on the host by mistake."""
    parts = [p for p in path.split("/") if p and p != "."]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, part)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                raise SetupError(f"{path}: too many levels of symbolic links")
            link = os.readlink(candidate)
            parts = [p for p in link.split("/") if p and p != "."] + parts
            if link.startswith("/"):
                resolved = []
            continue
        resolved.append(part)
    return os.path.join(root, *resolved)


def _make_mount_point(target: str, source: str) -> None:
    """A directory, or an empty file when a file is bound (as runc does for /etc/hosts)."""
    if os.path.isdir(source) or not os.path.exists(source):
        os.makedirs(target, exist_ok=True)
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not os.path.exists(target):
        open(target, "a").close()


def _bind(source: str, target: str, readonly: bool, recursive: bool = False) -> None:
    _make_mount_point(target, source)
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if readonly:
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def start_time(pid: int) -> str:
    """When the process started, in clock ticks since boot (``/proc/<pid>/stat``, field 22)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2 :].split()[19]


def build_root(spec: dict[str, Any]) -> str:
    """The container's root filesystem, mounted at ``spec['rootfs']['mountpoint']``; returns that path."""
    layers = spec["rootfs"]
    root = layers["mountpoint"]
    mount(
        "overlay", root, "overlay", 0, f"lowerdir={layers['lower']},upperdir={layers['upper']},workdir={layers['work']}"
    )
    # /proc is mounted by PID 1 itself (it belongs to the new PID namespace).
    os.makedirs(_target(root, "/proc"), exist_ok=True)
    _bind("/sys", _target(root, "/sys"), readonly=True, recursive=True)
    dev = _target(root, "/dev")
    os.makedirs(dev, exist_ok=True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=755,size=65536k")
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", os.path.join(dev, name), readonly=False)
    for link, to in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ):
        os.symlink(to, os.path.join(dev, link))
    # Volumes last and shallow first, so /dev/shm lands inside /dev and a volume can replace it.
    for m in sorted(spec["mounts"], key=lambda m: m["target"].rstrip("/").count("/")):
        target = _target(root, m["target"])
        if m["kind"] == "tmpfs":
            os.makedirs(target, exist_ok=True)
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, m.get("options") or None)
        else:
            _bind(m["source"], target, readonly=bool(m.get("readonly")))
    cwd = spec.get("cwd") or "/"
    os.makedirs(_target(root, cwd), exist_ok=True)
    if spec.get("readonly_root"):
        mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    return root


def _drop_capabilities(keep: set[str]) -> None:
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for number in range(last + 1):
        if number not in {CAPABILITY_NUMBERS[c] for c in keep if c in CAPABILITY_NUMBERS}:
            prctl(PR_CAPBSET_DROP, number)


def _become_container(spec: dict[str, Any], root: str) -> None:
    """In the forked PID 1: finish the namespaces, change root, drop privileges. Never returns on success."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # A mount namespace of its own: pivot_root moves the root of every process in the namespace, and
    # the shim must keep the machine's root (it writes the pid file there, racing this very call).
    unshare(CLONE_NEWNS)
    mount("proc", _target(root, "/proc"), "proc", MS_NOSUID | MS_NODEV)
    hostname = spec.get("hostname") or "localhost"
    _check(_libc.sethostname(hostname.encode(), len(hostname.encode())), "sethostname")
    os.chdir(root)
    # pivot_root(".", ".") stacks the old root under the new one; detaching "." then drops it
    # without needing a directory for it in a possibly read-only root.
    _pivot_root(".", ".")
    umount(".")
    os.chdir(spec.get("cwd") or "/")
    caps = spec.get("capabilities") or {}
    if not caps.get("privileged"):
        keep = set(DEFAULT_CAPABILITIES if spec["uid"] == 0 else ())
        keep |= set(caps.get("add") or [])
        keep -= set(caps.get("drop") or [])
        if "ALL" in (caps.get("drop") or []):
            keep = set(caps.get("add") or [])
        _drop_capabilities(keep)
    if spec.get("no_new_privs"):
        prctl(PR_SET_NO_NEW_PRIVS, 1)
    os.setgroups(spec.get("groups") or [])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
    # Changing credentials clears the parent-death signal: set it again.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    argv = spec["argv"]
    # A bare name is looked up in the container's PATH, in its own root (as runc does).
    os.execvpe(argv[0], argv, spec["env"])


def _join_netns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns {path}")
    finally:
        os.close(fd)


def pause() -> int:
    """A pod's sandbox: holds a new network namespace for the pod's containers until it is killed.

    What the pause container is to a real pod. It dies with the kubelet (parent-death signal).
    """
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        unshare(CLONE_NEWNET)
    except SetupError as err:
        print(f"pod sandbox: {err}", file=sys.stderr, flush=True)
        return 128
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        signal.pause()


def run(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    # If the kubelet dies, so does this shim, and with it the container (see _become_container).
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        if spec.get("netns"):
            # The pod's network namespace, shared by its containers (the sandbox holds it).
            _join_netns(spec["netns"])
        unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS)
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        root = build_root(spec)
    except (SetupError, OSError) as err:
        print(f"container setup failed: {err}", file=sys.stderr, flush=True)
        return 128
    # Signals that arrive before PID 1 exists are remembered and forwarded once it does.
    pending: list[int] = []
    child = 0

    def forward(signum: int, _frame: object) -> None:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)
        else:
            pending.append(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    # Closed in the child by its exec (the pipe is close-on-exec) or its exit: the pid is reported only then,
    # once PID 1 is in the container's root. An exec (a probe, a preStop hook) that entered it earlier ran in
    # the host's root, without the pod's volumes.
    started_r, started_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(started_r)
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        try:
            _become_container(spec, root)
        except FileNotFoundError:
            print(f"exec {spec['argv'][0]}: no such file or directory", file=sys.stderr, flush=True)
            os._exit(127)
        except PermissionError as err:
            print(f"exec {spec['argv'][0]}: {err.strerror}", file=sys.stderr, flush=True)
            os._exit(126)
        except (SetupError, OSError) as err:
            print(f"container start failed: {err}", file=sys.stderr, flush=True)
            os._exit(128)
    os.close(started_w)
    while os.read(started_r, 1):
        pass
    os.close(started_r)
    try:
        # The namespace's inode, and when its PID 1 started: the kernel gives a dead namespace's inode to the
        # next one made (another pod, another cluster on the machine), and the start time tells them apart.
        pid_ns = f"{os.readlink(f'/proc/{child}/ns/pid')}@{start_time(child)}"
    except OSError:  # it exited before its exec (a setup error): nothing can enter it
        pid_ns = ""
    Path(spec["pid_file"]).write_text(f"{child}\n{pid_ns}\n")
    for signum in pending:
        forward(signum, None)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            return 128
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


# --------------------------------------------------------------------------------------------- exec


def exec_in(pid: int, uid: int, gid: int, spec_path: str | None, argv: list[str]) -> int:
    """Run ``argv`` in the namespaces and root of container process ``pid`` (exec probes, preStop hooks),
    with the container's configured environment (from its spec, as ``runc exec`` takes it from the
    container's config): what PID 1's /proc/PID/environ shows is whatever the process left there (a
    program that sets its title overwrites it), and without PATH a command would not resolve as in the
    container (``python3`` found as /bin/python3 in a merged-/usr image misses /usr/local's packages).
    Without a spec (a kubelet started before specs were passed), PID 1's environment as it reads now."""
    env = dict(json.loads(Path(spec_path).read_text())["env"]) if spec_path else _environ_of(pid)
    # Everything about ``pid`` is read first: once in its mount namespace, /proc is the container's, where
    # the pid is another (PID 1).
    fds = [(ns, os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)) for ns in ("net", "uts", "pid", "mnt")]
    try:
        for ns, fd in fds:
            _check(_libc.setns(fd, 0), f"setns {ns}")
    finally:
        for _, fd in fds:
            os.close(fd)
    child = os.fork()
    if child == 0:
        try:
            os.chdir("/")
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.execvpe(argv[0], argv, env)
        except OSError as err:
            print(f"exec {argv[0]}: {err.strerror}", file=sys.stderr, flush=True)
            os._exit(127)
    _, status = os.waitpid(child, 0)
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "run":
        return run(args[1])
    if args == ["pause"]:
        return pause()
    if len(args) >= 7 and args[0] == "exec" and args[5] == "--":
        return exec_in(int(args[1]), int(args[2]), int(args[3]), args[4], args[6:])
    if len(args) >= 6 and args[0] == "exec" and args[4] == "--":
        return exec_in(int(args[1]), int(args[2]), int(args[3]), None, args[5:])
    print("usage: podrun run SPEC.json | podrun pause | podrun exec PID UID GID SPEC.json -- CMD...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
