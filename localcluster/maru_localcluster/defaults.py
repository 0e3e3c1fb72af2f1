"""The defaults kube-apiserver fills into the built-in kinds our operator writes.

An operator that compares its desired children with what it reads back sees these server-added
fields as differences; an emulator without them would hide the endless-update bug that causes.
Covered: Deployments, DaemonSets, StatefulSets, Pods' templates (containers, probes, volumes),
Services (including a clusterIP), Namespaces, Secrets (``stringData`` folded into ``data``). Values
are those of Kubernetes 1.35.
"""

from __future__ import annotations

import base64
import ipaddress
import itertools
from collections.abc import Iterator
from typing import Any

from maru_localcluster.validation import default_deployment_strategy

JsonObj = dict[str, Any]

_cluster_ips: Iterator[int] = itertools.count(10)


def _set(obj: JsonObj, key: str, value: Any) -> None:
    if obj.get(key) is None:
        obj[key] = value


def _probe(probe: JsonObj | None) -> None:
    if not isinstance(probe, dict):
        return
    for key, value in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1), ("failureThreshold", 3)):
        _set(probe, key, value)
    if isinstance(probe.get("httpGet"), dict):
        _set(probe["httpGet"], "scheme", "HTTP")
        _set(probe["httpGet"], "path", "/")


def _container(c: JsonObj) -> None:
    _set(c, "terminationMessagePath", "/dev/termination-log")
    _set(c, "terminationMessagePolicy", "File")
    image = c.get("image") or ""
    tag = image.rsplit("/", 1)[-1].partition(":")[2] if "@" not in image else "digest"
    _set(c, "imagePullPolicy", "Always" if tag in ("", "latest") else "IfNotPresent")
    _set(c, "resources", {})
    for port in c.get("ports") or []:
        _set(port, "protocol", "TCP")
    for env in c.get("env") or []:
        field_ref = (env.get("valueFrom") or {}).get("fieldRef")
        if isinstance(field_ref, dict):
            _set(field_ref, "apiVersion", "v1")
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        _probe(c.get(name))


def pod_spec(spec: JsonObj) -> None:
    _set(spec, "restartPolicy", "Always")
    _set(spec, "terminationGracePeriodSeconds", 30)
    _set(spec, "dnsPolicy", "ClusterFirst")
    _set(spec, "securityContext", {})
    _set(spec, "schedulerName", "default-scheduler")
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if isinstance(c, dict):
            _container(c)
    for volume in spec.get("volumes") or []:
        for kind in ("configMap", "secret"):
            if isinstance(volume.get(kind), dict):
                _set(volume[kind], "defaultMode", 420)
        if isinstance(volume.get("hostPath"), dict):
            _set(volume["hostPath"], "type", "")
        # k8s.io/kubernetes pkg/apis/core/v1 defaults.go SetDefaults_ObjectFieldSelector: every fieldRef, a
        # downwardAPI volume item's (plain or projected) as an env var's.
        projected = (volume.get("projected") or {}).get("sources") or []
        for api in [volume.get("downwardAPI")] + [s.get("downwardAPI") for s in projected if isinstance(s, dict)]:
            for item in (api or {}).get("items") or []:
                if isinstance(item.get("fieldRef"), dict):
                    _set(item["fieldRef"], "apiVersion", "v1")


def _template(spec: JsonObj) -> None:
    template = spec.get("template")
    if isinstance(template, dict):
        template.setdefault("metadata", {})
        if isinstance(template.get("spec"), dict):
            pod_spec(template["spec"])


def apply(group: str, plural: str, obj: JsonObj, old: JsonObj | None = None) -> None:
    """Fill in the server-side defaults of a built-in object, in place (``old``: on updates)."""
    spec = obj.get("spec")
    if (group, plural) == ("", "secrets"):
        # stringData is write-only: kube-apiserver folds it into data (its keys win) and never stores
        # it. Kept as sent, a kubelet reading data saw none of those keys.
        string_data = obj.pop("stringData", None)
        if isinstance(string_data, dict) and string_data:
            obj["data"] = {
                **(obj.get("data") or {}),
                **{k: base64.b64encode(str(v).encode()).decode() for k, v in string_data.items()},
            }
        _set(obj, "type", "Opaque")
        return
    if (group, plural) == ("", "namespaces"):
        obj["spec"] = {"finalizers": ["kubernetes"], **(spec or {})}
        obj["status"] = {"phase": "Terminating" if obj.get("metadata", {}).get("deletionTimestamp") else "Active"}
        return
    if not isinstance(spec, dict):
        return
    if (group, plural) == ("apps", "deployments"):
        _set(spec, "replicas", 1)
        _set(spec, "strategy", {})
        default_deployment_strategy(spec)
        _set(spec, "revisionHistoryLimit", 10)
        _set(spec, "progressDeadlineSeconds", 600)
        _template(spec)
    elif (group, plural) == ("apps", "daemonsets"):
        _set(spec, "updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}})
        _set(spec, "revisionHistoryLimit", 10)
        _template(spec)
    elif (group, plural) == ("apps", "statefulsets"):
        _set(spec, "replicas", 1)
        _set(spec, "podManagementPolicy", "OrderedReady")
        _set(spec, "updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}})
        _set(spec, "revisionHistoryLimit", 10)
        _template(spec)
    elif (group, plural) in (("", "pods"), ("batch", "jobs")):
        if plural == "pods":
            pod_spec(spec)
        else:
            _template(spec)
    elif (group, plural) == ("", "services"):
        _set(spec, "type", "ClusterIP")
        _set(spec, "sessionAffinity", "None")
        _set(spec, "internalTrafficPolicy", "Cluster")
        if spec.get("type") != "ExternalName":
            # An update that leaves the allocated IP out keeps it, as kube-apiserver does.
            old_spec = (old or {}).get("spec") or {}
            for key in ("clusterIP", "clusterIPs"):
                if spec.get(key) is None and old_spec.get(key) is not None:
                    spec[key] = old_spec[key]
            if spec.get("clusterIP") is None:
                spec["clusterIP"] = str(ipaddress.IPv4Address("10.96.0.0") + next(_cluster_ips))
            _set(spec, "clusterIPs", [spec["clusterIP"]])
            _set(spec, "ipFamilies", ["IPv4"])
            _set(spec, "ipFamilyPolicy", "SingleStack")
        for port in spec.get("ports") or []:
            _set(port, "protocol", "TCP")
            _set(port, "targetPort", port.get("port"))
