"""Events (core/v1) as controllers and kubelets record them, with the API server's aggregation by count."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

JsonObj = dict[str, Any]


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(
    obj: JsonObj,
    reason: str,
    message: str,
    *,
    component: str,
    type_: str = "Normal",
    host: str | None = None,
    field_path: str | None = None,
) -> JsonObj:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    involved = {
        "apiVersion": obj.get("apiVersion", "v1"),
        "kind": obj.get("kind", ""),
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "resourceVersion": meta.get("resourceVersion"),
    }
    if field_path:
        involved["fieldPath"] = field_path
    stamp = now()
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": {k: v for k, v in involved.items() if v is not None},
        "reason": reason,
        "message": message,
        "type": type_,
        "count": 1,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "source": {"component": component, **({"host": host} if host else {})},
        "reportingComponent": component,
        "reportingInstance": host or component,
    }


class Recorder:
    """Remembers the events it wrote, so a repeated one bumps ``count`` instead of piling up."""

    def __init__(self) -> None:
        # (object uid, reason, message) -> (namespace, event name, count)
        self._seen: dict[tuple[str, str, str], tuple[str, str, int]] = {}

    def repeat_of(self, obj: JsonObj, reason: str, message: str) -> tuple[str, str, int] | None:
        return self._seen.get(((obj.get("metadata") or {}).get("uid", ""), reason, message))

    def remember(self, obj: JsonObj, reason: str, message: str, namespace: str, name: str, count: int) -> None:
        self._seen[((obj.get("metadata") or {}).get("uid", ""), reason, message)] = (namespace, name, count)

    def forget(self, uid: str) -> None:
        for key in [k for k in self._seen if k[0] == uid]:
            del self._seen[key]
