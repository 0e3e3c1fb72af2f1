"""Any valid owner name (a DNS-1123 subdomain up to 253 characters) gives valid, stable, distinct children."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from maru_operator.api.common import DNS1123_SUBDOMAIN_PATTERN
from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import Owner, labels
from maru_operator.builders.pool import build_pool_children
from maru_operator.names import child_name, is_dns1035, is_label_value, label_value
from tests.support.specs import assert_valid, group_spec, pool_spec, pool_view

subdomains = st.from_regex(DNS1123_SUBDOMAIN_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 253)
suffixes = st.sampled_from(["", "prefill", "decode", "router", "agent", "metadata"])


@settings(deadline=None)
@given(subdomains, suffixes)
def test_child_names_are_valid_labels(owner: str, suffix: str) -> None:
    name = child_name(owner, suffix)
    assert is_dns1035(name), name
    assert name == child_name(owner, suffix)  # stable
    if suffix:
        assert name.endswith("-" + suffix)


@settings(deadline=None)
@given(subdomains, subdomains)
def test_distinct_owners_distinct_children(a: str, b: str) -> None:
    if a != b:
        assert child_name(a, "prefill") != child_name(b, "prefill")
        assert label_value(a) != label_value(b)


@settings(deadline=None)
@given(st.text(max_size=300))
def test_label_values_always_valid(value: str) -> None:
    assert is_label_value(label_value(value))


def test_short_names_are_exact() -> None:
    assert child_name("llama", "prefill") == "llama-prefill"
    assert label_value("llama.v2") == "llama.v2"


def test_long_name_is_cut_with_hash() -> None:
    owner = "a" * 253
    name = child_name(owner, "prefill")
    assert len(name) <= 63 and name.endswith("-prefill")
    assert child_name("a" * 252 + "b", "prefill") != name


def test_dotted_and_digit_names() -> None:
    assert is_dns1035(child_name("llama.3-8b", "router"))
    assert is_dns1035(child_name("7b", ""))


@settings(max_examples=25, deadline=None)
@given(subdomains)
def test_every_child_of_a_long_named_owner_validates(name: str) -> None:
    group = Owner(kind="InferenceGroup", name=name, namespace="llm", uid="u")
    for child in build_group_children(group_spec(), group, pool_view()):
        assert_valid(child)
        assert all(is_label_value(v) for v in child["metadata"]["labels"].values())
    pool = Owner(kind="MaruPool", name=name, uid="u")
    for child in build_pool_children(pool_spec(), pool, "maru-system"):
        assert_valid(child)
    assert all(is_label_value(v) for v in labels(group, app="vllm", component="x").values())
