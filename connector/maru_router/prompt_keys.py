"""A prompt's pool keys, computed exactly as an engine computes them for the same request.

Block hashes come from vLLM's own hasher (``get_request_block_hasher`` over a ``Request``, with
``NONE_HASH`` seeded by ``init_none_hash`` as the engine core does, ``PYTHONHASHSEED`` included),
chunk keys from :class:`maru_contracts.keys.PromptKeys`, and the namespace fingerprints, block and
chunk sizes from the producer's own :class:`~maru_contracts.keys.KeyScheme`. Nothing is copied:
a change in either hashing shows up here too.

Not covered: LoRA adapters and multimodal inputs add extra keys to vLLM's block hashes that a
router cannot reproduce from the request body. Such a prompt gets keys no engine stored, so it
looks cold and takes the prefill path: slower than it could be, never wrong.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from maru_contracts.keys import KeyScheme, PromptKeys

_lock = threading.Lock()
_none_hash_algo: str | None = None  # the algorithm vLLM's process-wide NONE_HASH was seeded for


def _hash_fn(algo: str):  # -> Callable[[Any], bytes]
    """vLLM's hash function for ``algo``, with NONE_HASH seeded for it (a process-wide global in vLLM)."""
    global _none_hash_algo
    fn = get_hash_fn_by_name(algo)
    with _lock:
        if _none_hash_algo != algo:
            kv_cache_utils.init_none_hash(fn)
            _none_hash_algo = algo
    return fn


def block_hashes(token_ids: Sequence[int], scheme: KeyScheme, cache_salt: str | None = None) -> list[bytes]:
    """vLLM's block hashes of a prompt, as the engine's scheduler sees them on arrival."""
    hasher = kv_cache_utils.get_request_block_hasher(scheme.hash_block_size, _hash_fn(scheme.hash_algo))
    request = Request(
        request_id="maru-router-coverage",
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=hasher,
    )
    return [bytes(h) for h in request.block_hashes]


def chunk_lookup_keys(
    token_ids: Sequence[int], scheme: KeyScheme, cache_salt: str | None = None, hashes: Sequence[bytes] | None = None
) -> list[bytes]:
    """The prompt's full-chunk keys in the order the engine looks them up (chunk-major, rank-minor);
    ``hashes``: its :func:`block_hashes`, when already computed."""
    keys = PromptKeys(scheme.fingerprints, hash_block_size=scheme.hash_block_size, chunk_tokens=scheme.chunk_tokens)
    if hashes is None:
        hashes = block_hashes(token_ids, scheme, cache_salt)
    keys.update(list(hashes), len(token_ids))
    return keys.lookup_order()
