"""The connector's configuration: one model, written by the operator, parsed by the connector.

The operator renders ``--kv-transfer-config`` for both P/D roles through
:func:`kv_transfer_config`; the connector reads ``kv_connector_extra_config`` back through
:meth:`MaruConnectorConfig.from_extra_config`. Prefill and decode therefore can never disagree
on chunk size, pool or namespace. This module must not import vLLM or torch.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CONNECTOR_CLASS = "MaruConnector"
CONNECTOR_MODULE = "maru_connector.vllm"

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

DEFAULT_CHUNK_TOKENS = 256


class ConfigError(ValueError):
    """The connector configuration is invalid; the message names the field and the rule."""


class MaruConnectorConfig(BaseModel):
    """Keys of ``kv_connector_extra_config`` understood by the Maru connector."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    pool_url: str = Field(
        alias="maru_pool_url",
        description="Where the pool's node agent listens: unix:///path/to/pool.sock or tcp://host:port.",
    )
    chunk_tokens: int = Field(
        DEFAULT_CHUNK_TOKENS,
        alias="maru_kv_chunk_tokens",
        gt=0,
        description="Tokens per pool chunk; a positive multiple of the engine's KV block size.",
    )
    cache_namespace: str = Field(
        "",
        alias="maru_cache_namespace",
        max_length=253,
        description="Salt mixed into every chunk key, so tenants sharing a pool never share KV.",
    )
    pool_token_file: str = Field(
        "",
        alias="maru_pool_token_file",
        max_length=4096,
        description="File holding this engine's pool credential, sent in every hello (the operator mounts the "
        "group's credential volume there); empty: send none, for a pool that does not authenticate.",
    )
    rpc_timeout_ms: int = Field(
        500,
        alias="maru_rpc_timeout_ms",
        gt=0,
        le=60_000,
        description="Per-call timeout towards the pool; a slow pool counts as a miss, never a stall.",
    )

    load_async: bool = Field(
        True,
        alias="maru_load_async",
        description=(
            "Load pool hits in the background while the engine keeps stepping (vLLM's asynchronous KV "
            "loads); false loads them inside the step that schedules the request, where vLLM schedules "
            "synchronously (under asynchronous scheduling a failed load inside the step can stop the "
            "engine, and loads stay asynchronous)."
        ),
    )
    handoff_wait_ms: int = Field(
        1000,
        alias="maru_handoff_wait_ms",
        ge=0,
        le=60_000,
        description=(
            "How long a decode request waits for the chunks its prefill announced (prefill commits them "
            "asynchronously) before computing what is still missing."
        ),
    )

    writer_tp: int | None = Field(
        None,
        alias="maru_kv_writer_tp",
        gt=0,
        le=1024,
        description=(
            "Tensor-parallel size of the engines that store the chunks this engine loads (a decode's prefill), "
            "when it differs from this engine's own: each rank then reads the stored head ranges that overlap "
            "its own heads and copies those heads in. Unset: the same as this engine's."
        ),
    )

    @field_validator("pool_url")
    @classmethod
    def _pool_url_scheme(cls, value: str) -> str:
        if value.startswith("unix://"):
            if not value[len("unix://") :].startswith("/"):
                raise ValueError("unix:// URLs need an absolute socket path, e.g. unix:///run/maru/pool.sock")
            return value
        if value.startswith("tcp://"):
            host, sep, port = value[len("tcp://") :].rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("tcp:// URLs need host:port with a port in 1..65535")
            return value
        raise ValueError("must start with unix:// or tcp://")

    @field_validator("pool_token_file")
    @classmethod
    def _token_file_absolute(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError("must be an absolute path (or empty: no credential)")
        return value

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> MaruConnectorConfig:
        """Parse vLLM's ``kv_connector_extra_config``; keys not ours (``maru_`` prefix) are ignored."""
        ours = {k: v for k, v in (extra or {}).items() if k.startswith("maru_")}
        try:
            return cls.model_validate(ours)
        except ValidationError as err:
            raise ConfigError(_describe(err)) from None

    def to_extra_config(self) -> dict[str, Any]:
        # Unset optional keys stay out: a config renders as it did before they existed (no rollout).
        return self.model_dump(by_alias=True, exclude_none=True)

    def check_block_size(self, block_size: int) -> None:
        """Raise when the chunk does not hold a whole number of the engine's KV blocks."""
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise ConfigError(
                f"maru_kv_chunk_tokens: {self.chunk_tokens} must be a positive multiple of the "
                f"engine's block size {block_size} (set --block-size or change the chunk size)"
            )


def kv_transfer_config(role: KVRole, config: MaruConnectorConfig) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object for one role."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        # A chunk that fails its checksum on load is recomputed instead of failing the request
        # (vLLM's default policy is "fail").
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": config.to_extra_config(),
    }


def kv_transfer_config_json(role: KVRole, config: MaruConnectorConfig) -> str:
    return json.dumps(kv_transfer_config(role, config), sort_keys=True, separators=(",", ":"))


def _describe(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        field = ".".join(str(p) for p in item["loc"]) or "kv_connector_extra_config"
        parts.append(f"{field}: {item['msg']}")
    return "invalid Maru connector config: " + "; ".join(parts)
