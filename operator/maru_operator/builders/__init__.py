"""Pure builders: spec in, desired child objects out. No I/O, no kopf, no Kubernetes client."""

from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import Owner
from maru_operator.builders.group import PoolView
from maru_operator.builders.pool import build_pool_children

__all__ = ["Owner", "PoolView", "build_group_children", "build_pool_children"]
