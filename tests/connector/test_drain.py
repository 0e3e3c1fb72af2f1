"""The vLLM pods' preStop drain: what it reads from vLLM's metrics, and when it stops waiting."""

from __future__ import annotations

import pytest

from maru_common.drain import drain, in_flight, main

EXPOSITION = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a \\"b\\", c"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
"""


def test_sums_running_and_waiting_over_engines() -> None:
    assert in_flight(EXPOSITION) == 6


def test_no_such_metric_is_not_zero() -> None:
    assert in_flight("# nothing\nother_metric 1\n") is None


class Scripted:
    """Answers one exposition per look and keeps the time a look takes."""

    def __init__(self, counts: list[int | Exception]) -> None:
        self.counts = counts
        self.now = 0.0
        self.looks = 0

    def read(self, url: str) -> str:
        value = self.counts[min(self.looks, len(self.counts) - 1)]
        self.looks += 1
        if isinstance(value, Exception):
            raise value
        return f'vllm:num_requests_running{{engine="0"}} {value}\nvllm:num_requests_waiting{{engine="0"}} 0\n'

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def run(counts: list[int | Exception], timeout: float = 60, min_wait: float = 0.0) -> tuple[str, Scripted]:
    s = Scripted(counts)
    return drain("http://x/metrics", timeout, min_wait=min_wait, read=s.read, clock=lambda: s.now, sleep=s.sleep), s


def test_waits_until_two_quiet_looks() -> None:
    why, s = run([3, 1, 0, 1, 0, 0])
    assert why == "drained" and s.looks == 6


def test_an_idle_server_is_held_until_its_clients_stopped_sending() -> None:
    # Idle at the deletion, but a request routed before the routers saw it arrives 3 s later: it must find the
    # server still serving (it ended after the first two looks, and SIGTERM then failed that request).
    why, s = run([0, 0, 0, 1, 0, 0], min_wait=5)
    assert why == "drained" and s.looks == 6 and s.now == 5


def test_gives_up_at_the_timeout() -> None:
    why, s = run([1], timeout=10)
    assert why.startswith("timed out with 1 request")
    assert 10 <= s.now <= 11


@pytest.mark.parametrize("trouble", [ConnectionRefusedError("refused"), OSError("reset")])
def test_a_server_already_gone_is_not_waited_for(trouble: Exception) -> None:
    why, s = run([trouble])
    assert why.startswith("metrics unreadable") and s.looks == 1


def test_main_never_fails_the_hook() -> None:
    # Nothing listens on port 9 of loopback: the hook still exits 0, so the kubelet goes on to SIGTERM.
    assert main(["--port", "9", "--timeout", "5"]) == 0


def test_another_servers_gauge_is_read_by_name() -> None:
    """maru-router's hook names its own gauge; vLLM's series then count for nothing."""
    router = "# TYPE maru_router_requests_in_progress gauge\nmaru_router_requests_in_progress 2.0\n"
    assert in_flight(router + EXPOSITION, ("maru_router_requests_in_progress",)) == 2
    assert in_flight(EXPOSITION, ("maru_router_requests_in_progress",)) is None
