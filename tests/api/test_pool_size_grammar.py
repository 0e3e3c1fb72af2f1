"""One size grammar: what MaruPool.spec.size accepts is exactly what the pool daemon's --size parses.

Before, the CRD took any Kubernetes quantity while the daemon had its own grammar: ``64Pi`` and
``1e10`` passed the CRD and crashed the daemon, and ``512m`` (512 milli-bytes to Kubernetes) meant
512 MB to the daemon.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from maru_contracts.poolsize import SIZE_PATTERN, parse_size
from maru_operator.api.common import QUANTITY_PATTERN
from maru_operator.crdvalidate import Validator
from maru_operator.quantity import parse_quantity
from maru_pool.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "maru.io_marupools.yaml"


def crd_accepts(size: str) -> bool:
    pool = {
        "apiVersion": "maru.io/v1alpha1",
        "kind": "MaruPool",
        "metadata": {"name": "p"},
        "spec": {"backend": "shm", "size": size},
    }
    return Validator.from_files([CRD]).validate(pool) == []


def daemon_parses(size: str) -> bool:
    try:
        parse_size(size)
    except ValueError:
        return False
    return True


def test_the_crd_pattern_is_the_daemons() -> None:
    crd = yaml.safe_load(CRD.read_text())
    size = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["size"]
    assert size["pattern"] == SIZE_PATTERN


@given(st.from_regex(SIZE_PATTERN, fullmatch=True))
def test_every_size_the_crd_accepts_parses_to_its_kubernetes_value(size: str) -> None:
    assert parse_size(size) == int(parse_quantity(size))


@given(
    st.from_regex(QUANTITY_PATTERN, fullmatch=True)
    | st.text(max_size=12)
    | st.sampled_from(["1\n", " 1", "1 ", "64Gi\n"])
)
def test_crd_and_daemon_agree_on_every_quantity(text: str) -> None:
    assert bool(re.fullmatch(SIZE_PATTERN, text)) == daemon_parses(text), repr(text)


@pytest.mark.parametrize(
    ("size", "accepted"),
    [
        ("64Pi", True),
        ("16Gi", True),
        ("500M", True),
        ("1073741824", True),
        ("1e10", False),
        ("512m", False),
        ("1.5Gi", False),
        ("2GiB", False),
        ("0", False),
    ],
)
def test_the_cases_of_the_issue_on_both_sides(size: str, accepted: bool) -> None:
    assert crd_accepts(size) is accepted
    assert daemon_parses(size) is accepted


@pytest.mark.parametrize("size", ["1e10", "512m"])
def test_the_daemon_names_the_flag_and_the_fix(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--listen", "unix:///tmp/x.sock", "--size", size])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--size" in err and ("exponents" in err or "milli" in err)
    assert build_parser().parse_args(["serve", "--listen", "unix:///tmp/x.sock", "--size", "64Pi"]).size == 64 << 50
