"""Decode-direct router: a thin OpenAI proxy that skips prefill when the pool already holds the prompt.

The pool is one prefix cache for the fleet. When it holds every full chunk of a prompt, a prefill
round trip only recomputes what decode can load: decode looks the prompt up in the pool on every
request (with or without a producer's handoff), loads the capped hit and computes the tail itself.
So the router asks the pool how many leading chunks of the prompt it holds (one ``lookup`` RPC
over keys computed with vLLM's block hashing and :mod:`maru_contracts.keys`, as the engines
compute them) and sends the request to decode alone when the coverage reaches a threshold;
otherwise it runs prefill then decode, passing ``kv_transfer_params`` as vllm-router does.

The decision only affects speed, never the answer: decode computes whatever it cannot load.

* :mod:`.policy`: the route a request takes and how each mode runs it (pure);
* :mod:`.decide`: the coverage threshold (pure);
* :mod:`.balance`: which engine of a role, by load and by what its own cache holds;
* :mod:`.directory`: the engines, their own caches (:mod:`.locality`, KV events) and key revisions
  (:mod:`.revisions`);
* :mod:`.scheme`: the engines' key scheme, learnt from prefill's handoffs;
* :mod:`.prompt_keys`: a prompt's chunk keys, from vLLM's own block hasher;
* :mod:`.relay`: bounded client bodies, requests relayed to engines, answers streamed back;
* :mod:`.limits`: what one client may make the router hold or compute (body size, deadlines, prompt length);
* :mod:`.metrics`: the router's Prometheus metrics;
* :mod:`.proxy`: the router, which composes them;
* :mod:`.__main__`: the ``maru-router`` command.
"""
