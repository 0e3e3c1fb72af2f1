"""Plain-stdlib HTTP for the demo: health probes, Prometheus scrapes, streamed completions with TTFT.

Stdlib only, so the demo's measurements do not depend on which HTTP client vLLM happens to pull in.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


def get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """Status and body; connection errors count as status 0, so probes can poll without try/except."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (OSError, http.client.HTTPException):
        return 0, b""


def is_up(url: str) -> bool:
    return get(url, timeout_s=2.0)[0] == 200


def get_json(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    status, body = get(url, timeout_s)
    if status != 200:
        raise RuntimeError(f"GET {url} answered {status or 'nothing'}")
    return json.loads(body)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text format → {(name, labels): value}. Enough for counters and gauges."""
    status, body = get(url, timeout_s)
    if status != 200:
        raise RuntimeError(f"GET {url} answered {status or 'nothing'}")
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in body.decode().splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def metric_sum(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    ttft_s: float
    total_s: float
    chunks: int


def stream_completion(base_url: str, body: dict[str, Any], timeout_s: float = 120.0) -> Completion:
    """POST ``/v1/completions`` with ``stream: true``; TTFT is the time to the first non-empty text delta.

    Measured at the client, so it includes everything a user waits for: the router, the prefill
    request, the KV hand-over through the pool, and the decode engine's first step.
    """
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    payload = json.dumps({**body, "stream": True}).encode()
    texts: list[str] = []
    token_ids: list[int] = []
    ttft: float | None = None
    chunks = 0
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST {base_url}/v1/completions answered {resp.status}: {resp.read()[:500]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error from {base_url}: {event['error']}")
            for choice in event.get("choices", []):
                text = choice.get("text") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - start
                texts.append(text)
                token_ids.extend(int(t) for t in choice.get("token_ids") or [])
            chunks += 1
    finally:
        conn.close()
    total = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"{base_url} streamed no text ({chunks} events)")
    return Completion(text="".join(texts), token_ids=token_ids, ttft_s=ttft, total_s=total, chunks=chunks)


def completion(base_url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[str, list[int]]:
    """Non-streamed ``/v1/completions``; the text and token ids (when asked for) of the first choice."""
    req = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({**body, "stream": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            choice = json.loads(resp.read())["choices"][0]
            return str(choice["text"]), [int(t) for t in choice.get("token_ids") or []]
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"POST {base_url}/v1/completions answered {err.code}: {err.read()[:500]!r}") from None
