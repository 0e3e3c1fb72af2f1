"""How big a pool is: the one grammar of a pool size, and the memory a pool of a given size takes.

``MaruPool.spec.size`` and ``maru-pool --size`` accept exactly the same strings: the CRD's pattern
is :data:`SIZE_PATTERN` and the daemon parses with :func:`parse_size`. A size is a whole, positive
number of bytes, with an optional Kubernetes suffix: binary ``Ki Mi Gi Ti Pi Ei`` or decimal
``k M G T P E`` (``64Gi``, ``500M``, ``1073741824``). Kubernetes quantities that are not a whole number
of bytes in plain notation are refused by both, with a hint: exponents (``1e10``: write ``10G``),
fractions (``1.5Gi``: write ``1536Mi``) and ``m`` (milli: ``512m`` is 0.512 bytes).

A pool of ``capacity`` bytes is a file (shm) or device region of :data:`HEADER_SIZE` + capacity
bytes; in a tmpfs that takes :func:`pool_memory_bytes`, whole pages.

Imports nothing but the standard library: the operator uses it to write the CRD and the pod spec.
"""

from __future__ import annotations

import re

HEADER_SIZE = 4096
PAGE_SIZE = 4096

UNITS: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
# At most 18 digits: whatever the suffix, far beyond any memory, and no absurd strings.
SIZE_PATTERN = r"^[1-9][0-9]{0,17}(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_SIZE = re.compile(SIZE_PATTERN)
_HINTS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"^[0-9.]+[eE][+-]?[0-9]+$"),
        "exponents are not accepted: write the number with a suffix, e.g. 10G for 1e10",
    ),
    (
        re.compile(r"^[0-9.]+[munk]$"),
        "lower-case m, u and n are milli, micro and nano in Kubernetes quantities "
        "(512m is 0.512 bytes); k is kilo; write e.g. 512M or 512Mi",
    ),
    (
        re.compile(r"^[0-9]*\.[0-9]*([KMGTPE]i?|k)?$"),
        "fractions are not accepted: write a whole number with a smaller unit, e.g. 1536Mi for 1.5Gi",
    ),
    (re.compile(r"^[0-9]+([KMGTPE]i?|k)[bB]$|^[0-9]+[bB]$"), "write the unit without B, e.g. 64Gi or 64G"),
    (re.compile(r"^[0-9]+K$"), "decimal kilo is a lower-case k (Ki for 1024)"),
]


def parse_size(text: str) -> int:
    """Bytes of a pool size; ValueError naming the rule (and the likely fix) otherwise."""
    value = text
    # fullmatch: "$" alone would also accept a trailing newline, which the API server's regexp refuses.
    if not isinstance(value, str) or not _SIZE.fullmatch(value):
        hint = next(
            (h for pattern, h in _HINTS if isinstance(value, str) and pattern.match(value)),
            "use a whole number of bytes with an optional suffix Ki, Mi, Gi, Ti, Pi, Ei (or k, M, G, T, P, "
            "E), e.g. 64Gi",
        )
        raise ValueError(f"invalid size {text!r}: {hint}")
    suffix = value.lstrip("0123456789")
    return int(value[: len(value) - len(suffix)]) * UNITS[suffix]


def format_size(count: int) -> str:
    """A byte count in the grammar, with the largest binary unit that divides it (``268439552`` -> ``262148Ki``)."""
    if count <= 0:
        raise ValueError(f"a size must be positive, not {count}")
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        if count % UNITS[suffix] == 0:
            return f"{count // UNITS[suffix]}{suffix}"
    return str(count)


def pool_memory_bytes(capacity: int) -> int:
    """Memory a pool of ``capacity`` bytes takes in a tmpfs: its header and chunks, in whole pages."""
    total = HEADER_SIZE + capacity
    return -(-total // PAGE_SIZE) * PAGE_SIZE
