"""A real vLLM engine runs with the root filesystem read-only, given only what the operator gives its pods.

The vLLM container the operator builds has ``readOnlyRootFilesystem: true``, emptyDirs at a few paths and
an environment pointing vLLM's caches there. This test takes exactly those from the builder, recreates
them in a private mount namespace (the root remounted read-only, a tmpfs at each emptyDir), and runs
vLLM there: it loads the model and generates. Linux only, as root (CI runs as root).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_localcluster.tools import package_roots
from maru_operator.builders.group import build_role_deployment
from maru_operator.builders.scratch import CACHE_ENV
from tests.required import require_root, require_tool, require_vllm
from tests.support.specs import GROUP_OWNER, container, group_spec, pool_view

require_vllm("the engine tests")
pytestmark = pytest.mark.vllm

GENERATE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512, block_size=128,
          kv_cache_memory_bytes=64 * 2**20, max_num_seqs=2)
print("GENERATED", list(llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0))[0]
                        .outputs[0].token_ids))
"""


@pytest.fixture(scope="module")
def outside_tmp() -> Iterator[Path]:
    """A directory the tmpfs at /tmp does not hide: the model and the script live there, read-only."""
    path = Path(tempfile.mkdtemp(prefix="maru-roroot-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def program_paths() -> list[str]:
    """This machine's interpreter, the virtual environment and the checkout's packages."""
    paths = {sys.prefix, sys.base_prefix, str(Path(os.path.realpath(sys.executable)).parent.parent), *package_roots()}
    return sorted(paths)


def test_vllm_serves_with_a_read_only_root(outside_tmp: Path) -> None:
    # A private mount namespace with the root remounted read-only.
    require_root("a private mount namespace")
    require_tool("unshare", "a private mount namespace")
    from maru_localcluster.tinymodel import make_tiny_llama

    model = make_tiny_llama(outside_tmp / "model")
    script = outside_tmp / "generate.py"
    script.write_text(GENERATE)
    vllm = container(build_role_deployment(group_spec(), "prefill", GROUP_OWNER, pool_view()))
    assert vllm["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {
        v["name"]: v
        for v in build_role_deployment(group_spec(), "prefill", GROUP_OWNER, pool_view())["spec"]["template"]["spec"][
            "volumes"
        ]
    }
    scratch = [
        m["mountPath"] for m in vllm["volumeMounts"] if volumes[m["name"]].get("emptyDir") == {}
    ]  # the disk-backed emptyDirs (dshm exists already)
    assert set(scratch) >= {"/tmp"}
    env = {e["name"]: e["value"] for e in vllm["env"] if "value" in e}
    assert {k: env[k] for k in CACHE_ENV} == CACHE_ENV

    steps = ["set -e", "mount --make-rprivate /"]
    # The interpreter, the virtual environment and the checkout are the "image": a checkout under /tmp
    # would vanish under the tmpfs there, which no real image's programs do. Kept aside, then bound back.
    covered = [p for p in program_paths() if any(p == s or p.startswith(s.rstrip("/") + "/") for s in scratch)]
    held = outside_tmp / "programs"
    for i, path in enumerate(covered):
        steps += [f"mkdir -p {held / str(i)}", f"mount --bind {shlex.quote(path)} {held / str(i)}"]
    for path in scratch:
        # A mount point that does not exist on this machine is made inside a tmpfs over its parent.
        if not Path(path).exists():
            steps += [f"mount -t tmpfs tmpfs {shlex.quote(str(Path(path).parent))}", f"mkdir -p {shlex.quote(path)}"]
        steps.append(f"mount -t tmpfs -o size=1g tmpfs {shlex.quote(path)}")
    for i, path in enumerate(covered):
        steps += [f"mkdir -p {shlex.quote(path)}", f"mount --bind {held / str(i)} {shlex.quote(path)}"]
    steps += [
        "mount -o remount,bind,ro /",
        "if touch /.maru-probe 2>/dev/null; then echo 'the root is writable'; exit 3; fi",
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))} {shlex.quote(str(model))}",
    ]
    child_env = {**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        ["unshare", "--mount", "bash", "-c", "\n".join(steps)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and "GENERATED" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
