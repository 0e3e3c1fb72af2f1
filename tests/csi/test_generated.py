"""The CSI messages: generated code fresh, and names and field numbers those of the CSI v1 specification,
which is what lets a real kubelet and node-driver-registrar talk to the plugin."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from maru_csi import csi_pb2, protogen


def test_generated_code_is_fresh() -> None:
    assert protogen.main(["--check"]) == 0, "run python -m maru_csi.protogen"


def test_a_stale_file_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for name in ("csi.proto", *protogen.OUTPUTS):
        shutil.copy(protogen.PACKAGE_DIR / name, tmp_path / name)
    (tmp_path / "csi_pb2.py").write_text((tmp_path / "csi_pb2.py").read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(protogen, "PACKAGE_DIR", tmp_path)
    assert protogen.main(["--check"]) == 1
    assert "csi_pb2.py" in capsys.readouterr().err


# The wire contract, from the CSI specification (csi.proto, package csi.v1).
SERVICES = {
    "Identity": {"GetPluginInfo", "GetPluginCapabilities", "Probe"},
    "Node": {"NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities", "NodeGetInfo"},
}
FIELDS = {
    "GetPluginInfoResponse": {1: "name", 2: "vendor_version", 3: "manifest"},
    "GetPluginCapabilitiesResponse": {1: "capabilities"},
    "ProbeResponse": {1: "ready"},
    "NodePublishVolumeRequest": {
        1: "volume_id",
        2: "publish_context",
        3: "staging_target_path",
        4: "target_path",
        5: "volume_capability",
        6: "readonly",
        7: "secrets",
        8: "volume_context",
    },
    "NodeUnpublishVolumeRequest": {1: "volume_id", 2: "target_path"},
    "NodeGetCapabilitiesResponse": {1: "capabilities"},
    "NodeGetInfoResponse": {1: "node_id", 2: "max_volumes_per_node", 3: "accessible_topology"},
    "VolumeCapability": {1: "block", 2: "mount", 3: "access_mode"},
    "VolumeCapability.MountVolume": {1: "fs_type", 2: "mount_flags", 3: "volume_mount_group"},
    "VolumeCapability.AccessMode": {1: "mode"},
}
ACCESS_MODES = {
    "UNKNOWN": 0,
    "SINGLE_NODE_WRITER": 1,
    "SINGLE_NODE_READER_ONLY": 2,
    "MULTI_NODE_READER_ONLY": 3,
    "MULTI_NODE_SINGLE_WRITER": 4,
    "MULTI_NODE_MULTI_WRITER": 5,
    "SINGLE_NODE_SINGLE_WRITER": 6,
    "SINGLE_NODE_MULTI_WRITER": 7,
}


def test_names_and_field_numbers_are_the_specifications() -> None:
    file = csi_pb2.DESCRIPTOR
    assert file.package == "csi.v1"
    assert {name: {m.name for m in s.methods} for name, s in file.services_by_name.items()} == SERVICES
    assert file.services_by_name["Node"].methods_by_name["NodePublishVolume"].full_name == (
        "csi.v1.Node.NodePublishVolume"
    )
    for path, fields in FIELDS.items():
        message = file.message_types_by_name[path.split(".")[0]]
        for nested in path.split(".")[1:]:
            message = message.nested_types_by_name[nested]
        assert {f.number: f.name for f in message.fields} == fields, path
    assert {v.name: v.number for v in csi_pb2.VolumeCapability.AccessMode.Mode.DESCRIPTOR.values} == ACCESS_MODES
    assert file.message_types_by_name["ProbeResponse"].fields_by_name["ready"].message_type.full_name == (
        "google.protobuf.BoolValue"
    )
