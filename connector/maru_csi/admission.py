"""Which pods a pool admits: the admission file beside the pool's socket, and its check at publish.

The CSI node plugin publishes a pool's socket directory only to a pod the pool admits. The rule comes
from the MaruPool's ``spec.allowedNamespaces`` (the one source of truth): the operator renders it into
the pool's agent DaemonSet, whose init container (``python -m maru_csi.admission``, root, in
the pool's namespace) writes it as ``<socket root>/<pool>/admission.json`` on each pool node before the
agent starts. Nothing a tenant writes is trusted: not the volume's attributes (the pod's author writes
those), and not a file a pod could write (pods get the directory read-only, and only root-owned files
that no other user may write are read).

Refused closed: a missing, unreadable or malformed file admits nobody. A pool without
``allowedNamespaces`` admits every namespace, and its file says so (``"admit": "AllNamespaces"``), so a
missing file never means "allow all".

No gRPC here: the operator renders the document with :func:`maru_contracts.csi.admission_document`, and the agent's init
container runs this module from the pool image without the plugin's runtime.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maru_common.cmdline import OneLineParser
from maru_common.files import replace_file
from maru_contracts.csi import ADMISSION_VERSION as VERSION
from maru_contracts.csi import ADMIT_ALL, ADMIT_LISTED
from maru_contracts.csi import render_admission as render

ADMISSION_FILE = "admission.json"
# A few hundred namespaces fit many times over; anything larger is not a file the init container wrote.
MAX_BYTES = 64 << 10


class AdmissionError(Exception):
    """The admission data is missing, unreadable or malformed: the pool admits nobody until it is fixed."""


class Refused(Exception):
    """A pod the pool does not admit; the message names the pod's namespace, the pool and the rule."""


@dataclass(frozen=True)
class PodIdentity:
    """Who asks for the volume, from the publish context the kubelet fills (podInfoOnMount).

    ``service_account`` is not checked yet: pool credentials are minted at publish for any cache of an
    admitted namespace (:mod:`.minting`). A rule naming each group's service account would bind a credential
    to it in :meth:`Admission.check`: that is why it is carried here already.
    """

    namespace: str
    name: str
    service_account: str

    def describe(self) -> str:
        return f"{self.namespace or '<unknown namespace>'}/{self.name or '<unknown pod>'}"


@dataclass(frozen=True)
class Admission:
    """A pool's admission rule: every namespace, or the listed ones (never empty)."""

    pool: str
    namespaces: tuple[str, ...] | None  # None: every namespace (the rule says so explicitly)
    directory: str  # the pool's socket directory name: its own, or the short form of a long one

    def rule(self) -> str:
        if self.namespaces is None:
            return "no spec.allowedNamespaces: every namespace"
        return f"spec.allowedNamespaces {list(self.namespaces)}"

    def check(self, pod: PodIdentity) -> None:
        """Raise :class:`Refused` unless the pool admits ``pod``."""
        if self.namespaces is None:
            return
        if not pod.namespace:
            raise Refused(
                f"MaruPool {self.pool} admits only the namespaces of its {self.rule()}, and the kubelet sent no "
                "pod namespace: the CSIDriver csi.maru.io needs podInfoOnMount: true (the chart sets it)"
            )
        if pod.namespace not in self.namespaces:
            raise Refused(
                f"namespace {pod.namespace} (pod {pod.describe()}) is not admitted by MaruPool {self.pool}: "
                f"its {self.rule()} does not list {pod.namespace}; add it there, or use a pool that admits it"
            )
        # Where a rule naming each group's service account would bind pod.service_account.


def parse(text: str | bytes, where: str) -> Admission:
    """Read an admission document strictly; anything unexpected is an :class:`AdmissionError`."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise AdmissionError(f"{where} is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise AdmissionError(f"{where} is not a JSON object")
    if doc.get("version") != VERSION:
        raise AdmissionError(f"{where} has version {doc.get('version')!r}; this plugin reads version {VERSION}")
    pool = doc.get("pool")
    if not isinstance(pool, str) or not pool:
        raise AdmissionError(f"{where} names no pool")
    directory = doc.get("directory", pool)
    if not isinstance(directory, str) or not directory:
        raise AdmissionError(f"{where}: directory, when present, is the pool's socket directory name")
    admit = doc.get("admit")
    if admit == ADMIT_ALL:
        if set(doc) - {"directory"} != {"version", "pool", "admit"}:
            raise AdmissionError(f"{where}: admit {ADMIT_ALL} takes no other field")
        return Admission(pool, None, directory)
    if admit != ADMIT_LISTED:
        raise AdmissionError(f"{where}: admit is {admit!r}, not {ADMIT_ALL!r} or {ADMIT_LISTED!r}")
    namespaces = doc.get("namespaces")
    if not isinstance(namespaces, list) or not namespaces or not all(isinstance(n, str) and n for n in namespaces):
        raise AdmissionError(f"{where}: admit {ADMIT_LISTED} needs a non-empty list of namespace names")
    known = {"version", "pool", "admit", "namespaces"}
    if set(doc) - {"directory"} != known:
        raise AdmissionError(f"{where} has unknown fields {sorted(set(doc) - known - {'directory'})}")
    return Admission(pool, tuple(namespaces), directory)


def read(pool_dir: str) -> Admission:
    """The admission rule of the pool whose socket directory is ``pool_dir``, as its agent wrote it.

    Only a regular file (not a link) owned by root or by this process's user, and writable by its owner
    alone, is read: anything else could have been written by someone other than the pool's agent. The
    file must name the pool whose directory holds it: a copy of another pool's (laxer) rule is refused.
    """
    path = os.path.join(pool_dir, ADMISSION_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AdmissionError(
            f"{path} is missing: the pool's agent on this node writes it before it starts "
            "(an agent rendered by an older operator does not)"
        ) from None
    except OSError as err:
        raise AdmissionError(f"{path} cannot be opened ({os.strerror(err.errno or 0)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AdmissionError(f"{path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise AdmissionError(
                f"{path} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}: "
                "only a root-owned file that no other user may write is trusted"
            )
        if st.st_size > MAX_BYTES:
            raise AdmissionError(f"{path} is larger than {MAX_BYTES} bytes")
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    rule = parse(data, path)
    directory = os.path.basename(os.path.normpath(pool_dir))
    if rule.directory != directory:
        raise AdmissionError(
            f"{path} is the rule of pool {rule.pool!r}, not of {directory!r} whose directory "
            "holds it: each pool's agent writes its own"
        )
    return rule


def write(pool_dir: str, document: dict[str, Any]) -> str:
    """Write the admission file into ``pool_dir`` atomically (a reader sees the old file or the new one)."""
    text = render(document)
    parse(text, "the admission document")  # never write what the plugin would refuse
    os.makedirs(pool_dir, mode=0o755, exist_ok=True)
    # Pods admitted to the directory may read it; nobody but root writes it.
    return replace_file(pool_dir, ADMISSION_FILE, text + "\n", 0o644)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m maru_csi.admission --dir DIR --document JSON``: the agent's init container."""
    parser = OneLineParser(prog="maru-admission", description="Write a pool's admission file beside its socket.")
    parser.add_argument("--dir", required=True, help="the pool's socket directory on the node")
    parser.add_argument("--document", required=True, help="the admission document (JSON), rendered by the operator")
    args = parser.parse_args(argv)
    try:
        document = json.loads(args.document)
        parse(args.document, "--document")
    except (ValueError, AdmissionError) as err:
        parser.error(str(err))
    path = write(args.dir, document)
    print(f"maru-admission wrote {path}: {render(document)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
