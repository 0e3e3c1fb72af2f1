"""The CRD upgrade the chart's README documents works after a `helm install`, as a user types it.

Helm creates the CRDs from the chart's crds/ folder under its own field manager, so a later server-side
apply of changed CRDs by `kubectl` conflicts on every field helm set; the documented command must take
those fields over, or the upgrade it describes fails at its first step.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.k8s.fixtures import KubeEmulator, k8s_emulator  # noqa: F401  (fixture)
from tests.support.chart import CHART, NAMESPACE, RELEASE

pytestmark = [pytest.mark.tools, pytest.mark.emulator]

README = CHART / "README.md"


def documented_upgrade() -> list[list[str]]:
    """The commands of the README's block that upgrades the CRDs, split as a shell would."""
    text = README.read_text()
    section = text[text.index("## CRDs") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "no sh block in the README's CRDs section"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_the_documented_crd_upgrade_applies_changed_crds_after_helm_install(
    k8s_emulator: KubeEmulator,  # noqa: F811
    helm: Path,
    tmp_path: Path,
) -> None:
    cluster = k8s_emulator
    cluster.kubectl("create", "namespace", NAMESPACE)
    installed = subprocess.run(
        [str(helm), "install", RELEASE, str(CHART), "--namespace", NAMESPACE],
        capture_output=True,
        text=True,
        timeout=120,
        env=cluster.env(),
        check=False,
    )
    assert installed.returncode == 0, installed.stderr

    # The next release's CRDs: the same files with a changed schema (as a release that adds a field has).
    chart = tmp_path / "charts" / "maru-operator"
    shutil.copytree(CHART / "crds", chart / "crds")
    changed = chart / "crds" / "maru.io_marupools.yaml"
    crd = yaml.safe_load(changed.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["description"] = f"{schema.get('description', '')} (next release)"
    changed.write_text(yaml.safe_dump(crd))

    (apply,) = [cmd for cmd in documented_upgrade() if cmd[0] == "kubectl"]
    assert apply[:2] == ["kubectl", "apply"], apply
    # Run from a folder laid out as the repository, so the README's relative path names the new CRDs.
    result = subprocess.run(
        [*_kubectl(cluster), *apply[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=cluster.env(),
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    stored = cluster.get("customresourcedefinitions.apiextensions.k8s.io", "marupools.maru.io")
    assert stored is not None
    assert stored["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"].endswith("(next release)")


def _kubectl(cluster: KubeEmulator) -> list[str]:
    """kubectl pointed at the emulator, as cluster.kubectl runs it (here from another working directory)."""
    from maru_localcluster.tools import kubectl_path

    return [str(kubectl_path()), f"--kubeconfig={cluster.kubeconfig}", f"--cache-dir={cluster.workdir / 'kube-cache'}"]
