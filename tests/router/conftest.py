"""The router tests' engines: started once for this folder and shared by every module that routes to real ones.

A vLLM engine start costs tens of seconds on two cores, so the router modules share one work directory, one
pool daemon and two engines: ``prefill_engine`` (``kv_both`` as the operator renders it, prefix caching on,
publishing its KV events) and ``decode_engine`` (``kv_consumer``), both on a tiny float32 Llama with a chat
template. Cases stay apart by their prompts: ``tests.vllm.harness.prompt`` gives seeds that differ (mod 500)
different first tokens, so no two modules' prompts share a block; a case that needs the prefill engine's own
cache empty empties it (``harness.reset_prefix_cache``). Package scope: they stop after the folder's last test,
not at the end of the whole run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from maru_router.revisions import events_topic
from tests.support.servers import Server, free_port
from tests.vllm.harness import PoolDaemon

# The tiny model has no chat template; this one renders each message's words, so a chat prompt is
# the same token ids as its text.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
# The key revision the prefill engine announces as its KV events' topic.
REVISION = "new"

ENGINE_STARTS: list[str] = []


@pytest.fixture(scope="package")
def workdir() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp paths can exceed that.
    path = Path(tempfile.mkdtemp(prefix="maru-router-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="package")
def pool(workdir: Path) -> Iterator[PoolDaemon]:
    daemon = PoolDaemon(workdir)
    yield daemon
    daemon.kill()


@pytest.fixture(scope="package")
def chat_model(workdir: Path) -> str:
    from maru_localcluster.tinymodel import make_tiny_llama

    model = make_tiny_llama(workdir / "tiny-chat")
    config = model / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": CHAT_TEMPLATE}))
    return str(model)


@pytest.fixture(scope="package")
def prefill_events_port() -> int:
    return free_port()


@pytest.fixture(scope="package")
def prefill_engine(
    chat_model: str, pool: PoolDaemon, workdir: Path, prefill_events_port: int, decode_engine: Server
) -> Iterator[Server]:
    # decode_engine only to start it alongside, not waited for: a run of the folder needs both, and on two cores
    # two engines start side by side in less time than one after the other (49 s against 29 + 29 s measured).
    ENGINE_STARTS.append("prefill")
    # Server takes this process's environment; dev mode serves POST /reset_prefix_cache.
    with mock.patch.dict(os.environ, {"VLLM_SERVER_DEV_MODE": "1"}):
        # vLLM binds its publisher only to a wildcard address (a host address makes it connect instead).
        engine = Server("prefill", workdir, chat_model, "kv_both", pool.url, prefix_caching=True,
                        kv_events=f"tcp://*:{prefill_events_port}", kv_events_topic=events_topic(REVISION))  # fmt: skip
    yield engine
    engine.close()


@pytest.fixture(scope="package")
def decode_engine(chat_model: str, pool: PoolDaemon, workdir: Path) -> Iterator[Server]:
    ENGINE_STARTS.append("decode")
    engine = Server("decode", workdir, chat_model, "kv_consumer", pool.url)
    yield engine
    engine.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ENGINE_STARTS:
        terminalreporter.write_line(
            f"tests/router: {len(ENGINE_STARTS)} vLLM engine starts ({', '.join(ENGINE_STARTS)})"
        )
