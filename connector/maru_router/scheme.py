"""The engines' key scheme, as the producers' handoffs announce it, and when to learn it again.

Half of an engine's namespace is only known once its workers registered their KV caches, so only the engine
can say how it keys prompts: prefill returns its scheme with every handoff (``kv_transfer_params``). In front of
another router, which consumes prefill's answers, this router learns it by running the prefill-then-decode path
itself, one request at a time, whenever no scheme is known or the one known is older than ``relearn_s``: a
rollout that changes the engines' keys is followed.
"""

from __future__ import annotations

import logging
import time

from maru_contracts.handoff import HANDOFF_KEY_SCHEME
from maru_contracts.keys import KeyScheme

log = logging.getLogger("maru.router")


class SchemeLearner:
    def __init__(self, relearn_s: float) -> None:
        if relearn_s <= 0:
            raise ValueError(f"router: relearn_s must be > 0, got {relearn_s}")
        self.relearn_s = relearn_s
        self.scheme: KeyScheme | None = None
        self.revision: str | None = None  # the key revision of the prefill that taught the scheme
        self._learnt_at = 0.0  # time.monotonic() of the last handoff that carried a scheme
        self._refreshing = False  # a request is learning the scheme through prefill here

    def stale(self) -> bool:
        return self.scheme is None or time.monotonic() - self._learnt_at >= self.relearn_s

    def may_refresh(self) -> bool:
        """Whether a request could learn the scheme now (none is learning it, and it is unknown or stale)."""
        return not self._refreshing and self.stale()

    def claim_refresh(self) -> bool:
        """Whether this request should learn the scheme through prefill here: one at a time, so requests arriving
        meanwhile keep the upstream router's choice of engines. A claim is given back with :meth:`release`."""
        if not self.may_refresh():
            return False
        self._refreshing = True
        return True

    def release(self) -> None:
        self._refreshing = False

    def learn(self, params: object, revision: str | None = None) -> None:
        """Take the scheme a producer (of key ``revision``, when known) announced with its handoff."""
        if not isinstance(params, dict) or HANDOFF_KEY_SCHEME not in params:
            return
        try:
            scheme = KeyScheme.from_params(params[HANDOFF_KEY_SCHEME])
        except ValueError as err:
            log.warning("ignoring a producer's handoff: %s", err)
            return
        self._learnt_at = time.monotonic()
        self.revision = revision
        if scheme != self.scheme:
            log.info(
                "key scheme learnt from prefill: chunk_tokens=%d hash_block_size=%d hash=%s tp=%d",
                scheme.chunk_tokens,
                scheme.hash_block_size,
                scheme.hash_algo,
                len(scheme.fingerprints),
            )
            self.scheme = scheme
