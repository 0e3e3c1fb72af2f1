"""The routing policy, pure: what the router does with a request once it knows what the pool holds of it.

A request goes one of two routes (:class:`Decision`): to one engine alone (``direct``: the pool holds enough of the
prompt, :mod:`.decide`), or through prefill then decode (``pd``). How a ``pd`` request is run depends on the
router's mode and the engines' state; :func:`pd_step` is the one place that order is written:

1. while the engines span more than one key revision (a rollout), prefill then decode here within one revision;
2. in front of another router (``upstream``):
   a. a prefill engine whose own cache holds more of the prompt than the pool runs it here;
   b. one request at a time learns the key scheme through prefill here, when none is known or it is stale;
   c. everything else goes to that router untouched (its discovery and policies choose);
3. alone, prefill then decode here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from maru_router import decide
from maru_router.balance import Prompt

DIRECT, PD = "direct", "pd"


@dataclass(frozen=True)
class Decision:
    route: str  # DIRECT or PD
    # covered | no_key_scheme | short | unsupported | cold | pool_error | tokenize_error | keying_error | disabled
    # | long (a tokenized prompt over max_prompt_tokens: not keyed)
    reason: str
    prompt_tokens: int = 0
    chunks_hit: int = 0
    prompt: Prompt | None = None  # for the choice of engine by locality, when the prompt was hashed


@dataclass(frozen=True)
class Routing:
    """The router's routing flags."""

    min_coverage: float = 1.0  # share of a prompt's full chunks the pool must hold for decode alone
    decode_direct: bool = True  # off: every request goes prefill then decode (locality may still choose engines)
    direct_to_prefill: bool = True  # a covered prompt may go to a prefill engine less busy than every decode one

    def __post_init__(self) -> None:
        decide.chunks_needed(1, 1, self.min_coverage)  # refuses a bad min_coverage now, not on the first request


def after_lookup(prompt_tokens: int, need: int, chunks: int, prompt: Prompt) -> Decision:
    """The route once the pool said it holds ``chunks`` leading chunks of a prompt that needs ``need``."""
    if chunks >= need:
        return Decision(DIRECT, "covered", prompt_tokens, chunks, prompt)
    return Decision(PD, "cold", prompt_tokens, chunks, prompt)


class Step(enum.Enum):
    COHERENT = "coherent"  # prefill then decode here, within one key revision (or one engine alone)
    LOCAL_PREFILL = "local_prefill"  # prefill here on the engine whose own cache holds more than the pool
    REFRESH = "refresh"  # prefill then decode here, to learn the key scheme
    UPSTREAM = "upstream"  # to the upstream router, untouched
    PREFILL_THEN_DECODE = "prefill_then_decode"  # no upstream router: prefill then decode here


def pd_step(*, mid_rollout: bool, upstream: bool, local_prefill: bool, may_refresh: bool) -> Step:
    """How a request routed ``pd`` is run (the order in this module's docstring)."""
    if mid_rollout:
        return Step.COHERENT
    if not upstream:
        return Step.PREFILL_THEN_DECODE
    if local_prefill:
        return Step.LOCAL_PREFILL
    if may_refresh:
        return Step.REFRESH
    return Step.UPSTREAM
