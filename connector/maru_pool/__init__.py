"""The shared KV memory pool: daemon (``maru-pool``) and client.

Only the client API is exported here; the daemon is started through :mod:`.cli`. Nothing in this
package may import vLLM, torch or the Kubernetes client: the daemon runs in a small image.
"""

from .client import (
    ChecksumMismatch,
    LeaseLost,
    PinTicket,
    PoolAuthError,
    PoolClient,
    PoolError,
    PoolFull,
    PoolUnavailable,
    ReadPin,
    WriteLease,
)

__all__ = [
    "ChecksumMismatch",
    "LeaseLost",
    "PinTicket",
    "PoolAuthError",
    "PoolClient",
    "PoolError",
    "PoolFull",
    "PoolUnavailable",
    "ReadPin",
    "WriteLease",
]
