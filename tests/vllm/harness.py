"""Real processes for the engine tests: a ``maru-pool`` daemon and vLLM engines over pipes."""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# Bounds on how long a start or a request may take on a loaded 2-core machine; never asserted on.
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 240.0


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "connector"), str(REPO), e.get("PYTHONPATH", "")) if p)
    e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Keep the two cores for the engines' own work, one thread each.
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


class PoolDaemon:
    """``maru-pool serve`` on a shm file in ``workdir``; can be killed and started again."""

    def __init__(self, workdir: Path, size: str = "1Gi", *, lease_seconds: float | None = None) -> None:
        self.workdir = workdir
        self.size = size
        self.lease_seconds = lease_seconds
        self.url = f"unix://{workdir}/pool.sock"
        self.shm_path = str(workdir / "pool.shm")
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        log = open(self.workdir / "pool.log", "a")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "maru_pool",
                "serve",
                "--listen",
                self.url,
                "--size",
                self.size,
                "--shm-path",
                self.shm_path,
                "--metrics-addr",
                "127.0.0.1:0",
                *(["--lease-seconds", str(self.lease_seconds)] if self.lease_seconds else []),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env(),
        )
        log.close()
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = self.proc.stdout.readline()
                if line.startswith("maru-pool ready"):
                    return
                if not line:
                    break
        self.kill()
        raise AssertionError(f"pool daemon did not start: {(self.workdir / 'pool.log').read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def stats(self) -> dict[str, int]:
        from maru_pool import PoolClient

        with PoolClient(self.url, timeout_s=5) as c:
            return c.stats()


class Engine:
    """A vLLM engine in its own process (``engine_proc.py``)."""

    def __init__(self, name: str, workdir: Path, *, wait: bool = True, **opts: Any) -> None:
        """``wait=False``: return once the process is spawned; :meth:`ready` (or :func:`started`) waits for it,
        so that engines spawned one after another start side by side."""
        self.name = name
        self.log_path = workdir / f"engine-{name}.log"
        log = open(self.log_path, "w")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.engine_proc", json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env(),
            cwd=REPO,
            bufsize=1,
        )
        log.close()
        self.dead = False
        self._buf = b""
        self._ready = False
        self._exiting = False
        if wait:
            self.ready()

    def ready(self) -> Engine:
        """Wait for the engine's "ready" line (once)."""
        if not self._ready:
            answer = self._read(START_TIMEOUT_S)
            assert answer.get("ready"), answer
            self._ready = True
        return self

    def call(self, op: str, timeout_s: float = REQUEST_TIMEOUT_S, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **req}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
        """Token ids per prompt; the connector's background saves have landed when this returns."""
        return self.generate_full(prompts, max_tokens=max_tokens)["tokens"]

    def generate_full(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int = 16,
        handoffs: list[dict[str, Any] | None] | None = None,
        flush: bool = True,
        loras: list[list[Any] | None] | None = None,
    ) -> dict[str, Any]:
        """``tokens`` and ``handoffs`` (each output's kv_transfer_params); see ``engine_proc.generate``."""
        out = self.call("generate", prompts=prompts, max_tokens=max_tokens, handoffs=handoffs, flush=flush, loras=loras)
        assert "tokens" in out, f"engine {self.name} failed: {out.get('error')}\n{out.get('traceback', '')}"
        return out

    def counters(self) -> dict[str, int]:
        return self.call("counters")["counters"]

    def _read(self, timeout_s: float) -> dict[str, Any]:
        # Raw reads from the pipe: a buffered readline would hide complete lines from select().
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(b"@@"):
                    return json.loads(line[2:])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"engine {self.name}: no answer in {timeout_s}s; log tail:\n{self.log_tail()}")
            readable, _, _ = select.select([fd], [], [], min(remaining, 1.0))
            if not readable:
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                self.dead = True
                raise AssertionError(f"engine {self.name} exited; log tail:\n{self.log_tail()}")
            self._buf += data

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def request_exit(self) -> None:
        """Ask the engine to exit; it answers at once and then shuts down, which :meth:`close` waits for."""
        if self.proc.poll() is None and not self.dead and not self._exiting:
            self._exiting = True
            with contextlib.suppress(AssertionError, BrokenPipeError, OSError):
                self.call("exit", timeout_s=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.request_exit()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


@contextlib.contextmanager
def started(*engines: Engine) -> Iterator[tuple[Engine, ...]]:
    """Engines spawned with ``wait=False``, each waited for, and all closed afterwards. Most of a start is one
    process's imports, model load and profiling run, single-threaded: two engines started side by side on two
    cores take about as long as one."""
    try:
        for engine in engines:
            engine.ready()
        yield engines
    finally:
        # All asked first: their shutdowns overlap too.
        for engine in engines:
            engine.request_exit()
        for engine in engines:
            engine.close()


@contextlib.contextmanager
def mla_prefill_and_decode(
    model: str, pool: PoolDaemon, workdir: Path, dtype: str, chunk_tokens: int
) -> Iterator[tuple[Engine, ...]]:
    """An MLA model's producer, keeping its own prefix cache (the reuse a decode must match), and a consumer
    that waits for its handoffs."""
    with started(
        Engine(f"mla-{dtype}-prefill", workdir, wait=False, model=model, dtype=dtype, role="kv_producer",
               pool_url=pool.url, chunk_tokens=chunk_tokens, prefix_caching=True, keep_prefix_caching=True),
        Engine(f"mla-{dtype}-decode", workdir, wait=False, model=model, dtype=dtype, role="kv_consumer",
               pool_url=pool.url, chunk_tokens=chunk_tokens, handoff_wait_ms=20_000),
    ) as both:  # fmt: skip
        yield both


def refused_start(name: str, workdir: Path, **opts: Any) -> str:
    """Start an engine that must refuse to start (as ``Engine`` would), and return what it wrote.

    Its stdin is closed: an engine that starts after all answers "ready" and exits, and the test fails.
    """
    log_path = workdir / f"engine-{name}.log"
    with open(log_path, "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "tests.vllm.engine_proc", json.dumps(opts)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env(),
            cwd=REPO,
            timeout=START_TIMEOUT_S,
        )
    output = done.stdout + log_path.read_text(errors="replace")
    assert '@@{"ready": true}' not in done.stdout, f"engine {name} started; log tail:\n{output[-4000:]}"
    assert done.returncode != 0, output[-4000:]
    return output


def prompt(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids inside the tiny model's vocabulary (ids 3..502)."""
    return [3 + (i * 7919 + seed * 104729) % 500 for i in range(n)]
