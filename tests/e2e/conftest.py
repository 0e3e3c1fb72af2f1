"""The product deployed on the local cluster, as a user deploys it: kubectl, the operator, the examples.

Each test module builds one cluster (for one pool kind) and shares it between its tests, which run in
file order: an engine start costs tens of seconds on two cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from maru_localcluster.tinymodel import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    # The vLLM image runs as a non-root user: what it carries must be readable, as in a real image.
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    path.chmod(0o755)
    return Path(path)
