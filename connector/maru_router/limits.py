"""What one client may make maru-router hold or compute (its flags' defaults; imported before vLLM is).

Each default is far above what a legitimate request needs: a prompt of 1M token ids is ~7 MiB of JSON, longer
than any served context, and keying it takes about a second of CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 16 << 20
# Bodies being read, parsed or keyed at once, all clients together: parsed, a body of token ids takes several times
# its size, so four bodies at the limit stay far under the router pod's 2 GiB.
MAX_BUFFERED_BYTES = 64 << 20
MAX_PROMPT_TOKENS = 1 << 20
HEADER_TIMEOUT_S = 15.0
BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Limits:
    """The limits one router applies to every client (its flags)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_buffered_bytes: int = MAX_BUFFERED_BYTES

    def __post_init__(self) -> None:
        for name, value in (
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-prompt-tokens", self.max_prompt_tokens),
            ("--header-timeout", self.header_timeout_s),
            ("--body-timeout", self.body_timeout_s),
            ("--max-buffered-bytes", self.max_buffered_bytes),
        ):
            if value <= 0:
                raise ValueError(f"router: {name} must be > 0, got {value}")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                f"router: --max-buffered-bytes {self.max_buffered_bytes} is under --max-body-bytes "
                f"{self.max_body_bytes}: no body at the limit could be read"
            )
