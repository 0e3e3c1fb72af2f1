"""The one atomic file writer the CSI plugin, the minting init container and the admission init container share."""

from __future__ import annotations

import os
import stat

import pytest

from maru_common.files import replace_file


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o444])
def test_the_file_has_the_mode_asked_and_no_temporary_file_is_left(tmp_path, mode: int) -> None:
    before = os.umask(0o077)  # the mode must not depend on the writer's umask
    try:
        path = replace_file(str(tmp_path), "token", "one", mode)
    finally:
        os.umask(before)
    assert path == str(tmp_path / "token")
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert os.listdir(tmp_path) == ["token"]


def test_a_replacement_is_whole_and_a_read_only_old_file_does_not_stop_it(tmp_path) -> None:
    replace_file(str(tmp_path), "token", "old", 0o444)
    replace_file(str(tmp_path), "token", "new", 0o444)
    assert (tmp_path / "token").read_text() == "new"


def test_a_planted_link_is_replaced_not_written_through(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    os.symlink(target, tmp_path / "token")
    replace_file(str(tmp_path), "token", "new", 0o444)
    assert target.read_text() == "keep"
    assert not os.path.islink(tmp_path / "token")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    replace_file(str(tmp_path), "token", "old", 0o444)
    with pytest.raises(UnicodeEncodeError):
        replace_file(str(tmp_path), "token", "\udcff", 0o444)  # a lone surrogate cannot be encoded
    assert (tmp_path / "token").read_text() == "old"
    assert os.listdir(tmp_path) == ["token"]
