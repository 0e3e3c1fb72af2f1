"""The Dockerfile read as builders read it (stages, their bases, global ARGs), and ``make images`` run with stand-in
builders that record what they were asked."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

DOCKERFILE = REPO_ROOT / "Dockerfile"


def stages(text: str) -> dict[str, dict]:
    """Stage name -> {"from": base, "ins": [(INSTRUCTION, args), ...]}. A base that names a stage through a
    global ARG (`FROM vllm-base-${VLLM_BASE}`) is that stage, with the ARG's default."""
    out: dict[str, dict] = {}
    current = None
    for word, rest in instructions(text):
        if word == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = {"from": match[1], "ins": []}
            out[match[2]] = current
        elif current is not None:
            current["ins"].append((word, rest))
    args = global_args(text)
    for stage in out.values():
        named = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), stage["from"])
        if named != stage["from"] and named in out:
            stage["from"] = named
    return out


def chain(all_stages: dict[str, dict], name: str) -> list[str]:
    """The stage and the stages it is built FROM, nearest first."""
    names = [name]
    while all_stages[names[-1]]["from"] in all_stages:
        names.append(all_stages[names[-1]]["from"])
    return names


def last(all_stages: dict[str, dict], name: str, word: str) -> str | None:
    """The effective value of an instruction (USER, ENTRYPOINT...) for a target, through its bases."""
    for stage in chain(all_stages, name):
        found = [rest for w, rest in all_stages[stage]["ins"] if w == word]
        if found:
            return found[-1]
    return None


TOOLS = ("make", "bash", "sh", "sed", "dirname", "env", "grep", "tr")

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["FAKE_BUILDER_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
if "inspect" in sys.argv[1:4] and os.environ.get("FAKE_MANIFEST"):
    print(os.environ["FAKE_MANIFEST"])
sys.exit(1 if sys.argv[1:3] == ["buildx", "version"] and os.environ.get("FAKE_NO_BUILDX") else 0)
"""


def make_images(tmp_path: Path, builders: tuple[str, ...], *args: str, **env: str) -> tuple[int, str, list[list[str]]]:
    """Run `make images ARGS` with only TOOLS and the given stand-in builders on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed to run make images"
        (bin_dir / tool).symlink_to(found)
    for name in builders:
        script = bin_dir / name
        script.write_text(RECORDER.format(python=sys.executable))
        script.chmod(0o755)
    log = tmp_path / "argv.jsonl"
    log.touch()
    done = subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO_ROOT), "images", *args],
        # No SBOM unless a test asks: it reads a built image, which a stand-in builder has not made.
        env={"PATH": str(bin_dir), "FAKE_BUILDER_LOG": str(log), "SBOM_DIR": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
        executable=str(bin_dir / "make"),
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return done.returncode, done.stdout + done.stderr, calls


def builds(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if "build" in c[1:3]]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def global_args(text: str) -> dict[str, str]:
    args = {}
    for word, rest in instructions(text):
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
    return args
