"""How the operator's pods stop: the preStop drain keeps a deleted pod serving until its clients stopped sending.

A vLLM pod deleted in a rollout still gets requests for a while: maru-router drops it only at its next look at
vllm-router's workers, and a request routed just before arrives after. Once signalled, vLLM fails every request it
holds, so the hook must not end on an idle pod before then (it ended after two looks, one second, and the
operator-upgrade e2e saw requests answered 500 'EngineCore encountered an issue').
"""

from __future__ import annotations

import pytest

from maru_common.drain import drain
from maru_operator.builders.group import build_role_deployment, build_router_deployment
from tests.support.specs import GROUP_OWNER, container, flag, group_spec, pool_view


def hooks() -> dict[str, list[str]]:
    """The preStop command of each server container: both vLLM roles and maru-router's pod."""
    spec = group_spec()
    found = {
        role: container(build_role_deployment(spec, role, GROUP_OWNER, pool_view()))["lifecycle"]["preStop"]["exec"][
            "command"
        ]
        for role in ("prefill", "decode")
    }
    router = build_router_deployment(spec, GROUP_OWNER, pool_view())
    assert router is not None
    for c in router["spec"]["template"]["spec"]["containers"]:
        found[c["name"]] = c["lifecycle"]["preStop"]["exec"]["command"]
    return found


def follow_period() -> float:
    router = build_router_deployment(group_spec(), GROUP_OWNER, pool_view())
    assert router is not None
    maru_router = next(c for c in router["spec"]["template"]["spec"]["containers"] if c["command"] == ["maru-router"])
    return float(flag(maru_router["args"], "--follow-upstream-workers"))


def idle_drain(hook: list[str]) -> float:
    """How long the rendered hook holds a server that has nothing in flight (on a scripted clock)."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    metrics = 'vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} 0\n'
    metrics += "maru_router_requests_in_progress 0\n"
    why = drain(
        "http://x/metrics",
        float(flag(hook, "--timeout")),
        min_wait=float(flag(hook, "--min-wait")),
        read=lambda _: metrics,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert why == "drained"
    return now[0]


def test_an_idle_pod_serves_past_maru_routers_next_look_at_the_workers() -> None:
    period = follow_period()
    rendered = hooks()
    assert set(rendered) == {"prefill", "decode", "router", "vllm-router"}
    for name, hook in rendered.items():
        assert idle_drain(hook) > period, (name, hook)


@pytest.mark.parametrize("drain_seconds", [0, 3])
def test_the_least_wait_never_passes_the_drain_budget(drain_seconds: int) -> None:
    spec = group_spec(decode={"termination": {"gracePeriodSeconds": 30, "drainSeconds": drain_seconds}})
    lifecycle = container(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view())).get("lifecycle")
    if drain_seconds == 0:
        assert lifecycle is None
        return
    hook = lifecycle["preStop"]["exec"]["command"]
    assert flag(hook, "--min-wait") == flag(hook, "--timeout") == str(drain_seconds)
