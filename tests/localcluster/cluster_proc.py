"""A local cluster in a process of its own, for tests that kill it: ``python -m tests.localcluster.cluster_proc NAME``.

It starts a one-node cluster, runs a pod that serves ``NAME`` on ``0.0.0.0:9400`` from a memory-backed
emptyDir (a tmpfs), prints one JSON line once the pod is Ready (its door URL, the state folder, the
cluster network), and then waits for its standard input to close, when it stops the cluster.
"""

from __future__ import annotations

import json
import os
import sys
import time

import yaml

from maru_localcluster import imagebuild
from maru_localcluster.cluster import LocalCluster

PORT = 9400


def pod(name: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "echo", "namespace": "default"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "volumes": [{"name": "m", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
            "containers": [
                {
                    "name": "echo",
                    "image": imagebuild.BASE,
                    "command": [
                        "/bin/sh",
                        "-c",
                        f"printf {name} > /m/index.html; exec python -m http.server {PORT} --directory /m",
                    ],
                    "ports": [{"name": "metrics", "containerPort": PORT}],
                    "volumeMounts": [{"name": "m", "mountPath": "/m"}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1},
                }
            ],
        },
    }


def main() -> int:
    name = sys.argv[1]
    with LocalCluster(crashloop_base_s=1.0) as cluster:
        cluster.add_node("node-1")
        cluster.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(pod(name)))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status = (cluster.kube.get("pods", "echo", "default") or {}).get("status") or {}
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []):
                break
            time.sleep(0.2)
        else:
            print(
                json.dumps({"error": "the echo pod did not become Ready", "log": cluster.pod_log("default", "echo")}),
                flush=True,
            )
            return 1
        assert cluster.network is not None
        print(
            json.dumps(
                {
                    "url": cluster.pod_url("default", "echo", PORT),
                    "workdir": str(cluster.workdir),
                    "netns": os.readlink(cluster.network.path),
                    "pid": os.getpid(),
                }
            ),
            flush=True,
        )
        while sys.stdin.read(1):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
