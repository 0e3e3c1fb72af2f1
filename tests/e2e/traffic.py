"""Requests to the engines and the router the way a client sends them, and vLLM's own counters."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

TIMEOUT_S = 180.0
OUTPUT_TOKENS = 8
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary (4..503: no special token), fixed by ``seed``."""
    return [4 + (i * 7919 + seed * 104729) % 500 for i in range(n)]


def complete(base_url: str, prompt_ids: list[int], model: str = "tiny") -> list[int]:
    """Greedy, fixed-length completion; the output's token ids."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        base_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            choice = json.loads(resp.read())["choices"][0]
    except urllib.error.HTTPError as err:
        raise AssertionError(f"POST {base_url}/v1/completions answered {err.code}: {err.read()[:500]!r}") from None
    ids = [int(t) for t in choice.get("token_ids") or []]
    assert len(ids) == OUTPUT_TOKENS, choice
    return ids


def counter(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples whose labels include ``labels``."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def from_pool(engine_url: str) -> float:
    """Prompt tokens whose KV an engine loaded through its KV connector (vLLM's own accounting)."""
    return counter(engine_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def health(base_url: str) -> int:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0
