"""The Kubernetes API of the product: group ``maru.io``, version ``v1alpha1``."""

from maru_operator.api.common import GROUP, VERSION, Condition
from maru_operator.api.inferencegroup import InferenceGroup, InferenceGroupSpec, InferenceGroupStatus
from maru_operator.api.marupool import MaruPool, MaruPoolSpec, MaruPoolStatus

__all__ = [
    "GROUP",
    "VERSION",
    "Condition",
    "InferenceGroup",
    "InferenceGroupSpec",
    "InferenceGroupStatus",
    "MaruPool",
    "MaruPoolSpec",
    "MaruPoolStatus",
]
