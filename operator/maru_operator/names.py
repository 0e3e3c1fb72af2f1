"""Names and labels of the children: exact where possible, shortened with a stable hash where not.

Owners may have names up to 253 characters with dots (DNS-1123 subdomains), but Service names must be
DNS-1035 labels (63 characters, no dots, starting with a letter) and label values are capped at 63.
A name that already fits is used as is, so ``kubectl get deploy llama-prefill`` works; one that does
not is cut and suffixed with a hash of the full original, so two long owners never collide and the
same owner always maps to the same child.
"""

from __future__ import annotations

import hashlib
import re

MAX_NAME = 63
HASH_LEN = 8

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LEN]


def child_name(owner: str, suffix: str = "") -> str:
    """``<owner>-<suffix>`` as a DNS-1035 label of at most 63 characters.

    ``suffix`` must itself be a short DNS-1035 fragment (``prefill``, ``agent``...).
    """
    full = f"{owner}-{suffix}" if suffix else owner
    if len(full) <= MAX_NAME and _DNS1035.match(full):
        return full
    base = re.sub(r"[^a-z0-9-]", "-", owner.lower())
    if not base[:1].isalpha():
        # Service names must start with a letter; 'm' keeps the result readable and valid.
        base = "m" + base
    tail = f"-{short_hash(full)}" + (f"-{suffix}" if suffix else "")
    base = base[: MAX_NAME - len(tail)].rstrip("-")
    return base + tail


def label_value(value: str) -> str:
    """A valid label value (at most 63 characters) identifying ``value`` uniquely."""
    if len(value) <= MAX_NAME and _LABEL_VALUE.match(value):
        return value
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", value)
    tail = f"-{short_hash(value)}"
    head = cleaned[: MAX_NAME - len(tail)]
    head = re.sub(r"^[^A-Za-z0-9]+", "", head)
    head = re.sub(r"[^A-Za-z0-9]+$", "", head)
    return (head + tail) if head else short_hash(value)


def is_dns1035(name: str) -> bool:
    return len(name) <= MAX_NAME and bool(_DNS1035.match(name))


def is_label_value(value: str) -> bool:
    return len(value) <= MAX_NAME and bool(_LABEL_VALUE.match(value))
