"""Read-only bind mounts, and what is mounted where (``/proc/self/mountinfo``).

mount(2) and umount2(2) are called directly (ctypes), not through the ``mount`` binary: the errno
comes back as it is, and the image needs no util-linux.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
# A socket directory holds sockets only: nothing in it is run, no device or set-uid file is honoured.
READ_ONLY_FLAGS = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC

MOUNTINFO = Path("/proc/self/mountinfo")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def bind_read_only(source: str, target: str) -> None:
    """Bind ``source`` onto ``target``, then make that mount read-only, nosuid, nodev, noexec.

    A bind mount takes the flags of its source; read-only needs a second, remounting call (the kernel
    ignores MS_RDONLY on the first). If the second call fails, the first is undone.
    """
    _check(_libc.mount(source.encode(), target.encode(), None, MS_BIND, None), f"bind {source} onto {target}")
    try:
        _check(_libc.mount(None, target.encode(), None, READ_ONLY_FLAGS, None), f"remount {target} read-only")
    except OSError:
        unmount(target)
        raise


# A credential volume: a tmpfs holding one token file. Its size bounds what a publish can take of the
# node's memory whatever happens; a token is well under 1 KiB.
TMPFS_BYTES = 64 << 10
TMPFS_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC


def mount_tmpfs(target: str, size: int = TMPFS_BYTES) -> None:
    """A writable tmpfs of ``size`` bytes at ``target``, nosuid, nodev, noexec, its root mode 0755."""
    _check(
        _libc.mount(b"tmpfs", target.encode(), b"tmpfs", TMPFS_FLAGS, f"size={size},mode=0755".encode()),
        f"mount tmpfs on {target}",
    )


def remount(target: str, *, read_only: bool) -> None:
    """Make the tmpfs at ``target`` read-only (or writable again, to replace its token)."""
    flags = MS_REMOUNT | TMPFS_FLAGS | (MS_RDONLY if read_only else 0)
    _check(
        _libc.mount(None, target.encode(), None, flags, None),
        f"remount {target} {'read-only' if read_only else 'read-write'}",
    )


def unmount(target: str) -> None:
    _check(_libc.umount2(target.encode(), 0), f"unmount {target}")


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo: where, which directory of its filesystem, with which options."""

    mount_point: str
    root: str
    options: frozenset[str]
    fs_type: str

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as \040, \011, \012 and \134.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        entries.append(
            MountEntry(
                mount_point=_unescape(fields[4]),
                root=_unescape(fields[3]),
                options=frozenset(fields[5].split(",")),
                fs_type=fields[separator + 1],
            )
        )
    return entries


def mounts_at(path: str, mountinfo: Path = MOUNTINFO) -> list[MountEntry]:
    """The mounts stacked on ``path``, oldest first (the last one is what ``path`` shows)."""
    return [e for e in parse_mountinfo(mountinfo.read_text()) if e.mount_point == path]


def same_directory(a: str, b: str) -> bool:
    """Whether two paths show the same directory (a bind mount shows its source's inode)."""
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
