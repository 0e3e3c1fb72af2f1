"""The group's InferencePool (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``).

A gateway whose endpoint picker understands prefill/decode (llm-d's inference scheduler) fronts the group
through it instead of the group's router: the pool selects the vLLM pods of BOTH roles, and the picker
tells them apart by their ``llm-d.ai/role`` label. The router keeps running (it is the group's own front
door and the only place decode-direct happens); the gateway simply does not use it.

Revision coherence during a rollout. Every vLLM pod carries ``maru.io/kv-revision``: a hash of everything its
pool keys derive from (model, revision, dtype, block and chunk size, cache scope, connector settings), equal
on both roles by construction. A picker that pairs a prefill with a decode of the same ``maru.io/kv-revision``
never hands decode a prompt stored under keys it does not look up. One that does not check it still returns
right tokens: a chunk's key is the vLLM block hash keyed with the engine's namespace fingerprint
(``maru_contracts.keys``), so keys of two revisions never collide; decode misses and recomputes the prompt
itself, which costs time, never correctness.

Pure: no I/O. Written only where the CRD is installed (the controller asks discovery first).
"""

from __future__ import annotations

from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.builders.common import Object, Owner, labels, metadata
from maru_operator.builders.group import VLLM_APP, VLLM_PORT, vllm_pods
from maru_operator.names import child_name

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"


def inference_pool_name(group: str) -> str:
    """Named after the group, as its front door Service is: the HTTPRoute's backendRef names it."""
    return child_name(group)


def pool_selector(owner: Owner) -> dict[str, str]:
    """The group's vLLM pods of both roles (not the router's): what the endpoint picker chooses among."""
    return vllm_pods(owner)


def build_inference_pool(spec: InferenceGroupSpec, owner: Owner) -> Object | None:
    """The InferencePool of the group, or None when ``spec.inferencePool`` is off."""
    wanted = spec.inference_pool
    if not wanted.enabled or wanted.endpoint_picker is None:
        return None
    picker = wanted.endpoint_picker
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata(
            owner,
            name=inference_pool_name(owner.name),
            namespace=owner.namespace,
            labels=labels(owner, app=VLLM_APP, component="inference-pool"),
        ),
        "spec": {
            "selector": {"matchLabels": pool_selector(owner)},
            "targetPorts": [{"number": VLLM_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port.number},
                "failureMode": picker.failure_mode,
            },
        },
    }
