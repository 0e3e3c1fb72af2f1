"""What one client may make maru-router hold or compute (its flags' defaults; imported before vLLM is).

Each default is far above what a legitimate request needs: a prompt of 1M token ids is ~7 MiB of JSON, longer
than any served context, and keying it takes about a second of CPU.
"""

from __future__ import annotations

MAX_BODY_BYTES = 16 << 20
# Bodies being read, parsed or keyed at once, all clients together: parsed, a body of token ids takes several times
# its size, so four bodies at the limit stay far under the router pod's 2 GiB.
MAX_BUFFERED_BYTES = 64 << 20
MAX_PROMPT_TOKENS = 1 << 20
HEADER_TIMEOUT_S = 15.0
BODY_TIMEOUT_S = 60.0
