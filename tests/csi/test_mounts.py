"""Reading the mount table: what the plugin relies on to be idempotent without keeping state."""

from __future__ import annotations

from pathlib import Path

from maru_csi.mounts import mounts_at, parse_mountinfo

MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
45 22 0:25 /maru/pool-a /var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/maru-socket/mount \
ro,nosuid,nodev,noexec,relatime shared:7 master:3 - tmpfs tmpfs rw,size=1024k
46 22 0:25 /maru/with\\040space /mnt/a\\040b rw,relatime - tmpfs tmpfs rw
47 45 0:25 /maru/pool-b /var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/maru-socket/mount rw - tmpfs tmpfs rw
"""
TARGET = "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/maru-socket/mount"


def test_fields_optional_tags_and_escapes() -> None:
    entries = parse_mountinfo(MOUNTINFO)
    assert [e.mount_point for e in entries][:3] == ["/", TARGET, "/mnt/a b"]
    bound = entries[1]
    assert bound.root == "/maru/pool-a" and bound.fs_type == "tmpfs"
    assert bound.read_only and {"nosuid", "nodev", "noexec"} <= bound.options
    assert entries[2].root == "/maru/with space" and not entries[2].read_only


def test_stacked_mounts_in_order(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    stacked = mounts_at(TARGET, info)
    assert [e.root for e in stacked] == ["/maru/pool-a", "/maru/pool-b"]
    assert mounts_at("/var/lib/kubelet", info) == []
