from __future__ import annotations

import pytest

from maru_connector.pool.units import Endpoint, parse_endpoint, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1 << 30),
        ("2GiB", 2 << 30),
        ("64Gi", 64 << 30),
        ("512Mi", 512 << 20),
        ("512M", 512_000_000),
        ("1.5G", 1_500_000_000),
        ("4kib", 4096),
        ("1Ti", 1 << 40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "2XB", "-1G", "0", "1.5", "G", "12 parsecs"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
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
    from maru_connector.pool.memory import discover_devices

    (tmp_path / "dax0.0").write_bytes(b"")
    assert discover_devices(str(tmp_path)) == []
