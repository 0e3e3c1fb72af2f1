"""An image's USER as a container runtime reads it: numbers as they are, names from the image's own files."""

from __future__ import annotations

from pathlib import Path

import pytest

from maru_localcluster.imagestore import UserNotFound, home_of, user_ids


@pytest.fixture
def root(tmp_path: Path) -> str:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nmaru:x:65532:65532::/nonexistent:/usr/sbin/nologin\nweb:x:1000:1001::/home/web:/bin/sh\n"
    )
    (etc / "group").write_text("root:x:0:\nmaru:x:65532:\nstaff:x:50:\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    ("user", "ids"),
    [
        ("", (0, 0)),
        ("65532:65532", (65532, 65532)),
        ("1000", (1000, 1001)),  # a uid in passwd gets its primary group
        ("4242", (4242, 0)),  # a uid not in passwd runs with gid 0
        ("maru", (65532, 65532)),
        ("web:staff", (1000, 50)),
        ("web:7", (1000, 7)),
    ],
)
def test_user_ids(root: str, user: str, ids: tuple[int, int]) -> None:
    assert user_ids(user, root) == ids


def test_unknown_names_are_errors_that_name_them(root: str) -> None:
    with pytest.raises(UserNotFound, match="unable to find user nobody-here"):
        user_ids("nobody-here", root)
    with pytest.raises(UserNotFound, match="unable to find group wheel"):
        user_ids("maru:wheel", root)


def test_home_comes_from_passwd(root: str) -> None:
    assert home_of(65532, root) == "/nonexistent"
    assert home_of(1000, root) == "/home/web"
    assert home_of(4242, root) == "/"
