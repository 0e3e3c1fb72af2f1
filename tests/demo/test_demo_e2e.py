"""`python demo/run.py` end to end, as a user runs it: the local cluster, the operator, kubectl, real
vLLM engines (two prefill replicas, one decode) and router in the pods the operator renders.

One run serves every assertion (it takes a minute or two on two cores); a second, short run is
interrupted while the engines start, the moment with the most processes half up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from maru_localcluster.cluster import processes_in
from tests.required import require_local_cluster, require_vllm
from tests.support import imagecheck
from tests.support.e2e import REPO

require_vllm("the demo")
require_local_cluster("the demo")

pytestmark = pytest.mark.vllm

# Generous bounds for a loaded two-core machine; never asserted on, only there to end a hung run.
RUN_TIMEOUT_S = 1500  # a ceiling for a run that never settles; the demo's own waits follow progress


def _parent(pid: int) -> int:
    stat = (Path("/proc") / str(pid) / "stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    try:
        while pid > 1:
            pid = _parent(pid)
            if pid == ancestor:
                return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def _engines_starting(demo_pid: int) -> bool:
    """Both vLLM engines of this demo's group have been started (in its local cluster's pods)."""
    engines = 0
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or b"--kv-transfer-config" not in (entry / "cmdline").read_bytes():
                continue
            engines += _descends_from(int(entry.name), demo_pid)
        except OSError:
            continue
    return engines >= 2


def _run_demo(
    args: list[str], timeout_s: float, interrupt_when: Callable[[int], bool] | None = None
) -> tuple[int, str]:
    """Run the demo; on timeout (or once ``interrupt_when(pid)``) send Ctrl-C, as a user would."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "demo" / "run.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    # Drained on a thread, so a full pipe can never stall the demo while the test waits on it.
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(fd, 4096), b"")), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if interrupt_when and interrupt_when(proc.pid):
                break
            time.sleep(0.1)
    finally:
        # Whatever happened here, the demo gets its Ctrl-C and the chance to clean up after itself.
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
        proc.stdout.close()
    return proc.returncode, b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("demo")
    summary_path, logs = tmp / "summary.json", tmp / "logs"
    # --show-uncapped as well: it proves the exact-multiple prompt really is a killer, so that
    # "decode alive" below is not passing for want of a dangerous request.
    rc, out = _run_demo(["--json-out", str(summary_path), "--keep-logs", str(logs), "--show-uncapped"], RUN_TIMEOUT_S)
    assert summary_path.exists(), f"the demo wrote no summary (exit {rc}):\n{out}"
    return rc, out, json.loads(summary_path.read_text()), logs


def _explain(demo: tuple[int, str, dict[str, Any], Path]) -> str:
    rc, out, _, logs = demo
    tails = "".join(
        f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
        for p in sorted(logs.glob("*.log"))
    )
    return f"exit {rc}; output:\n{out}\nlog tails:{tails}"


def _requests(summary: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    found = [r for r in summary["requests"] if r["kind"] == kind]
    assert found, f"no {kind!r} request in {[r['name'] for r in summary['requests']]}"
    return found


def test_demo_succeeds(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    rc, _, summary, _ = demo
    assert rc == 0 and summary["ok"], _explain(demo)
    assert all(summary["checks"].values()), summary["checks"]


def test_repeated_prompt_is_loaded_from_the_pool(
    demo: tuple[int, str, dict[str, Any], Path], demo_run_module: ModuleType
) -> None:
    _, _, summary, _ = demo
    chunk = demo_run_module.CHUNK_TOKENS
    for again in _requests(summary, "repeated"):
        assert again["error"] is None, _explain(demo)
        assert again["decode"]["from_pool"] > 0, again
        # Everything but the tail after the last full chunk comes from the pool.
        assert again["decode"]["from_pool"] == again["prompt_tokens"] // chunk * chunk, again
    assert summary["pool_status"]["stats"]["commits"] > 0


def test_repeat_on_the_other_prefill_replica_is_a_pool_hit(
    demo: tuple[int, str, dict[str, Any], Path], demo_run_module: ModuleType
) -> None:
    """One prefix cache for the fleet: the router takes turns between the two prefill replicas, so each
    long prompt's repeat lands on the replica that never saw it, which loads it from the pool."""
    _, out, summary, _ = demo
    chunk = demo_run_module.CHUNK_TOKENS
    replicas = set(summary["prefill_pods"])
    assert len(replicas) == 2, summary["prefill_pods"]
    colds, repeats = _requests(summary, "cold"), _requests(summary, "repeated")
    for cold, again in zip(colds, repeats, strict=True):
        n = cold["prompt_tokens"]
        assert {cold["prefill_replica"], again["prefill_replica"]} == replicas, (cold, again)
        # Cold: computed whole where it landed.
        assert cold["prefill"] == {**cold["prefill"], "computed": n, "local_cache": 0, "from_pool": 0}, cold
        # The repeat, on the other replica: no local cache to hit there, every full chunk from the pool.
        assert again["prefill"]["local_cache"] == 0, again
        assert again["prefill"]["from_pool"] == n // chunk * chunk, again
        assert again["prefill"]["computed"] == n % chunk, again
    assert summary["checks"]["fleet_hit_on_other_prefill_replica"] is True
    verdict = next(line for line in out.splitlines() if line.startswith("repeat on the other prefill replica:"))
    assert verdict.startswith(f"repeat on the other prefill replica: {repeats[0]['prefill']['from_pool']} of ")
    assert "(fleet hit" in verdict and verdict.endswith(": yes"), verdict


def test_reference_is_a_recompute(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    """The reference is salted: neither its replica's prefix cache nor the pool may supply any of it."""
    _, _, summary, _ = demo
    ref = summary["reference"]
    assert ref["error"] is None and ref["prefill_replica"] in summary["prefill_pods"], ref
    assert ref["prefill"] == {**ref["prefill"], "computed": ref["prompt_tokens"], "local_cache": 0, "from_pool": 0}, ref
    # Asked of the replica that served the same prompt cold: unsalted, it would have been a cache hit.
    (cold,) = [r for r in _requests(summary, "cold") if r["name"].startswith("long #1,")]
    assert ref["prefill_replica"] == cold["prefill_replica"]


def test_repeated_prompt_gives_the_same_tokens(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    _, _, summary, _ = demo
    colds, repeats = _requests(summary, "cold"), _requests(summary, "repeated")
    assert len(colds) == len(repeats)
    for cold, again in zip(colds, repeats, strict=True):
        assert cold["token_ids"] and len(cold["token_ids"]) > 1, cold
        assert cold["token_ids"] == again["token_ids"]
        assert cold["text"] == again["text"]
    # Different prompts, different answers: the comparison above can tell outputs apart.
    assert len({tuple(c["token_ids"]) for c in colds}) == len(colds)
    # And the same as a prefill engine recomputing it alone, with no KV from the pool.
    assert summary["reference"]["token_ids"] == colds[0]["token_ids"]


def test_decode_survives_the_exact_multiple_prompt(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    _, _, summary, _ = demo
    exact = _requests(summary, "exact")[0]
    assert exact["error"] is None, _explain(demo)
    n = exact["prompt_tokens"]
    # Every chunk was in the pool, yet the decode engine was left work to do: the capped hit.
    assert 0 < exact["decode"]["from_pool"] < n
    assert exact["decode"]["from_pool"] + exact["decode"]["computed"] == n
    assert summary["decode_health_after_exact"] == 200
    (follow,) = _requests(summary, "follow-up")
    assert follow["error"] is None and follow["text"]
    # Its repeat landed on the other prefill replica, which took the same capped hit from the pool.
    first, again = _requests(summary, "exact")
    assert again["error"] is None and again["prefill_replica"] != first["prefill_replica"], (first, again)
    assert 0 < again["prefill"]["from_pool"] < n
    assert again["prefill"]["from_pool"] + again["prefill"]["computed"] == n
    # Every engine is up after it.
    assert set(summary["prefill_health_after_exact"]) == set(summary["prefill_pods"])
    assert set(summary["prefill_health_after_exact"].values()) == {200}
    assert summary["prefill_restarts"] == 0


def test_connector_counters_agree_with_vllms_accounting(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    _, _, summary, _ = demo
    decode = summary["connector"].get("decode", {})
    if "hit_tokens" not in decode:
        pytest.fail(f"the decode engine exports no vllm:maru_connector_* counters: {summary['connector']}")
    # Two independent ledgers of the same tokens: the connector's, and vLLM's per-source prompt counts.
    from_pool = sum(r["decode"].get("from_pool", 0) for r in summary["requests"] if r["decode"])
    assert decode["hit_tokens"] == from_pool
    assert decode["loaded_chunks"] > 0
    assert decode.get("load_failed_chunks", 0) == 0 and decode.get("checksum_mismatches", 0) == 0
    prefills = [summary["connector"][replica] for replica in summary["prefill_pods"]]
    # The prefill replicas' loads, in both ledgers too (the reference is a prefill-only request).
    prefill_from_pool = sum(r["prefill"].get("from_pool", 0) for r in [*summary["requests"], summary["reference"]])
    assert sum(p["hit_tokens"] for p in prefills) == prefill_from_pool > 0
    assert all(p.get("load_failed_chunks", 0) == 0 and p.get("checksum_mismatches", 0) == 0 for p in prefills)
    # Every chunk in the pool was stored by one replica or the other, once.
    assert sum(p["saved_chunks"] for p in prefills) == summary["pool_status"]["stats"]["commits"]


def test_without_the_cap_the_same_prompt_kills_decode(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    _, _, summary, logs = demo
    uncapped = summary["uncapped"]
    assert uncapped["died"], (uncapped, _explain(demo))
    assert "num_new_tokens > 0" in (logs / "decode-uncapped.log").read_text(errors="replace")


def test_prints_progress_the_cluster_and_the_table(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    _, out, _, _ = demo
    assert "[1/9]" in out and "[9/9]" in out
    assert "$ kubectl get mpool,ig -A" in out
    pool_row = next(line for line in out.splitlines() if line.startswith("marupool.maru.io/local-shm"))
    assert pool_row.split()[1:3] == ["shm", "1/1"] and "True" in pool_row
    assert any(
        line.startswith("llm ") and "inferencegroup.maru.io/tiny" in line and "True" in line
        for line in out.splitlines()
    )
    assert "decode from pool/computed" in out
    assert "TTFT through the router" in out
    assert "decode engine alive after it" in out and "prefill engines alive after it (/health A 200 B 200" in out
    assert "prefill replicas (vllm-router takes turns): A = tiny-prefill-" in out


def test_every_container_ran_from_an_image_the_checkout_built(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    """The pods ran the four images `make images` built, by the references the operator renders, and
    nothing from this machine's filesystem (that is an image the table knew: its ID starts local://)."""
    _, out, summary, _ = demo
    built = summary["images_built"]
    assert set(built) == {"operator", "pool", "router", "vllm"}
    ran = summary["images_run"]
    # The operator's pod (the chart's Deployment) too: the four are every image the pods named.
    assert set(ran) == set(built.values()), ran
    for ref, entry in ran.items():
        assert entry["imageID"] == "sha256:" + imagecheck.image_id(ref), (ref, entry)
    assert any(c.startswith("tiny-decode-") and c.endswith("/vllm") for c in ran[built["vllm"]]["containers"]), ran
    assert "Images the pods ran" in out and built["vllm"] in out


def test_no_process_or_mount_is_left_behind(demo: tuple[int, str, dict[str, Any], Path]) -> None:
    _, _, summary, _ = demo
    assert len(summary["pid_namespaces"]) >= 5  # pool agent, 2 prefill, decode, router
    assert summary["leftover_pids"] == []
    assert processes_in(set(summary["pid_namespaces"])) == []
    assert summary["workdir"] not in Path("/proc/self/mountinfo").read_text()
    assert not Path(summary["workdir"]).exists()


def test_ctrl_c_while_engines_start_stops_everything(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    rc, out = _run_demo(["--json-out", str(summary_path)], RUN_TIMEOUT_S, interrupt_when=_engines_starting)
    assert rc == 128 + signal.SIGINT, out
    assert "interrupted" in out
    summary = json.loads(summary_path.read_text())
    assert summary["pid_namespaces"], out
    assert processes_in(set(summary["pid_namespaces"])) == []
    assert not Path(summary["workdir"]).exists()
