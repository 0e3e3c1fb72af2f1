"""Images from this machine's image storage (buildah's, where ``make images`` puts them), run as they ship.

An image is found by the reference a pod names, exactly (``ghcr.io/maru-pd/maru-pool:0.1.0``); its
config gives the container's entrypoint, cmd, user, environment and working directory. Each container
start gets a working container of its own (``buildah from --pull-never``), mounted in the kubelet's
private mount namespace: that mount is the lower layer of the container's overlay (``podrun``), so the
container sees the image's files and nothing of this machine's, and writes land in its own upper layer.
The working container is removed when the container exits; those of a kubelet that was killed are
removed by the next kubelet that starts on this machine.

Nothing is pulled: no registry is reachable from the test bed, so an image that was not built is what a
failed pull is on a node (``ErrImagePull``, then ``ImagePullBackOff``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from maru_localcluster.images import Image, ImageNotFound

log = logging.getLogger("kubelet.images")

# Working containers of this test bed: the kubelet's pid, then the container's id.
PREFIX = "maru-lc-"
_NAME = re.compile(rf"{PREFIX}(\d+)-[0-9a-f]+")
# A runtime's PATH for an image whose config sets none (containerd's default).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class StoreError(RuntimeError):
    """buildah failed at something other than finding the image."""


class UserNotFound(LookupError):
    """The image's USER names a user or group its own files do not have (CreateContainerError)."""


def available() -> bool:
    return shutil.which("buildah") is not None


def _buildah(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False)


def inspect(reference: str) -> Image | None:
    """The image stored under ``reference``, or None when there is none."""
    done = _buildah("inspect", "--type", "image", reference)
    if done.returncode != 0:
        if "image not known" in done.stderr or "not found" in done.stderr or "unable to" in done.stderr:
            return None
        raise StoreError(f"buildah inspect {reference}: {done.stderr.strip()[-500:]}")
    data = json.loads(done.stdout)
    config = data["OCIv1"].get("config") or {}
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    env.setdefault("PATH", DEFAULT_PATH)
    return Image(
        repository=reference,
        image_id=f"sha256:{data['FromImageID']}",
        entrypoint=tuple(config.get("Entrypoint") or ()),
        cmd=tuple(config.get("Cmd") or ()),
        user=config.get("User") or "",
        env=env,
        workdir=config.get("WorkingDir") or "/",
        description=f"image {reference} from this machine's image storage",
    )


def checkout(image: Image, container_id: str) -> tuple[str, str]:
    """A working container of ``image``, mounted: (its name, its root filesystem)."""
    name = f"{PREFIX}{os.getpid()}-{container_id}"
    done = _buildah("from", "--pull-never", "--quiet", "--name", name, image.image_id.removeprefix("sha256:"))
    if done.returncode != 0:
        if "image not known" in done.stderr:
            raise ImageNotFound(f"image {image.repository!r} left this machine's image storage")
        raise StoreError(f"buildah from {image.repository}: {done.stderr.strip()[-500:]}")
    mounted = _buildah("mount", name)
    if mounted.returncode != 0:
        release(name)
        raise StoreError(f"buildah mount {name}: {mounted.stderr.strip()[-500:]}")
    return name, mounted.stdout.strip()


def release(name: str) -> None:
    """Unmount and remove a working container (one already gone is fine). It runs in a thread its caller
    may stop waiting for, so it retries and reports on its own: buildah can fail on a storage race with
    another buildah (another cluster's kubelet, a build) and succeed a moment later."""
    problem = ""
    for attempt in range(5):
        try:
            done = _buildah("rm", name)
        except subprocess.TimeoutExpired:
            problem = "timed out"
            continue
        if done.returncode == 0 or "container not known" in done.stderr:
            return
        problem = done.stderr.strip()[-500:]
        time.sleep(0.5 * (attempt + 1))
    log.warning("buildah rm %s: %s", name, problem)


def sweep() -> None:
    """Remove the working containers of kubelets that no longer run (killed before they could)."""
    done = _buildah("containers", "--all", "--noheading", "--format", "{{.ContainerName}}")
    for name in done.stdout.split():
        match = _NAME.fullmatch(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            release(name)


def user_ids(user: str, root: str) -> tuple[int, int]:
    """The image's ``User`` (``uid``, ``uid:gid``, ``name`` or ``name:group``) as numbers, names looked up
    in the image's own /etc/passwd and /etc/group, as a container runtime does; empty is root."""
    name, _, group = user.partition(":")
    passwd = _table(root, "etc/passwd")
    if not name:
        uid, gid = 0, 0
    else:
        entry = next((f for f in passwd if name in (f[0], f[2])), None)
        if entry is None and not name.isdigit():
            raise UserNotFound(f"unable to find user {name}: no matching entries in the image's /etc/passwd")
        uid = int(name) if name.isdigit() else int(entry[2])  # type: ignore[index]
        gid = int(entry[3]) if entry is not None else 0
    if group:
        found = next((f for f in _table(root, "etc/group") if group in (f[0], f[2])), None)
        if found is None and not group.isdigit():
            raise UserNotFound(f"unable to find group {group}: no matching entries in the image's /etc/group")
        gid = int(group) if group.isdigit() else int(found[2])  # type: ignore[index]
    return uid, gid


def home_of(uid: int, root: str) -> str:
    """The user's home in the image's /etc/passwd ("/" when it has none), as a runtime sets HOME."""
    for fields in _table(root, "etc/passwd"):
        if len(fields) > 5 and fields[2] == str(uid):
            return fields[5] or "/"
    return "/"


def _table(root: str, path: str) -> list[list[str]]:
    """The colon-separated lines of one of the image's files (none when it has no such file)."""
    try:
        lines = Path(root, path).read_text().splitlines()
    except OSError:
        return []
    return [fields for fields in (line.split(":") for line in lines) if len(fields) > 3]
