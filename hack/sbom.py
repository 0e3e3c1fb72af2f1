"""The SBOM of an image's filesystem as SPDX 2.3 JSON: every Debian package dpkg lists as installed and
every Python distribution (a *.dist-info) under /usr and /opt, each with its package URL.

    python3 hack/sbom.py --root MOUNTED_IMAGE --name IMAGE_REF --output OUT.json

Standard library only: it runs on the build host (hack/sbom.sh mounts or exports the image first).
"""

from __future__ import annotations

import argparse
import datetime
import email.parser
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

Package = dict[str, object]


def debian_packages(root: Path) -> Iterator[tuple[str, str, str]]:
    """(name, version, architecture) of each package dpkg's status file marks installed."""
    status = root / "var" / "lib" / "dpkg" / "status"
    if not status.is_file():
        return
    for stanza in status.read_text(errors="replace").split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", stanza, re.MULTILINE))
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            yield fields["Package"], fields.get("Version", ""), fields.get("Architecture", "")


def python_distributions(root: Path) -> Iterator[tuple[str, str, str]]:
    """(name, version, license) of each installed distribution under /usr and /opt, found once each."""
    seen: set[tuple[str, str]] = set()
    parser = email.parser.HeaderParser()
    for top in ("usr", "opt"):
        for metadata in sorted((root / top).glob("**/*-packages/*.dist-info/METADATA")):
            headers = parser.parsestr(metadata.read_text(errors="replace"))
            name, version = headers.get("Name", ""), headers.get("Version", "")
            if name and (name.lower(), version) not in seen:
                seen.add((name.lower(), version))
                yield name, version, headers.get("License-Expression") or ""


def spdx_id(kind: str, name: str, version: str) -> str:
    return "SPDXRef-" + re.sub(r"[^A-Za-z0-9.-]", "-", f"{kind}-{name}-{version}")


def package(kind: str, name: str, version: str, purl: str, license: str = "") -> Package:
    return {
        "name": name,
        "SPDXID": spdx_id(kind, name, version),
        "versionInfo": version,
        "downloadLocation": "NOASSERTION",
        "licenseDeclared": license if re.fullmatch(r"[A-Za-z0-9.+ ()-]+", license or "") else "NOASSERTION",
        "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": purl}],
    }


def sbom(root: Path, image: str) -> dict[str, object]:
    packages = [
        package("deb", name, version, f"pkg:deb/debian/{name}@{version}?arch={arch}")
        for name, version, arch in debian_packages(root)
    ]
    packages += [
        package("pypi", name, version, f"pkg:pypi/{name.lower().replace('_', '-')}@{version}", license)
        for name, version, license in python_distributions(root)
    ]
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": image,
        "documentNamespace": f"https://spdx.org/spdxdocs/{image.replace(':', '-')}-{uuid.uuid4()}",
        "creationInfo": {
            "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "creators": ["Tool: maru-pd hack/sbom.py"],
        },
        "packages": packages,
        "relationships": [
            {"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES", "relatedSpdxElement": p["SPDXID"]}
            for p in packages
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="the image's filesystem")
    parser.add_argument("--name", required=True, help="the image's reference")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    document = sbom(args.root, args.name)
    if not document["packages"]:
        parser.error(f"--root {args.root}: no dpkg status and no Python distributions found: not an image's root")
    args.output.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
