"""The emulator behaves like kube-apiserver where our operator, kopf and kubectl depend on it."""

from __future__ import annotations

import json
import pathlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from maru_localcluster.apiserver import ApiError, merge_patch, parse_label_selector, strategic_merge_patch
from maru_localcluster.server import KubeEmulator, running_emulator
from maru_localcluster.simcontrollers import KubeControllers

pytestmark = pytest.mark.emulator

GROUP = "test.example.com"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wdg"],
            "categories": ["gadgets"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1},
                                    "color": {"type": "string", "enum": ["red", "blue"], "default": "blue"},
                                    "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                },
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.color != 'red' || self.size > 1",
                                        "fieldPath": ".size",
                                        "message": "red widgets need a size above 1",
                                    },
                                    {"rule": "self.size >= oldSelf.size", "message": "widgets never shrink"},
                                ],
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, size: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"size": size, **spec},
    }


@pytest.fixture
def kube(k8s_emulator: KubeEmulator) -> KubeEmulator:
    k8s_emulator.create(CRD)
    return k8s_emulator


def _dump(tmp: pathlib.Path, name: str, *docs: dict[str, Any]) -> str:
    path = tmp / name
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


# -------------------------------------------------------------------------------------------------
# kubectl


@pytest.mark.tools
def test_kubectl_apply_crd_then_custom_resource(k8s_emulator: KubeEmulator, tmp_path: pathlib.Path) -> None:
    k8s_emulator.kubectl("apply", "--validate=false", "-f", _dump(tmp_path, "crd.yaml", CRD))
    k8s_emulator.kubectl("apply", "--validate=false", "-f", _dump(tmp_path, "w.yaml", widget("w1", 3)))

    out = k8s_emulator.kubectl("get", "wdg").stdout
    assert "w1" in out
    assert "w1" in k8s_emulator.kubectl("get", "gadgets").stdout
    assert "w1" in k8s_emulator.kubectl("get", "widgets.test.example.com", "-o", "name").stdout

    # A second apply with a change goes through the last-applied annotation and a merge patch.
    k8s_emulator.kubectl("apply", "--validate=false", "-f", _dump(tmp_path, "w.yaml", widget("w1", 5)))
    obj = k8s_emulator.get("widgets.test.example.com", "w1", "default")
    assert obj is not None
    assert obj["spec"]["size"] == 5
    assert obj["metadata"]["generation"] == 2
    assert "kubectl.kubernetes.io/last-applied-configuration" in obj["metadata"]["annotations"]

    # kubectl's default --validate=strict makes the server reject unknown fields instead of pruning them.
    typo = _dump(tmp_path, "typo.yaml", widget("w1", 5, sise=6))
    rejected = k8s_emulator.kubectl("apply", "-f", typo, check=False)
    assert rejected.returncode != 0 and 'unknown field "spec.sise"' in rejected.stderr
    k8s_emulator.kubectl("apply", "--validate=false", "-f", typo)  # pruned silently

    got = json.loads(k8s_emulator.kubectl("get", "wdg", "w1", "-o", "json").stdout)
    assert got["metadata"]["uid"] == obj["metadata"]["uid"]

    k8s_emulator.kubectl("delete", "wdg", "w1")
    assert k8s_emulator.get("widgets.test.example.com", "w1", "default") is None


@pytest.mark.tools
def test_kubectl_apply_builtin_kinds_with_strategic_merge(k8s_emulator: KubeEmulator, tmp_path: pathlib.Path) -> None:
    deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "containers": [
                        {
                            "name": "a",
                            "image": "a:1",
                            "env": [{"name": "FOO", "value": "1"}, {"name": "BAR", "value": "2"}],
                        },
                        {"name": "b", "image": "b:1"},
                    ]
                },
            },
        },
    }
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"k": "v"}}
    k8s_emulator.kubectl("apply", "--validate=false", "-f", _dump(tmp_path, "a.yaml", deploy, cm))

    deploy["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "BAR", "value": "3"}]
    deploy["spec"]["template"]["spec"]["containers"][1]["image"] = "b:2"
    k8s_emulator.kubectl("apply", "--validate=false", "-f", _dump(tmp_path, "a.yaml", deploy, cm))

    got = k8s_emulator.get("deployments.apps", "web", "default")
    assert got is not None
    containers = got["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["a", "b"]
    assert containers[0]["env"] == [{"name": "BAR", "value": "3"}]
    assert containers[1]["image"] == "b:2"
    assert got["metadata"]["generation"] == 2
    assert "cfg" in k8s_emulator.kubectl("get", "cm").stdout
    assert "web" in k8s_emulator.kubectl("get", "all").stdout

    k8s_emulator.kubectl("scale", "deployment/web", "--replicas=4")
    scaled = k8s_emulator.get("deployments.apps", "web", "default")
    assert scaled is not None and scaled["spec"]["replicas"] == 4
    k8s_emulator.kubectl("label", "deployment/web", "tier=front")
    assert "web" in k8s_emulator.kubectl("get", "deploy", "-l", "tier=front", "-o", "name").stdout
    k8s_emulator.kubectl("patch", "deployment/web", "--type=merge", "-p", '{"spec":{"replicas":2}}')
    k8s_emulator.kubectl("delete", "-f", str(tmp_path / "a.yaml"))
    assert k8s_emulator.list("deployments.apps", "default") == []


@pytest.mark.tools
def test_kubectl_server_side_apply_wait_and_rollout(
    k8s_emulator: KubeEmulator, kube_controllers: KubeControllers, tmp_path: pathlib.Path
) -> None:
    path = _dump(tmp_path, "d.yaml", _deployment("api", 2))
    kube_controllers.hold()
    k8s_emulator.kubectl("apply", "--server-side", "-f", path)
    k8s_emulator.kubectl("apply", "--server-side", "-f", path)  # re-applying the same config is a no-op
    got = k8s_emulator.get("deployments.apps", "api", "default")
    assert got is not None and got["metadata"]["generation"] == 1
    not_yet = k8s_emulator.kubectl("wait", "--for=condition=Available", "deploy/api", "--timeout=1s", check=False)
    assert not_yet.returncode != 0
    kube_controllers.release()
    k8s_emulator.kubectl("wait", "--for=condition=Available", "deploy/api", "--timeout=30s")
    assert "successfully rolled out" in k8s_emulator.kubectl("rollout", "status", "deploy/api", "--timeout=30s").stdout


@pytest.mark.tools
def test_kubectl_create_generators_send_protobuf_we_decode(k8s_emulator: KubeEmulator) -> None:
    k8s_emulator.kubectl("create", "namespace", "llm")
    k8s_emulator.kubectl("create", "configmap", "cfg", "-n", "llm", "--from-literal=a=b")
    k8s_emulator.kubectl("create", "secret", "generic", "s", "-n", "llm", "--from-literal=p=q")
    cm = k8s_emulator.get("configmaps", "cfg", "llm")
    secret = k8s_emulator.get("secrets", "s", "llm")
    assert cm is not None and cm["data"] == {"a": "b"}
    assert secret is not None and secret["data"] == {"p": "cQ=="}
    k8s_emulator.kubectl("delete", "namespace", "llm")
    assert k8s_emulator.get("namespaces", "llm") is None and k8s_emulator.list("configmaps", "llm") == []


@pytest.mark.tools
def test_helm_install_upgrade_uninstall(
    k8s_emulator: KubeEmulator, kube_controllers: KubeControllers, tmp_path: pathlib.Path
) -> None:
    import subprocess

    from maru_localcluster.tools import helm_path

    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "templates" / "all.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cfg\n"
        'data:\n  replicas: "{{ .Values.replicas }}"\n---\n'
        + yaml.safe_dump(_deployment("web", 1))
        .replace("replicas: 1", "replicas: {{ .Values.replicas }}")
        .replace("namespace: default", "")
    )
    (chart / "values.yaml").write_text("replicas: 1\n")

    def helm(*args: str) -> str:
        result = subprocess.run(
            [str(helm_path()), *args], capture_output=True, text=True, timeout=120, env=k8s_emulator.env()
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    helm("install", "rel", str(chart), "--wait", "--timeout", "60s")
    assert k8s_emulator.get("configmaps", "rel-cfg", "default") is not None
    helm("upgrade", "rel", str(chart), "--set", "replicas=2", "--wait", "--timeout", "60s")
    web = k8s_emulator.get("deployments.apps", "web", "default")
    assert web is not None and web["spec"]["replicas"] == 2
    assert "rel" in helm("list")
    helm("uninstall", "rel")
    assert k8s_emulator.get("configmaps", "rel-cfg", "default") is None
    assert k8s_emulator.list("secrets", "default", labels="owner=helm") == []


@pytest.mark.tools
def test_kubectl_apply_product_crds_and_examples(k8s_emulator: KubeEmulator) -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    crds, examples = root / "crds", root / "examples"
    if not list(crds.glob("*.yaml")) or not list(examples.glob("*.yaml")):
        pytest.skip("the product CRDs or examples are not generated yet")
    # Like a real cluster, a CRD must be established before kubectl can map its custom resources,
    # so the CRDs and the resources using them are applied in two steps.
    k8s_emulator.kubectl("apply", "--validate=false", "-f", str(crds))
    # As on a real cluster, the examples' namespaces must exist first.
    for path in examples.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            ns = (doc or {}).get("metadata", {}).get("namespace")
            if ns and k8s_emulator.get("namespaces", ns) is None:
                k8s_emulator.kubectl("create", "namespace", ns)
    k8s_emulator.kubectl("apply", "--validate=false", "-f", str(examples))
    assert k8s_emulator.list("marupools.maru.io") or k8s_emulator.list("inferencegroups.maru.io")
    assert k8s_emulator.kubectl("get", "crd").stdout.count("maru.io") == 2


# -------------------------------------------------------------------------------------------------
# Object semantics


def test_generation_and_resource_version(kube: KubeEmulator) -> None:
    w = kube.create(widget("w", 1))
    meta = w["metadata"]
    assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"]
    rv1 = int(meta["resourceVersion"])

    w = kube.patch("widgets.test.example.com", "w", {"metadata": {"labels": {"a": "b"}}}, "default")
    assert w["metadata"]["generation"] == 1
    assert int(w["metadata"]["resourceVersion"]) > rv1

    w = kube.patch("widgets.test.example.com", "w", {"spec": {"size": 2}}, "default")
    assert w["metadata"]["generation"] == 2

    # A no-op write neither bumps resourceVersion nor notifies watchers.
    rv = w["metadata"]["resourceVersion"]
    w = kube.patch("widgets.test.example.com", "w", {"spec": {"size": 2}}, "default")
    assert w["metadata"]["resourceVersion"] == rv

    # The global counter increases across objects.
    cm = kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})
    assert int(cm["metadata"]["resourceVersion"]) > int(rv)


def test_replace_with_stale_resource_version_conflicts(kube: KubeEmulator) -> None:
    w = kube.create(widget("w", 1))
    kube.patch("widgets.test.example.com", "w", {"spec": {"size": 2}}, "default")
    w["spec"]["size"] = 3
    with pytest.raises(ApiError) as err:
        kube.replace("widgets.test.example.com", "w", w, "default")
    assert err.value.code == 409
    del w["metadata"]["resourceVersion"]
    with pytest.raises(ApiError) as err:  # custom resources have no unconditional updates
        kube.replace("widgets.test.example.com", "w", w, "default")
    assert err.value.code == 422
    current = kube.get("widgets.test.example.com", "w", "default")
    assert current is not None
    current["spec"]["size"] = 3
    assert kube.replace("widgets.test.example.com", "w", current, "default")["spec"]["size"] == 3
    # Built-in kinds do accept an update without a resourceVersion.
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})
    assert kube.replace("configmaps", "c", {"metadata": {"name": "c"}, "data": {"a": "b"}}, "default")["data"]


def test_status_subresource(kube: KubeEmulator) -> None:
    kube.create({**widget("w", 1), "status": {"ignored": True}})
    w = kube.get("widgets.test.example.com", "w", "default")
    assert w is not None and "status" not in w  # status on create is dropped

    w = kube.patch_status("widgets.test.example.com", "w", {"phase": "Ready"}, "default")
    assert w["status"] == {"phase": "Ready"}
    assert w["metadata"]["generation"] == 1

    # The main endpoint ignores status; the status endpoint ignores spec.
    w = kube.patch("widgets.test.example.com", "w", {"spec": {"size": 4}, "status": {"phase": "X"}}, "default")
    assert w["status"] == {"phase": "Ready"} and w["spec"]["size"] == 4
    w = kube.patch(
        "widgets.test.example.com",
        "w",
        {"spec": {"size": 9}, "status": {"phase": "Y"}},
        "default",
        subresource="status",
    )
    assert w["status"] == {"phase": "Y"} and w["spec"]["size"] == 4


def test_status_subresource_over_http(kube: KubeEmulator) -> None:
    from kubernetes import client

    api = client.CustomObjectsApi(kube.api_client())
    api.create_namespaced_custom_object(GROUP, "v1", "default", "widgets", widget("w", 1))
    got = api.patch_namespaced_custom_object_status(
        GROUP, "v1", "default", "widgets", "w", {"status": {"phase": "Ready"}}
    )
    assert got["status"] == {"phase": "Ready"}
    assert got["metadata"]["generation"] == 1


def test_schema_validation_and_pruning(kube: KubeEmulator) -> None:
    from kubernetes import client

    api = client.CustomObjectsApi(kube.api_client())
    with pytest.raises(client.ApiException) as err:
        api.create_namespaced_custom_object(GROUP, "v1", "default", "widgets", widget("bad", 0, color="green"))
    assert err.value.status == 422
    body = json.loads(err.value.body)
    fields = {c["field"] for c in body["details"]["causes"]}
    assert fields == {"spec.size", "spec.color"}

    obj = api.create_namespaced_custom_object(
        GROUP, "v1", "default", "widgets", widget("ok", 1, unknown=1, extra={"free": "form"})
    )
    assert "unknown" not in obj["spec"]
    assert obj["spec"]["extra"] == {"free": "form"}


def test_schema_defaults_and_cel_rules(kube: KubeEmulator) -> None:
    w = kube.create(widget("w", 2))
    assert w["spec"]["color"] == "blue"  # defaulted by the schema

    with pytest.raises(ApiError) as err:
        kube.create(widget("red", 1, color="red"))
    assert err.value.code == 422
    assert err.value.details["causes"] == [
        {"reason": "FieldValueInvalid", "field": "spec.size", "message": "red widgets need a size above 1"}
    ]

    # A transition rule (oldSelf) applies to updates only.
    with pytest.raises(ApiError) as err:
        kube.patch("widgets.test.example.com", "w", {"spec": {"size": 1}}, "default")
    assert "widgets never shrink" in err.value.message
    assert kube.patch("widgets.test.example.com", "w", {"spec": {"size": 3}}, "default")["spec"]["size"] == 3


def test_an_unchanged_invalid_spec_does_not_block_status_writes(kube: KubeEmulator) -> None:
    """Validation ratcheting: a spec stored before a stricter schema (or without CEL) stays writable around."""
    kube.create(widget("w", 2))
    kube.call(setattr, kube.emulator, "validate_schemas", False)
    kube.patch("widgets.test.example.com", "w", {"spec": {"size": 0}}, "default")
    kube.call(setattr, kube.emulator, "validate_schemas", True)
    status = kube.patch_status("widgets.test.example.com", "w", {"seen": True}, "default")
    assert status["status"] == {"seen": True}
    with pytest.raises(ApiError):  # changing the spec validates it again
        kube.patch("widgets.test.example.com", "w", {"spec": {"color": "red"}}, "default")


def test_schema_validation_can_be_switched_off(tmp_path: pathlib.Path) -> None:
    with running_emulator(tmp_path, validate_schemas=False) as kube:
        kube.create(CRD)
        obj = kube.create(widget("w", 0, unknown=1))
        assert obj["spec"] == {"size": 0, "unknown": 1}


def test_label_and_field_selectors(kube: KubeEmulator) -> None:
    for name, labels in [("a", {"app": "x", "tier": "web"}), ("b", {"app": "x", "tier": "db"}), ("c", {"app": "y"})]:
        kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}})

    def names(**kwargs: str) -> list[str]:
        return [o["metadata"]["name"] for o in kube.list("configmaps", "default", **kwargs)]

    assert names(labels="app=x") == ["a", "b"]
    assert names(labels="app=x,tier!=web") == ["b"]
    assert names(labels="tier in (web, db)") == ["a", "b"]
    assert names(labels="app,!tier") == ["c"]
    assert names(labels="tier notin (web)") == ["b", "c"]
    assert names(fields="metadata.name=c") == ["c"]

    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    assert [c.metadata.name for c in core.list_namespaced_config_map("default", label_selector="app=y").items] == ["c"]
    assert parse_label_selector("a in (b,c),d")[0].values == ("b", "c")


def test_watch_resume_delivers_every_event(kube: KubeEmulator) -> None:
    from kubernetes import client, watch

    core = client.CoreV1Api(kube.api_client())
    listed = core.list_namespaced_config_map("default")
    start_rv = listed.metadata.resource_version

    for i in range(5):
        kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"cm{i}"}})
    kube.patch("configmaps", "cm1", {"data": {"k": "v"}}, "default")
    kube.delete("configmaps", "cm2", "default")

    seen: list[tuple[str, str]] = []
    w = watch.Watch()
    for event in w.stream(core.list_namespaced_config_map, "default", resource_version=start_rv, timeout_seconds=30):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 7:
            w.stop()
    assert seen == [("ADDED", f"cm{i}") for i in range(5)] + [("MODIFIED", "cm1"), ("DELETED", "cm2")]


def test_watch_from_a_list_loses_nothing_under_concurrent_writes(kube: KubeEmulator) -> None:
    import urllib.request

    listing = json.loads(urllib.request.urlopen(f"{kube.url}/api/v1/namespaces/default/configmaps").read())
    rv = listing["metadata"]["resourceVersion"]
    names: queue.Queue[str] = queue.Queue()

    def reader() -> None:
        url = f"{kube.url}/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={rv}&timeoutSeconds=60"
        with urllib.request.urlopen(url) as stream:
            for line in stream:
                names.put(json.loads(line)["object"]["metadata"]["name"])

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    for i in range(50):
        kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"c{i}"}})
    got = [names.get(timeout=30) for _ in range(50)]
    assert got == [f"c{i}" for i in range(50)]
    kube.drop_watches()
    thread.join(30)


def test_watch_from_a_compacted_resource_version_gets_410(tmp_path: pathlib.Path) -> None:
    from kubernetes import client, watch

    with running_emulator(tmp_path, event_log_size=3) as kube:
        core = client.CoreV1Api(kube.api_client())
        rv = core.list_namespaced_config_map("default").metadata.resource_version
        for i in range(5):
            kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"c{i}"}})
        with pytest.raises(client.ApiException) as err:
            for _ in watch.Watch().stream(
                core.list_namespaced_config_map, "default", resource_version=rv, timeout_seconds=30
            ):
                pass
        assert err.value.status == 410


def test_compaction_makes_a_resumed_watch_relist_without_deleted_events(kube: KubeEmulator) -> None:
    from kubernetes import client, watch

    core = client.CoreV1Api(kube.api_client())
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gone"}})
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    kube.delete("configmaps", "gone", "default")
    assert kube.compact() >= int(rv)
    with pytest.raises(client.ApiException) as err:
        for _ in watch.Watch().stream(
            core.list_namespaced_config_map, "default", resource_version=rv, timeout_seconds=30
        ):
            pass
    assert err.value.status == 410
    # What the client sees when it lists again: the object is just not there, no DELETED event.
    assert core.list_namespaced_config_map("default").items == []


def test_watch_with_label_selector_sees_objects_leave_and_enter(kube: KubeEmulator) -> None:
    from kubernetes import client, watch

    core = client.CoreV1Api(kube.api_client())
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {"on": "yes"}}})
    kube.patch("configmaps", "c", {"metadata": {"labels": {"on": "no"}}}, "default")
    kube.patch("configmaps", "c", {"metadata": {"labels": {"on": "yes"}}}, "default")
    seen = []
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_config_map, "default", label_selector="on=yes", resource_version=rv, timeout_seconds=30
    ):
        seen.append(event["type"])
        if len(seen) == 3:
            w.stop()
    assert seen == ["ADDED", "DELETED", "ADDED"]


def test_owner_reference_garbage_collection(kube: KubeEmulator) -> None:
    owner = kube.create(widget("owner", 1))
    ref = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    child = kube.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "child", "ownerReferences": [ref]}}
    )
    grandchild_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "child", "uid": child["metadata"]["uid"]}
    kube.create(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "grandchild", "ownerReferences": [grandchild_ref]}}
    )
    other = kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "two-owners"}})
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "shared",
                "ownerReferences": [
                    ref,
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "two-owners", "uid": other["metadata"]["uid"]},
                ],
            },
        }
    )

    kube.delete("widgets.test.example.com", "owner", "default")
    kube.wait_gone("configmaps", "child", "default")
    kube.wait_gone("secrets", "grandchild", "default")
    shared = kube.get("configmaps", "shared", "default")
    assert shared is not None
    assert [r["name"] for r in shared["metadata"]["ownerReferences"]] == ["two-owners"]


def test_orphan_propagation_keeps_dependents(kube: KubeEmulator) -> None:
    owner = kube.create(widget("owner", 1))
    ref = {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "name": "owner", "uid": owner["metadata"]["uid"]}
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "child", "ownerReferences": [ref]}})
    kube.delete("widgets.test.example.com", "owner", "default", propagation="Orphan")
    child = kube.get("configmaps", "child", "default")
    assert child is not None and "ownerReferences" not in child["metadata"]


def test_finalizers_delay_deletion(kube: KubeEmulator) -> None:
    w = widget("w", 1)
    w["metadata"]["finalizers"] = ["example.com/cleanup"]
    kube.create(w)
    deleted = kube.delete("widgets.test.example.com", "w", "default")
    assert deleted is not None and deleted["metadata"]["deletionTimestamp"]
    still = kube.get("widgets.test.example.com", "w", "default")
    assert still is not None and still["metadata"]["deletionTimestamp"]

    kube.patch("widgets.test.example.com", "w", {"metadata": {"finalizers": None}}, "default")
    assert kube.get("widgets.test.example.com", "w", "default") is None


def test_names_and_labels_are_validated(kube: KubeEmulator) -> None:
    def rejected(body: dict[str, Any]) -> int:
        with pytest.raises(ApiError) as err:
            kube.create(body)
        return err.value.code

    assert rejected({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Upper"}}) == 422
    assert rejected({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a.b"}}) == 422
    assert rejected({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "7b-router"}}) == 422
    assert (
        rejected(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {"model": "Qwen/Qwen2.5-7B"}}}
        )
        == 422
    )
    assert (
        rejected({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "labels": {"x": "a" * 64}}}) == 422
    )
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "labels": {"app.kubernetes.io/name": "maru-pool", "empty": ""}},
        }
    )
    with pytest.raises(ApiError):
        kube.patch("configmaps", "c", {"metadata": {"labels": {"bad": "a b"}}}, "default")


def test_objects_need_an_existing_namespace(kube: KubeEmulator) -> None:
    with pytest.raises(ApiError) as err:
        kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "nope"}})
    assert err.value.code == 404


def test_namespace_deletion_removes_its_objects(kube: KubeEmulator) -> None:
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "scratch"}})
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "scratch"}})
    kube.delete("namespaces", "scratch")
    assert kube.get("namespaces", "scratch") is None
    assert kube.list("configmaps", "scratch") == []


def test_deleting_a_crd_removes_its_resources_and_discovery(kube: KubeEmulator) -> None:
    import urllib.error
    import urllib.request

    kube.create(widget("w", 1))
    assert "widgets" in urllib.request.urlopen(f"{kube.url}/apis/{GROUP}/v1").read().decode()
    kube.delete("customresourcedefinitions.apiextensions.k8s.io", f"widgets.{GROUP}")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{kube.url}/apis/{GROUP}/v1/namespaces/default/widgets")
    assert err.value.code == 404


def test_discovery_documents(kube: KubeEmulator) -> None:
    import urllib.request

    def get(path: str) -> Any:
        return json.loads(urllib.request.urlopen(kube.url + path).read())

    assert get("/api")["versions"] == ["v1"]
    assert get("/api/v1")["groupVersion"] == "v1"
    assert GROUP in [g["name"] for g in get("/apis")["groups"]]
    resources = {r["name"]: r for r in get(f"/apis/{GROUP}/v1")["resources"]}
    assert resources["widgets"]["shortNames"] == ["wdg"]
    assert resources["widgets"]["categories"] == ["gadgets"]
    assert "widgets/status" in resources
    apps = {r["name"] for r in get("/apis/apps/v1")["resources"]}
    assert {"deployments", "deployments/status", "daemonsets", "daemonsets/status"} <= apps
    crd = kube.get("customresourcedefinitions.apiextensions.k8s.io", f"widgets.{GROUP}")
    assert crd is not None
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"


def test_an_object_created_after_its_owner_went_is_collected(kube: KubeEmulator) -> None:
    # A controller that applies a child while its owner is being deleted (its cache still held the owner):
    # kube-controller-manager's garbage collector finds the owner absent and deletes the child.
    owner = kube.create(widget("short-lived", 1))
    ref = {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "name": "short-lived", "uid": owner["metadata"]["uid"]}
    kube.delete("widgets.test.example.com", "short-lived", "default")
    kube.wait_gone("widgets.test.example.com", "short-lived", "default")
    late = kube.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "late-child", "ownerReferences": [ref]}}
    )
    assert late["metadata"]["ownerReferences"] == [ref]  # the create itself succeeds, as on a real server
    kube.wait_gone("configmaps", "late-child", "default")


def test_kubernetes_client_accepts_owner_references(kube: KubeEmulator) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    owner = core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
    child = core.create_namespaced_config_map(
        "default",
        {
            "metadata": {
                "name": "child",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
                ],
            }
        },
    )
    assert child.metadata.owner_references[0].uid == owner.metadata.uid
    # The client sends a strategic merge patch for dicts; built-in kinds support it.
    patched = core.patch_namespaced_config_map("child", "default", {"data": {"a": "b"}})
    assert patched.data == {"a": "b"}


def test_strategic_merge_patch_for_custom_resources_is_rejected(kube: KubeEmulator) -> None:
    kube.create(widget("w", 1))
    with pytest.raises(ApiError) as err:
        kube.patch(
            "widgets.test.example.com",
            "w",
            {"spec": {"size": 2}},
            "default",
            content_type="application/strategic-merge-patch+json",
        )
    assert err.value.code == 415


def test_json_patch(kube: KubeEmulator) -> None:
    kube.create(widget("w", 1))
    w = kube.patch(
        "widgets.test.example.com",
        "w",
        [{"op": "replace", "path": "/spec/size", "value": 7}],
        "default",
        content_type="application/json-patch+json",
    )
    assert w["spec"]["size"] == 7


def test_builtin_defaults_are_filled_in_like_kube_apiserver(kube: KubeEmulator) -> None:
    desired = _deployment("d", 2)
    desired["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": 80}]
    got = kube.create(desired)
    assert got["spec"]["strategy"]["type"] == "RollingUpdate"
    assert got["spec"]["revisionHistoryLimit"] == 10
    pod = got["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Always" and pod["dnsPolicy"] == "ClusterFirst"
    assert pod["containers"][0]["ports"][0]["protocol"] == "TCP"
    assert pod["containers"][0]["imagePullPolicy"] == "Always"  # untagged image
    assert "status" not in got  # status is the controllers' to write

    # So a reconciler comparing desired with actual sees differences; re-patching desired is a no-op.
    assert got["spec"] != desired["spec"]
    again = kube.patch("deployments.apps", "d", {"spec": desired["spec"]}, "default")
    assert again["metadata"]["resourceVersion"] == got["metadata"]["resourceVersion"]

    svc = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s"},
            "spec": {"selector": {"app": "d"}, "ports": [{"port": 80}]},
        }
    )
    assert svc["spec"]["clusterIP"] and svc["spec"]["ports"][0]["targetPort"] == 80
    replaced = kube.replace("services", "s", {"metadata": {"name": "s"}, "spec": {"ports": [{"port": 81}]}}, "default")
    assert replaced["spec"]["clusterIP"] == svc["spec"]["clusterIP"]


def test_patch_helpers() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None, "d": 3}}) == {"a": {"c": 2, "d": 3}}
    merged = strategic_merge_patch(
        {
            "spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]},
            "metadata": {"finalizers": ["x"]},
        },
        {
            "spec": {
                "containers": [{"name": "b", "image": "2"}, {"name": "a", "$patch": "delete"}],
                "$setElementOrder/containers": [{"name": "b"}],
            },
            "metadata": {"finalizers": ["y"]},
        },
    )
    assert merged == {"spec": {"containers": [{"name": "b", "image": "2"}]}, "metadata": {"finalizers": ["x", "y"]}}


# -------------------------------------------------------------------------------------------------
# Faults and the request log


def test_fault_injection_returns_the_injected_status(kube: KubeEmulator) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    fault = kube.inject_fault(r"/configmaps$", 503, method="POST", times=2)
    for _ in range(2):
        with pytest.raises(client.ApiException) as err:
            core.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
        assert err.value.status == 503
    core.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
    assert fault.hits == 2

    kube.inject_fault(r"/configmaps/c$", 409, method="PATCH")
    with pytest.raises(client.ApiException) as err:
        core.patch_namespaced_config_map("c", "default", {"data": {"a": "b"}})
    assert err.value.status == 409


def test_an_action_runs_between_a_clients_read_and_its_write(kube: KubeEmulator) -> None:
    """``on_request``: someone else's write lands just before the matching request is served."""
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())

    def someone_creates(emulator: Any) -> None:
        emulator.create_object("", "configmaps", "default", {"metadata": {"name": "c", "labels": {"by": "them"}}})

    hook = kube.on_request(r"/namespaces/default/configmaps(/c)?$", someone_creates, method=("POST", "PATCH"))
    with pytest.raises(client.ApiException) as err:
        core.read_namespaced_config_map("c", "default")  # a GET: not matched
    assert err.value.status == 404 and hook.hits == 0
    with pytest.raises(client.ApiException) as err:
        core.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
    assert err.value.status == 409 and hook.hits == 1
    assert kube.get("configmaps", "c", "default")["metadata"]["labels"] == {"by": "them"}  # type: ignore[index]
    mark = kube.mark()
    core.create_namespaced_config_map("default", {"metadata": {"generateName": "d-"}})
    (create,) = kube.requests_since(mark)
    assert create.created is not None and create.created.startswith("d-")  # the name the server picked


def test_a_slow_request_is_answered_after_others_and_only_a_users_requests_match(kube: KubeEmulator) -> None:
    import urllib.request

    token = kube.service_account_token("default", "slow")
    kube.create(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "slow-admin"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": "slow", "namespace": "default"}],
        }
    )
    kube.create(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "cluster-admin"},
            "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}],
        }
    )
    slow = kube.inject_fault(r"/configmaps$", None, method="GET", delay=0.5, user="system:serviceaccount:default:slow")
    answered: list[str] = []

    def get(who: str, headers: dict[str, str]) -> None:
        request = urllib.request.Request(f"{kube.url}/api/v1/namespaces/default/configmaps", headers=headers)
        with urllib.request.urlopen(request) as response:
            assert response.status == 200  # served as usual once the delay is over
        answered.append(who)

    slow_one = threading.Thread(target=get, args=("slow", {"Authorization": f"Bearer {token}"}))
    slow_one.start()
    for _ in range(500):  # the slow request arrived (hits are no object change: poll)
        if kube.call(lambda: slow.hits):
            break
        threading.Event().wait(0.01)
    get("admin", {})  # another user's request: not delayed
    slow_one.join(10)
    assert answered == ["admin", "slow"] and slow.hits == 1


def test_dropping_watches_ends_the_stream(kube: KubeEmulator) -> None:
    import urllib.request

    opened = threading.Event()
    finished = threading.Event()

    def reader() -> None:
        with urllib.request.urlopen(f"{kube.url}/api/v1/configmaps?watch=true&timeoutSeconds=120") as stream:
            opened.set()
            for _ in stream:
                pass
        finished.set()

    threading.Thread(target=reader, daemon=True).start()
    assert opened.wait(30)
    kube.wait_until(lambda e: e.open_watches(), message="the watch is registered")
    assert kube.drop_watches(r"/configmaps") == 1
    assert finished.wait(30)


def test_request_log_records_writes(kube: KubeEmulator) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube.api_client())
    mark = kube.mark()
    core.list_namespaced_config_map("default")
    assert kube.writes_since(mark) == []
    core.create_namespaced_config_map("default", {"metadata": {"name": "c"}})
    writes = kube.writes_since(mark)
    assert [(r.method, r.path, r.status) for r in writes] == [("POST", "/api/v1/namespaces/default/configmaps", 201)]


# -------------------------------------------------------------------------------------------------
# Simulated controllers


def _deployment(name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }


def test_controllers_report_deployment_readiness(kube: KubeEmulator, kube_controllers: KubeControllers) -> None:
    kube_controllers.hold()
    kube.create(_deployment("d", 3))
    held = kube.wait_for("deployments.apps", "d", "default", lambda o: o.get("status", {}).get("replicas") == 3)
    assert "readyReplicas" not in held["status"]
    kube_controllers.release()
    ready = kube.wait_for("deployments.apps", "d", "default", lambda o: o.get("status", {}).get("readyReplicas") == 3)
    assert ready["status"]["observedGeneration"] == 1

    kube_controllers.set_readiness(lambda obj: 1)
    kube.patch("deployments.apps", "d", {"spec": {"replicas": 2}}, "default")
    partial = kube.wait_for("deployments.apps", "d", "default", lambda o: o["status"].get("observedGeneration") == 2)
    assert partial["status"]["readyReplicas"] == 1 and partial["status"]["replicas"] == 2


def test_controllers_count_the_newest_templates_pods_as_updated(
    kube: KubeEmulator, kube_controllers: KubeControllers
) -> None:
    """updatedReplicas counts the pods of the newest template, ready or not; replicas counts every pod. A new
    template whose pods never become ready stops where the strategy lets it, the old pods kept."""
    kube.create(_deployment("d", 3))
    kube.wait_for("deployments.apps", "d", "default", lambda o: o.get("status", {}).get("updatedReplicas") == 3)
    kube_controllers.set_readiness(lambda obj: False)  # a pod down after the rollout: nothing left to roll
    down = kube.wait_for("deployments.apps", "d", "default", lambda o: "readyReplicas" not in o["status"])
    assert down["status"]["updatedReplicas"] == 3 and down["status"]["replicas"] == 3

    patch = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "j"}]}}}}
    patch["spec"]["strategy"] = {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1}}
    kube.patch("deployments.apps", "d", patch, "default")
    stuck = kube.wait_for("deployments.apps", "d", "default", lambda o: o["status"].get("observedGeneration") == 2)
    # rolling.go: the old ReplicaSet shrinks to replicas - maxUnavailable, the new grows to replicas + maxSurge
    # less the old pods, and no further while the new pods are unavailable.
    assert (stuck["status"]["updatedReplicas"], stuck["status"]["replicas"]) == (2, 4)

    kube_controllers.set_readiness(lambda obj: True)
    done = kube.wait_for("deployments.apps", "d", "default", lambda o: o["status"].get("readyReplicas") == 3)
    assert (done["status"]["updatedReplicas"], done["status"]["replicas"]) == (3, 3)


def test_controllers_keep_endpoint_slices_of_services(kube: KubeEmulator, kube_controllers: KubeControllers) -> None:
    kube_controllers.set_readiness(lambda obj: 1)
    kube.create(_deployment("d", 2))
    svc = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default", "labels": {"team": "a"}},
            "spec": {"selector": {"app": "d"}, "ports": [{"port": 80}]},
        }
    )

    def ready_endpoints(obj: dict[str, Any]) -> list[bool]:
        return [e["conditions"]["ready"] for e in obj.get("endpoints") or []]

    def the_slice() -> dict[str, Any]:
        return kube.wait_until(
            lambda e: next(
                iter(e.list_objects("discovery.k8s.io", "endpointslices", "default", "kubernetes.io/service-name=web")),
                None,
            )
        )

    kube.wait_until(
        lambda e: [ready_endpoints(s) for s in e.list_objects("discovery.k8s.io", "endpointslices")] == [[True, False]]
    )
    slice_ = the_slice()
    assert slice_["metadata"]["labels"]["team"] == "a"  # the Service's labels are copied
    assert slice_["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
    kube_controllers.hold_endpoints()
    kube.wait_until(
        lambda e: [ready_endpoints(s) for s in e.list_objects("discovery.k8s.io", "endpointslices")] == [[False, False]]
    )
    kube_controllers.release_endpoints()
    kube.delete("services", "web", "default")
    kube.wait_until(lambda e: not e.list_objects("discovery.k8s.io", "endpointslices", "default"))


def test_paused_controllers_write_nothing(kube: KubeEmulator, kube_controllers: KubeControllers) -> None:
    kube_controllers.pause()
    kube.create(_deployment("d", 1))
    passes = kube_controllers.passes
    kube.create(_deployment("e", 1))
    assert "status" not in (kube.get("deployments.apps", "d", "default") or {})
    assert kube_controllers.passes == passes
    kube_controllers.resume()
    kube.wait_for("deployments.apps", "d", "default", lambda o: o.get("status", {}).get("observedGeneration") == 1)


def test_controllers_count_daemonset_nodes(kube: KubeEmulator, kube_controllers: KubeControllers) -> None:
    kube_controllers.add_node("n1", {"cxl": "true"})
    kube_controllers.add_node("n2", {"cxl": "true"})
    kube_controllers.add_node("n3")
    kube.create(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "agent", "namespace": "default"},
            "spec": {
                "selector": {"matchLabels": {"app": "agent"}},
                "template": {
                    "metadata": {"labels": {"app": "agent"}},
                    "spec": {"nodeSelector": {"cxl": "true"}, "containers": [{"name": "c", "image": "i"}]},
                },
            },
        }
    )
    ds = kube.wait_for("daemonsets.apps", "agent", "default", lambda o: o.get("status", {}).get("numberReady") == 2)
    assert ds["status"]["desiredNumberScheduled"] == 2
    kube_controllers.add_node("n4", {"cxl": "true"})
    kube.wait_for("daemonsets.apps", "agent", "default", lambda o: o["status"]["desiredNumberScheduled"] == 3)


# -------------------------------------------------------------------------------------------------
# kopf, in-process and as `kopf run`

OPERATOR = """
import kopf
import kubernetes


@kopf.on.create('test.example.com', 'v1', 'widgets')
@kopf.on.update('test.example.com', 'v1', 'widgets')
def reconcile(spec, name, namespace, body, patch, **_):
    cm = {'apiVersion': 'v1', 'kind': 'ConfigMap',
          'metadata': {'name': f'{name}-cfg', 'labels': {'owner': name}},
          'data': {'size': str(spec['size'])}}
    kopf.adopt(cm, owner=body)
    kubernetes.config.load_kube_config()
    core = kubernetes.client.CoreV1Api()
    try:
        core.create_namespaced_config_map(namespace, cm)
    except kubernetes.client.ApiException as e:
        if e.status != 409:
            raise
        core.replace_namespaced_config_map(f'{name}-cfg', namespace, cm)
    patch.status['configured'] = spec['size']
"""


@pytest.fixture
def kopf_settings() -> Iterator[Any]:
    import kopf

    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    settings.watching.reconnect_backoff = 0.1
    settings.posting.enabled = True
    yield settings


def _run_kopf_in_thread(kube: KubeEmulator, registry: Any, settings: Any) -> tuple[threading.Thread, Any]:
    import asyncio

    stop: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        async def run() -> None:
            stop["flag"] = asyncio.Event()
            stop["loop"] = asyncio.get_running_loop()
            ready.set()
            import kopf

            await kopf.operator(
                registry=registry, settings=settings, stop_flag=stop["flag"], clusterwide=False, namespaces=["default"]
            )

        asyncio.run(run())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(30)

    def stopper() -> None:
        stop["loop"].call_soon_threadsafe(stop["flag"].set)
        thread.join(30)

    return thread, stopper


def test_kopf_operator_in_process_reconciles(kube: KubeEmulator, kopf_settings: Any) -> None:
    import kopf
    from kubernetes import client

    registry = kopf.OperatorRegistry()
    core = client.CoreV1Api(kube.api_client())

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return kube.kopf_connection()

    # A short backoff: the test injects API errors and waits for the retry.
    @kopf.on.create(GROUP, "v1", "widgets", registry=registry, backoff=0.2)
    @kopf.on.update(GROUP, "v1", "widgets", registry=registry, backoff=0.2)
    def reconcile(spec: Any, name: str, namespace: str, body: Any, patch: Any, **_: Any) -> None:
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-cfg"},
            "data": {"size": str(spec["size"])},
        }
        kopf.adopt(cm, owner=body)
        try:
            core.create_namespaced_config_map(namespace, cm)
        except client.ApiException as e:
            if e.status != 409:
                raise
            core.replace_namespaced_config_map(f"{name}-cfg", namespace, cm)
        patch.status["configured"] = spec["size"]
        kopf.info(body, reason="Configured", message=f"size {spec['size']}")

    deleted: list[str] = []

    @kopf.on.delete(GROUP, "v1", "widgets", registry=registry)
    def cleanup(name: str, **_: Any) -> None:
        deleted.append(name)

    _, stop = _run_kopf_in_thread(kube, registry, kopf_settings)
    try:
        kube.create(widget("w", 2))
        # A deletion handler makes kopf put its finalizer on the object.
        kube.wait_for("widgets.test.example.com", "w", "default", lambda o: o["metadata"].get("finalizers"))
        cm = kube.wait_for("configmaps", "w-cfg", "default")
        w = kube.get("widgets.test.example.com", "w", "default")
        assert w is not None
        assert cm["metadata"]["ownerReferences"][0]["uid"] == w["metadata"]["uid"]
        kube.wait_for("widgets.test.example.com", "w", "default", lambda o: o.get("status", {}).get("configured") == 2)

        kube.patch("widgets.test.example.com", "w", {"spec": {"size": 5}}, "default")
        kube.wait_for("configmaps", "w-cfg", "default", lambda o: o["data"]["size"] == "5")

        # The operator survives a broken watch and API errors (for its own calls and its handler's).
        kube.inject_fault(r"/configmaps", 500, times=2)
        kube.inject_fault(r"/widgets/w$", 503, method="PATCH", times=1)
        assert kube.drop_watches(r"/widgets") >= 1
        kube.patch("widgets.test.example.com", "w", {"spec": {"size": 6}}, "default")
        kube.wait_for("configmaps", "w-cfg", "default", lambda o: o["data"]["size"] == "6")

        # Events posted with kopf.info() are core v1 Events about the object.
        kube.wait_until(
            lambda e: [
                ev
                for ev in e.list_objects("", "events", "default")
                if ev["involvedObject"]["name"] == "w" and ev["reason"] == "Configured"
            ],
            message="an event about w",
        )

        marked = kube.delete("widgets.test.example.com", "w", "default")
        assert marked is not None and marked["metadata"]["deletionTimestamp"]  # held by the finalizer
        kube.wait_gone("widgets.test.example.com", "w", "default")
        assert deleted == ["w"]
        kube.wait_gone("configmaps", "w-cfg", "default")
    finally:
        stop()


@pytest.mark.tools
def test_kopf_run_subprocess_reconciles(kube: KubeEmulator, tmp_path: pathlib.Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "op.py"
    script.write_text(OPERATOR)
    log = open(tmp_path / "kopf.log", "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [sys.executable, "-m", "kopf", "run", "--standalone", "--namespace=default", str(script)],
        env=kube.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        kube.create(widget("w", 3))
        cm = kube.wait_for("configmaps", "w-cfg", "default", timeout=60)
        assert cm["data"]["size"] == "3"
        kube.wait_for("widgets.test.example.com", "w", "default", lambda o: o.get("status", {}).get("configured") == 3)
    except AssertionError:
        log.flush()
        raise AssertionError((tmp_path / "kopf.log").read_text()[-5000:]) from None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()


# -------------------------------------------------------------------------------------------------
# Tools


@pytest.mark.tools
def test_tools_extract_once_and_concurrently(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from maru_localcluster import tools

    monkeypatch.setattr(tools, "TOOLS_DIR", tmp_path / "bin")
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda f: f(), [tools.kubectl_path, tools.helm_path]))
    assert [p.name for p in paths] == ["kubectl", "helm"]
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["helm", "kubectl"]  # no temp leftovers
    assert (
        "v1.35"
        in subprocess.run([str(paths[0]), "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    )
    assert subprocess.run(
        [str(paths[1]), "version", "--short"], capture_output=True, text=True, timeout=60
    ).stdout.startswith("v4")
    mtime = paths[0].stat().st_mtime_ns
    assert tools.kubectl_path().stat().st_mtime_ns == mtime  # idempotent: not extracted again

    kubeconfig = tools.write_kubeconfig("http://127.0.0.1:1", tmp_path / "kc")
    assert yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"] == "http://127.0.0.1:1"


def test_controllers_can_keep_pods(kube: KubeEmulator) -> None:
    with KubeControllers(kube, pods=True) as controllers:
        controllers.add_node("n1", {"cxl": "true"})
        controllers.add_node("n2")
        controllers.set_readiness(lambda obj: 1)
        deploy = _deployment("dec", 2)
        deploy["spec"]["template"]["spec"]["nodeSelector"] = {"cxl": "true"}
        kube.create(deploy)
        kube.wait_until(lambda e: len(e.list_objects("", "pods", "default", "app=dec")) == 2, message="2 pods")
        pods = kube.list("pods", "default", labels="app=dec")
        assert {p["spec"]["nodeName"] for p in pods} == {"n1"}
        assert sorted(c["status"] for p in pods for c in p["status"]["conditions"] if c["type"] == "Ready") == [
            "False",
            "True",
        ]
        assert all(p["status"]["podIP"] for p in pods)

        # A template change replaces the pods; deleting the owner collects them.
        kube.patch("deployments.apps", "dec", {"spec": {"template": {"metadata": {"labels": {"v": "2"}}}}}, "default")
        kube.wait_until(
            lambda e: (
                len(e.list_objects("", "pods", "default", "app=dec,v=2")) == 2
                and len(e.list_objects("", "pods", "default", "app=dec")) == 2
            ),
            message="new pods",
        )
        kube.delete("deployments.apps", "dec", "default")
        kube.wait_until(lambda e: not e.list_objects("", "pods", "default"), message="pods collected")


def _get_json(url: str, accept: str = "application/json") -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as resp:
        return json.loads(resp.read())


def test_lists_are_paged_with_limit_and_continue(k8s_emulator: KubeEmulator) -> None:
    """``limit`` and ``continue`` as kube-apiserver has them: pages in key order, the list's resourceVersion
    kept across pages, remainingItemCount, and a 400 for a token that is not one."""
    import urllib.error
    import urllib.parse

    for i in range(5):
        k8s_emulator.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": f"cm-{i}", "namespace": "default"},
                "data": {"i": str(i)},
            }
        )
    base = f"{k8s_emulator.url}/api/v1/namespaces/default/configmaps"
    first = _get_json(f"{base}?limit=2")
    assert [o["metadata"]["name"] for o in first["items"]] == ["cm-0", "cm-1"]
    assert first["metadata"]["remainingItemCount"] == 3 and first["metadata"]["continue"]
    k8s_emulator.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm-9", "namespace": "default"}})
    names, token, versions = [], first["metadata"]["continue"], {first["metadata"]["resourceVersion"]}
    while token:
        page = _get_json(f"{base}?limit=2&continue={urllib.parse.quote(token)}")
        names += [o["metadata"]["name"] for o in page["items"]]
        versions.add(page["metadata"]["resourceVersion"])
        token = page["metadata"].get("continue")
    assert names == ["cm-2", "cm-3", "cm-4", "cm-9"]
    assert len(versions) == 1  # every page answers for the list as it began
    assert [o["metadata"]["name"] for o in _get_json(base)["items"]][-1] == "cm-9"  # no limit: one page
    with pytest.raises(urllib.error.HTTPError) as err:
        _get_json(f"{base}?limit=2&continue=not-a-token")
    assert err.value.code == 400


def test_metadata_only_lists(k8s_emulator: KubeEmulator) -> None:
    k8s_emulator.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "cm", "namespace": "default", "labels": {"a": "b"}},
            "data": {"k": "v"},
        }
    )
    listed = _get_json(
        f"{k8s_emulator.url}/api/v1/namespaces/default/configmaps",
        "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
    )
    assert (listed["kind"], listed["apiVersion"]) == ("PartialObjectMetadataList", "meta.k8s.io/v1")
    (item,) = listed["items"]
    assert set(item) == {"kind", "apiVersion", "metadata"} and item["kind"] == "PartialObjectMetadata"
    assert item["metadata"]["labels"] == {"a": "b"} and item["metadata"]["resourceVersion"]
