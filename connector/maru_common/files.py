"""Files other processes read while they are being replaced."""

from __future__ import annotations

import contextlib
import os
import tempfile


def replace_file(directory: str, name: str, text: str, mode: int) -> str:
    """Write ``text`` to ``directory/name`` atomically: a reader sees the old file or the new one, never a part.

    The temporary file is created exclusively (never through a planted link) with ``mode`` set before the rename,
    and synced first, so a node crash leaves one of the two versions. Returns the path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), mode)
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        path = os.path.join(directory, name)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
