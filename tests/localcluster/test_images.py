"""Kubernetes' rules for a container's command, as the kubelet applies them to an image's config."""

from __future__ import annotations

from maru_localcluster.images import Image, container_argv, expand

POOL = Image("ghcr.io/maru-pd/maru-pool:9.9.9", "sha256:0", entrypoint=("maru-pool",), cmd=("--help",))


def test_command_and_args_follow_kubernetes_rules() -> None:
    assert container_argv({}, POOL) == ["maru-pool", "--help"]
    assert container_argv({"args": ["serve"]}, POOL) == ["maru-pool", "serve"]
    assert container_argv({"args": []}, POOL) == ["maru-pool"]  # an empty args list still replaces the cmd
    assert container_argv({"command": ["sh"]}, POOL) == ["sh"]  # the image's cmd is dropped with a command
    assert container_argv({"command": ["sh"], "args": ["-c", "true"]}, POOL) == ["sh", "-c", "true"]


def test_variable_references_expand_as_the_kubelet_expands_them() -> None:
    assert expand("$(A)-$(B)-$$(A)", {"A": "x"}) == "x-$(B)-$(A)"
    assert expand("$(A", {"A": "x"}) == "$(A"
