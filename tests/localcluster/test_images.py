"""The image table's only two rewrites (the pod's address, `vllm serve`) and Kubernetes' command rules."""

from __future__ import annotations

import pytest

from maru_localcluster.images import ImageNotFound, ImageTable, container_argv, expand
from maru_operator.builders.group import build_role_deployment, build_router_deployment
from maru_operator.builders.pool import build_agent_daemonset, build_metadata_deployment
from maru_operator.cli import _parser
from tests.operator.helpers import GROUP_OWNER, POOL_OWNER, dax_spec, group_spec, pool_view

IP = "127.40.1.7"
TABLE = ImageTable()


def run(container: dict) -> list[str]:
    image = TABLE.resolve(container["image"])
    return image.rewrite(container_argv(container, image), IP)


def only_difference(before: list[str], after: list[str]) -> list[str]:
    return [a for a in after if a not in before]


def test_vllm_serve_becomes_the_api_server_module_with_the_pod_address() -> None:
    c = build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view())["spec"]["template"]["spec"][
        "containers"][0]
    argv = run(c)
    assert argv[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen2.5-7B-Instruct"]
    assert argv[5:-2] == c["args"][1:]  # every rendered argument, unchanged and in order
    assert argv[-2:] == ["--host", IP]


def test_router_binds_the_pod_address_instead_of_every_interface() -> None:
    c = build_router_deployment(group_spec(), GROUP_OWNER)["spec"]["template"]["spec"]["containers"][0]
    argv = run(c)
    assert argv[0] == "vllm-router" and len(argv) == len(c["args"]) + 1
    assert argv[argv.index("--host") + 1] == IP and argv[argv.index("--prometheus-host") + 1] == IP
    assert [a for a in argv[1:] if a != IP] == [a for a in c["args"] if a != "0.0.0.0"]


@pytest.mark.parametrize("build", [
    lambda: build_metadata_deployment(dax_spec(), POOL_OWNER, "ns"),
    lambda: build_agent_daemonset(dax_spec(), POOL_OWNER, "ns"),
])
def test_pool_listens_on_the_pod_address(build) -> None:  # type: ignore[no-untyped-def]
    c = build()["spec"]["template"]["spec"]["containers"][0]
    argv = run(c)
    assert len(argv) == len(c["args"]) + 1
    assert all(a.replace(IP, "0.0.0.0") == b for a, b in zip(argv[1:], c["args"], strict=True))
    assert f"{IP}:9400" in argv


def test_operator_liveness_endpoint_binds_the_pod_address() -> None:
    # The chart's flag (`--liveness=http://0.0.0.0:<port>/healthz`): only the host changes.
    chart = {"args": ["run", "--all-namespaces", "--liveness=http://0.0.0.0:8081/healthz"]}
    argv = run({"image": "ghcr.io/maru-pd/maru-operator:1.0.0", **chart})
    assert argv == ["python", "-m", "maru_operator", *chart["args"][:2], f"--liveness=http://{IP}:8081/healthz"]
    # Without the flag the operator serves its own default on every interface: the same endpoint, at the
    # pod's address (a liveness probe of /healthz must find it).
    default = _parser().parse_args(["run"]).liveness
    assert default.startswith("http://0.0.0.0:")
    argv = run({"image": "ghcr.io/maru-pd/maru-operator:1.0.0"})
    assert argv == ["python", "-m", "maru_operator", "run", "--all-namespaces", "--liveness",
                    default.replace("0.0.0.0", IP)]


def test_command_and_args_follow_kubernetes_rules() -> None:
    image = TABLE.resolve("ghcr.io/maru-pd/maru-pool:9.9.9")
    assert container_argv({}, image) == ["maru-pool", "--help"]
    assert container_argv({"args": ["serve"]}, image) == ["maru-pool", "serve"]
    assert container_argv({"command": ["sh"]}, image) == ["sh"]  # the image's cmd is dropped with a command
    assert expand("$(A)-$(B)-$$(A)", {"A": "x"}) == "x-$(B)-$(A)"


def test_unknown_image_is_an_image_pull_error() -> None:
    with pytest.raises(ImageNotFound, match=r"docker\.io/library/nginx"):
        TABLE.resolve("docker.io/library/nginx:1.27")
