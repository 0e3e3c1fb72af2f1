"""The image table's only rewrite (`vllm serve`) and Kubernetes' command rules."""

from __future__ import annotations

import pytest

from maru_localcluster.images import ImageNotFound, ImageTable, container_argv, expand
from maru_operator.builders.group import build_role_deployment, build_router_deployment
from maru_operator.builders.pool import build_agent_daemonset, build_metadata_deployment
from tests.support.specs import GROUP_OWNER, POOL_OWNER, dax_spec, group_spec, pool_view

TABLE = ImageTable()


def run(container: dict) -> list[str]:
    image = TABLE.resolve(container["image"])
    return image.rewrite(container_argv(container, image))


def test_vllm_serve_becomes_the_api_server_module_and_nothing_else_changes() -> None:
    c = build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view())["spec"]["template"]["spec"][
        "containers"
    ][0]
    argv = run(c)
    init = c["command"][: c["command"].index("vllm")]  # the operator's init stays in front
    server = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen2.5-7B-Instruct"]
    assert argv[: len(init) + 5] == [*init, *server]
    assert argv[len(init) + 5 :] == c["args"][1:]  # every rendered argument, unchanged and in order: no address added


@pytest.mark.parametrize(
    "build",
    [
        lambda: build_router_deployment(group_spec(), GROUP_OWNER),
        lambda: build_metadata_deployment(dax_spec(), POOL_OWNER, "ns"),
        lambda: build_agent_daemonset(dax_spec(), POOL_OWNER, "ns"),
    ],
)
def test_servers_run_exactly_as_rendered_binding_every_interface(build) -> None:  # type: ignore[no-untyped-def]
    # Each pod has a network namespace of its own, so what binds 0.0.0.0 in a cluster binds it here too.
    c = build()["spec"]["template"]["spec"]["containers"][0]
    image = TABLE.resolve(c["image"])
    assert run(c) == container_argv(c, image)
    assert any("0.0.0.0" in a for a in c["args"])


def test_command_and_args_follow_kubernetes_rules() -> None:
    image = TABLE.resolve("ghcr.io/maru-pd/maru-pool:9.9.9")
    assert container_argv({}, image) == ["maru-pool", "--help"]
    assert container_argv({"args": ["serve"]}, image) == ["maru-pool", "serve"]
    assert container_argv({"command": ["sh"]}, image) == ["sh"]  # the image's cmd is dropped with a command
    assert expand("$(A)-$(B)-$$(A)", {"A": "x"}) == "x-$(B)-$(A)"


def test_unknown_image_is_an_image_pull_error() -> None:
    with pytest.raises(ImageNotFound, match=r"docker\.io/library/nginx"):
        TABLE.resolve("docker.io/library/nginx:1.27")
