"""Which vLLM flag each extra argument sets, read the way vLLM 0.32's own parser reads it.

vLLM's ``FlexibleArgumentParser`` (``vllm/utils/argparse_utils.py``) and the ``argparse`` under it
accept many spellings of one flag, and the operator's checks must see through all of them:

* ``--kv-transfer-config X`` and ``--kv-transfer-config=X``;
* underscores for dashes in the name (before any dot): ``--kv_transfer_config``;
* dotted sub-keys, which set part of a JSON flag: ``--kv-transfer-config.kv_role=kv_both``;
* short aliases: ``-tp 2``, ``-q fp8``, ``-q=fp8``, ``-qfp8`` (a one-letter option takes its value glued on);
* unambiguous abbreviations (argparse's ``allow_abbrev``, on in vLLM): ``--kv-t X``, ``--tensor 2``, ``-t 2``.

Abbreviations depend on every option vLLM has: ``SHORTEST`` records, for each flag checked here, the
shortest prefix that names only it among vLLM 0.32's ``vllm serve`` options (a test recomputes it from
the installed vLLM). Not seen: flags given in a ``--config`` YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    name: str  # the long name, e.g. --tensor-parallel-size
    shortest: str  # the shortest unambiguous abbreviation of name among all of vLLM's options
    aliases: tuple[str, ...] = ()  # single-dash names, e.g. -tp


# vLLM 0.32.0, `vllm serve`.
FLAGS: tuple[Flag, ...] = (
    Flag("--kv-transfer-config", "--kv-t"),
    Flag("--model", "--model"),  # --model-impl and others share the prefix: only the full name
    Flag("--served-model-name", "--ser"),
    Flag("--revision", "--rev"),
    Flag("--tensor-parallel-size", "--te", ("-tp",)),
    Flag("--block-size", "--b"),
    Flag("--port", "--por"),
    Flag("--dtype", "--dt"),
    Flag("--kv-cache-dtype", "--kv-cache-dtype"),  # --kv-cache-dtype-skip-layers: only the full name
    Flag("--quantization", "--quantization", ("-q",)),  # --quantization-config: likewise
)
# Every single-dash option of vLLM 0.32: an abbreviation like -t is one only if no other starts so.
SHORT_OPTIONS = (
    "-ac",
    "-asc",
    "-cc",
    "-dc",
    "-dcp",
    "-dp",
    "-dpa",
    "-dpb",
    "-dpe",
    "-dph",
    "-dpl",
    "-dpm",
    "-dpn",
    "-dpp",
    "-dpr",
    "-ep",
    "-h",
    "-n",
    "-pcp",
    "-pp",
    "-q",
    "-r",
    "-sc",
    "-tp",
)
BY_NAME = {f.name: f for f in FLAGS}


@dataclass(frozen=True)
class Setting:
    """One argument (with its value) that sets ``flag``; ``spelling`` is how the user wrote it."""

    flag: str
    value: str
    spelling: str


def _long(name: str) -> Flag | None:
    for flag in FLAGS:
        if name == flag.name or (name.startswith(flag.shortest) and flag.name.startswith(name)):
            return flag
    return None


def _short(option: str) -> tuple[Flag | None, str | None]:
    """The flag a single-dash option names, and a value glued to it (-qfp8)."""
    for flag in FLAGS:
        if option in flag.aliases:
            return flag, None
    matches = [o for o in SHORT_OPTIONS if o.startswith(option)]
    if len(matches) == 1:
        return next((f for f in FLAGS if matches[0] in f.aliases), None), None
    head = option[:2]
    if head in SHORT_OPTIONS and len(head) == 2:
        return next((f for f in FLAGS if head in f.aliases), None), option[2:]
    return None, None


def settings(args: list[str]) -> list[Setting]:
    """What ``args`` set, of the flags in ``FLAGS`` (others are skipped with the value they take)."""
    out: list[Setting] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
            continue  # a positional argument, or a negative number given as a value
        key, eq, value = arg.partition("=")
        glued = None
        if arg.startswith("--"):
            head, dot, sub = key.partition(".")
            flag = _long(head.replace("_", "-"))
        else:
            dot, sub = "", ""
            flag, glued = _short(key)
        if not eq and glued is None and i < len(args) and not args[i].startswith("-"):
            value = args[i]  # the flag's value is the next argument
            i += 1
        elif glued is not None:
            value = glued + (eq + value if eq else "")
        if flag is not None:
            out.append(Setting(flag.name, f"{sub}={value}" if dot else value, arg))
    return out


def values_of(args: list[str], flag: str) -> list[str]:
    """Every value ``args`` give ``flag`` (``--quantization``), however spelled."""
    return [s.value for s in settings(args) if s.flag == flag]


def cel_owned_flags_rule(owned: tuple[str, ...]) -> str:
    """A CEL rule refusing the usual spellings of ``owned`` in ``extraArgs`` (best effort: no abbreviations).

    The authoritative check is :func:`settings`; this catches most mistakes at admission already.
    """
    longs = "|".join(BY_NAME[f].name[2:].replace("-", "[-_]") for f in owned)
    shorts = "|".join(a[1:] for f in owned for a in BY_NAME[f].aliases)
    pattern = f"^(--({longs})([=.].*)?" + (f"|-({shorts})(=.*)?" if shorts else "") + ")$"
    return f"!has(self.extraArgs) || !self.extraArgs.exists(a, a.matches('{pattern}'))"
