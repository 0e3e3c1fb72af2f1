"""What a built image must be, read from buildah's local storage: a numeric non-root user, no compiler, and
no CA bundle or build secret in any layer the build added. Each check returns the problems it found, so a
test can assert both that the product's images have none and that a planted defect is named.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Where a Debian image or pip would put a C compiler (the wheel stage's gcc must stay there).
COMPILERS = re.compile(
    r"(usr/(local/)?bin/((\S+-)?gcc(-\d+)?|cc|c\+\+|(\S+-)?g\+\+(-\d+)?|clang\S*)|usr/lib/gcc/\S+/cc1)"
)
# The secret's mount point in a RUN step: buildah leaves an empty file there when the target is missing.
SECRET_PATHS = re.compile(r"(run/secrets(/.*)?|etc/ssl/certs/ca-certificates\.crt)")


def buildah(*args: str, timeout: float = 600) -> str:
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"buildah {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def config(image: str) -> dict:
    return json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]


def diff_ids(image: str) -> list[str]:
    return json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["rootfs"]["diff_ids"]


def user_problems(image: str) -> list[str]:
    user = config(image).get("User", "")
    if not re.fullmatch(r"[1-9]\d*:[1-9]\d*", user):
        return [f"USER is {user or 'unset (root)'}: the image must name a numeric non-root UID:GID"]
    return []


def added_layers(image: str, base: str) -> Iterator[tarfile.TarFile]:
    """The image's layers above those of `base`, each as an open tar (the image is copied out first)."""
    skip = len(diff_ids(base))
    with tempfile.TemporaryDirectory() as tmp:
        buildah("push", "--quiet", "--disable-compression", image, f"oci:{tmp}")
        index = json.loads(Path(tmp, "index.json").read_text())
        manifest = json.loads(blob(tmp, index["manifests"][0]["digest"]).read_text())
        assert diff_ids(image)[:skip] == diff_ids(base), f"{image} is not built on {base}"
        for layer in manifest["layers"][skip:]:
            with tarfile.open(blob(tmp, layer["digest"]), mode="r:*") as tar:
                yield tar


def blob(oci_dir: str, digest: str) -> Path:
    algorithm, _, hex_digest = digest.partition(":")
    return Path(oci_dir, "blobs", algorithm, hex_digest)


def layer_problems(image: str, base: str, secret: bytes) -> list[str]:
    """A compiler, a file at the secret's mount points, or a file holding the build's CA bundle, in any
    layer the build added (a later layer that deletes a file does not take it out of the image)."""
    problems = []
    secret_digest = hashlib.sha256(secret).hexdigest()
    for tar in added_layers(image, base):
        for member in tar:
            path = member.name.removeprefix("./")
            if COMPILERS.fullmatch(path):
                problems.append(f"{path}: a compiler in a runtime image")
            elif SECRET_PATHS.fullmatch(path) and not member.isdir():
                problems.append(f"{path}: the build secret's mount point left in a layer")
            elif member.isfile() and member.size == len(secret):
                data = tar.extractfile(member)
                if data is not None and hashlib.sha256(data.read()).hexdigest() == secret_digest:
                    problems.append(f"{path}: a copy of the build's CA bundle")
    return problems


def run_as_user(image: str, *command: str) -> subprocess.CompletedProcess[str]:
    """`command` in a container of `image`, as the image's USER, without an OCI runtime (chroot)."""
    container = buildah("from", "--pull-never", "--quiet", image).strip()
    try:
        return subprocess.run(
            ["buildah", "run", "--isolation", "chroot", "--user", config(image)["User"], container, "--", *command],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        buildah("rm", container)


def image_id(image: str) -> str:
    """The image's ID (the hash of its config), as the kubelet reports it after ``sha256:``."""
    return buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", image).strip()
