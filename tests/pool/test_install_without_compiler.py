"""The package installs from source on a machine without a working C compiler.

The compiled copy+checksum module is an optimisation: the build must go on without it, say so loudly,
and leave a package whose copies run on the pure Python path (and say that too when it is imported).
Built for real: a wheel of a copy of the source tree, with ``CC=/bin/false`` as the compiler.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import xxhash

REPO = Path(__file__).resolve().parents[2]
# What the build reads: pyproject's package roots, the build script and the readme.
SOURCES = ("setup.py", "pyproject.toml", "README.md", "operator", "connector", "localcluster")
PROBE = (
    "import maru_pool.copyhash as c, xxhash; "
    "assert c.checksum(b'x' * 4096) == xxhash.xxh3_64_intdigest(b'x' * 4096); "
    "print(c.NATIVE, c.simd(), c.__file__)"
)


def copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def test_a_build_without_a_compiler_installs_and_uses_the_fallback(tmp_path: Path) -> None:
    src, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    src.mkdir()
    copy_sources(src)
    env = {**os.environ, "CC": "/bin/false", "CXX": "/bin/false", "LDSHARED": "/bin/false", "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert "maru_pool._copyhash was NOT built" in build.stdout + build.stderr
    (wheel,) = wheels.glob("*.whl")

    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    assert not list(target.glob("maru_pool/_copyhash*.so"))

    # -S: no site-packages .pth files, so the development tree's editable install cannot answer
    # imports; the installed tree comes first, then the dependencies (xxhash).
    deps = Path(xxhash.__file__).parent.parent
    probe = subprocess.run(
        [sys.executable, "-S", "-c", PROBE],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.pathsep.join([str(target), str(deps)])},
        cwd=tmp_path,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    native, path, module_file = probe.stdout.split()
    assert (native, path) == ("False", "python")
    assert module_file.startswith(str(target))
    assert "copies run at Python speed" in probe.stderr
