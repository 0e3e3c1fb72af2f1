"""Which key revision each engine runs, so prefill and decode are paired only within one revision.

Every vLLM pod the operator renders carries ``maru.io/kv-revision``: a hash of everything its pool keys derive
from, equal on both roles of one spec. During a rollout that changes it, an old prefill stores the prompt under
keys a new decode never looks up: such a pair is not wrong (decode misses and computes the prompt itself) but it
throws the prefill away. So while the engines span more than one revision, maru-router runs prefill then decode
itself, choosing the decode among the prefill's own revision (:func:`pairable`), and while they span one it
leaves the pairing to vllm-router as before.

Each engine announces its revision itself, as the topic of its KV events (:func:`events_topic`, which the
operator puts in the engines' ``--kv-events-config``): the router reads it where it learns where the engine
publishes (vLLM's ``GET /kv_event_sources``). So the router needs no Kubernetes API access (it parses every
client's request and holds no token), and the revision is the one the engine was started with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from maru_contracts.topics import TOPIC_PREFIX, events_topic  # noqa: F401  # events_topic: re-exported for the router's callers


def revision_of(sources: object) -> str | None:
    """The key revision an engine announces in its ``GET /kv_event_sources`` answer (its events' topic); None
    when it announces none, or its ranks disagree."""
    if not isinstance(sources, dict) or not sources:
        return None
    topics = {c.get("topic") if isinstance(c, dict) else None for c in sources.values()}
    if len(topics) != 1:
        return None
    (topic,) = topics
    if not isinstance(topic, str) or not topic.startswith(TOPIC_PREFIX) or topic == TOPIC_PREFIX:
        return None
    return topic[len(TOPIC_PREFIX) :]


def parse_revisions(pairs: Sequence[str]) -> dict[str, str]:
    """``ENGINE_URL=REVISION`` flags as a map of engine URL (no trailing slash) to revision."""
    out: dict[str, str] = {}
    for pair in pairs:
        url, sep, revision = pair.rpartition("=")
        if not sep or not url.startswith(("http://", "https://")) or not revision:
            raise ValueError(f"--engine-revision {pair!r}: must be ENGINE_URL=REVISION, the URL http(s)://host:port")
        out[url.rstrip("/")] = revision
    return out


@dataclass(frozen=True)
class Pairing:
    """Whom a prefill-then-decode request may involve: the prefill engines (indices) whose revision has a decode
    engine, and for each of them the decode engines of its revision."""

    prefill: list[int]
    decode_of: dict[int, list[int]]


def pairable(prefill: Sequence[str], decode: Sequence[str], revisions: Mapping[str, str]) -> Pairing | None:
    """The coherent pairs among engines, by their URLs and ``revisions`` (engine URL -> revision).

    None while the engines with a known revision share one (nothing to constrain: the steady state). Otherwise
    an engine of unknown revision is paired with nothing, and ``Pairing.prefill`` is empty when no revision has
    engines of both roles (mid-rollout, old prefills gone before new decodes are ready).
    """
    rev_p = [revisions.get(u) for u in prefill]
    rev_d = [revisions.get(u) for u in decode]
    if len({r for r in (*rev_p, *rev_d) if r is not None}) <= 1:
        return None
    decode_of = {i: [j for j, rd in enumerate(rev_d) if rd == rp] for i, rp in enumerate(rev_p) if rp is not None}
    decode_of = {i: js for i, js in decode_of.items() if js}
    return Pairing(sorted(decode_of), decode_of)
