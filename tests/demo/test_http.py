"""The demo's Prometheus reading: the numbers in its table are only as right as this parser."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType

import pytest

METRICS = b"""# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 6221.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 6144.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="tiny",source="external_kv_transfer"} 256.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="tiny",source="local_compute"} 1.79e+09
vllm:time_to_first_token_seconds_sum{engine="0",model_name="a \\"quoted\\", name"} 1.25
maru_pool_hits_total 12
not a sample line
"""


@pytest.fixture
def metrics_url() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = METRICS if self.path == "/metrics" else b"nope"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def demo_http(demo_run_module: ModuleType) -> ModuleType:
    import demo_http

    return demo_http


def test_sums_by_labels(metrics_url: str, demo_http: ModuleType) -> None:
    samples = demo_http.scrape(metrics_url + "/metrics")
    by_source = "vllm:prompt_tokens_by_source_total"
    assert demo_http.metric_sum(samples, by_source, source="local_compute") == 6221
    # Summed over engines, and never mixed up with the *_created timestamps of the same family.
    assert demo_http.metric_sum(samples, by_source, source="external_kv_transfer") == 6400
    assert demo_http.metric_sum(samples, by_source, source="external_kv_transfer", engine="1") == 256
    assert demo_http.metric_sum(samples, "vllm:time_to_first_token_seconds_sum") == 1.25
    assert demo_http.metric_sum(samples, "maru_pool_hits_total") == 12
    assert demo_http.metric_sum(samples, "absent_total") == 0


def test_a_bad_status_is_an_error_and_a_dead_port_is_down(metrics_url: str, demo_http: ModuleType) -> None:
    with pytest.raises(RuntimeError, match="404"):
        demo_http.scrape(metrics_url + "/elsewhere")
    assert demo_http.is_up(metrics_url + "/metrics")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert not demo_http.is_up(f"http://127.0.0.1:{free}/health")
