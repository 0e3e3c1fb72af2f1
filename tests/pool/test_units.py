from __future__ import annotations

import pytest

from maru_pool.units import Endpoint, parse_endpoint, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1 << 30),
        ("64Gi", 64 << 30),
        ("512Mi", 512 << 20),
        ("512M", 512_000_000),
        ("4Ki", 4096),
        ("2k", 2000),
        ("1Ti", 1 << 40),
        ("64Pi", 64 << 50),
        ("3Ei", 3 << 60),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("", "whole number"),
        ("0", "whole number"),
        ("-1G", "whole number"),
        ("G", "whole number"),
        ("12 parsecs", "whole number"),
        ("1e10", "exponents"),
        ("1E3", "exponents"),
        ("512m", "milli"),
        ("1.5G", "fractions"),
        ("1.5", "fractions"),
        ("2GiB", "without B"),
        ("4kib", "whole number"),
        ("4K", "lower-case k"),
    ],
)
def test_parse_size_rejects_with_a_hint(text: str, hint: str) -> None:
    with pytest.raises(ValueError, match=hint):
        parse_size(text)


def test_parse_endpoint() -> None:
    assert parse_endpoint("unix:///run/maru/pool.sock") == Endpoint(kind="unix", path="/run/maru/pool.sock")
    assert parse_endpoint("tcp://0.0.0.0:7400") == Endpoint(kind="tcp", host="0.0.0.0", port=7400)
    assert parse_endpoint("tcp://[::1]:7400").host == "::1"
    assert parse_endpoint("tcp://[::1]:7400").url == "tcp://[::1]:7400"
    assert parse_endpoint("tcp://meta.maru.svc:7400").url == "tcp://meta.maru.svc:7400"


@pytest.mark.parametrize("url", ["unix://relative.sock", "http://x:1", "tcp://host", "tcp://:80", "tcp://h:99999"])
def test_parse_endpoint_rejects(url: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(url)


def test_discover_devices_ignores_regular_files(tmp_path) -> None:
    from maru_pool.memory import discover_devices

    (tmp_path / "dax0.0").write_bytes(b"")
    assert discover_devices(str(tmp_path)) == []
