"""The pool memory: one shared mapping of a shm file or a devdax device, with a small header.

Layout of the mapping::

    [0, HEADER_SIZE)                      header (magic, version, header size, epoch, capacity, uuid)
    [HEADER_SIZE, HEADER_SIZE + capacity) chunk bytes; allocator offsets are relative to HEADER_SIZE

Both backends go through the same ``mmap`` call; they differ only in how the size is learnt (a shm
file is sized by us, a devdax character device reports its size in sysfs) and in whether the file is
created. A plain file passed as ``--device`` behaves like a device, which is how tests stand in for
CXL memory.

The epoch in the header is bumped by every daemon start. Leases and pins carry it; a daemon rejects
any lease of another epoch, so offsets handed out before a restart can never be committed or
released against the new index.

The uuid names the memory itself. It is written once, when the memory first becomes part of a pool,
and kept across restarts: in a multi-node pool every node finds each shared device by it, whatever
the device is called on that node and in whatever order it is listed.

The header is in the memory every client maps read-write (a client holding the fd can map any range of
it, and a devdax device cannot be split into a read-only and a writable part), so its bytes may be
anyone's scribble. Nobody relies on them while a pool runs: clients take epoch, layout and uuid from the
authenticated hello; daemons keep their own copy and put it back (:meth:`PoolMemory.keep_header`); a start
never takes an epoch that is implausibly far ahead of the clock from it.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import mmap
import os
import re
import stat
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from maru_contracts.poolsize import HEADER_SIZE

from .limits import RateLimitedLog

log = logging.getLogger(__name__)
_restored = RateLimitedLog(log)

MAGIC = b"MARUPOOL"
VERSION = 2
# magic, version, header_size, epoch, capacity, uuid (16 bytes; all zero: not part of a pool yet)
_HEADER = struct.Struct("<8sIIQQ16s")
# An epoch found in a header further ahead of the clock (ms) than this was not written by a daemon.
MAX_EPOCH_LEAD_MS = 24 * 3600 * 1000


class PoolMemoryError(OSError):
    """The pool memory cannot be opened or mapped; the message names the path and the fix."""


@dataclass(frozen=True)
class HeaderView:
    epoch: int
    capacity: int
    uuid: str | None  # hex, or None when the memory was never given one


def device_size(path: str) -> int:
    """Bytes behind ``path``: st_size for a file, the sysfs ``size`` attribute for a devdax device."""
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if stat.S_ISCHR(st.st_mode):
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        candidates = [
            f"/sys/dev/char/{major}:{minor}/size",
            f"/sys/bus/dax/devices/{os.path.basename(path)}/size",
        ]
        for candidate in candidates:
            try:
                with open(candidate) as fh:
                    return int(fh.read().strip())
            except (OSError, ValueError):
                continue
        raise PoolMemoryError(f"device {path}: cannot read its size from sysfs ({', '.join(candidates)})")
    raise PoolMemoryError(f"device {path}: neither a regular file nor a character device")


class PoolMemory:
    """An open, mapped pool region. Owns the file descriptor so it can be passed to clients."""

    def __init__(self, path: str, fd: int, map_size: int, capacity: int, backend: str) -> None:
        self.path = path
        self.fd = fd
        self.map_size = map_size
        self.capacity = capacity
        self.backend = backend
        self.mm = mmap.mmap(fd, map_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        header = self.read_header()
        self.uuid: str | None = header.uuid if header is not None else None

    @classmethod
    def open_shm(
        cls, path: str, capacity: int, *, before_resize: Callable[[int, str], None] | None = None
    ) -> PoolMemory:
        """Create (or reuse) a shm file of at least ``HEADER_SIZE + capacity``, with that much memory reserved.

        A reused file is grown when it is too small and never shrunk (see the warning below).

        ``before_resize(fd, path)`` runs before the file is touched (the daemon takes its lock there:
        resizing a file another daemon still serves would crash that daemon's clients).
        """
        map_size = HEADER_SIZE + capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o660)
        try:
            if before_resize is not None:
                before_resize(fd, path)
            current = os.fstat(fd).st_size
            if current < map_size:
                os.ftruncate(fd, map_size)
            elif current > map_size:
                # Never shrink in place: engines keep the mapping of the previous daemon across its
                # restart, and a copy past a truncated end kills the engine with SIGBUS. The new daemon
                # only allocates below its capacity; the tail is given back when the file is removed.
                log.warning(
                    "shm %s: keeps its %d bytes although --size asks for %d (pool capacity %d); shrinking "
                    "it would crash engines that still map it. Remove the file while no engine runs to free "
                    "the rest", path, current, map_size, capacity,
                )  # fmt: skip
            # A sparse tmpfs file that outgrows its filesystem kills whichever client touches the
            # missing page with SIGBUS; reserving now turns that into a clear error at start.
            try:
                os.posix_fallocate(fd, 0, map_size)
            except OSError as err:
                raise PoolMemoryError(
                    f"shm {path}: cannot reserve {map_size} bytes ({err.strerror}); "
                    f"free space in {os.path.dirname(path)} or lower --size"
                ) from None
            return cls(path, fd, map_size, capacity, "shm")
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open_device(cls, path: str, capacity: int | None) -> PoolMemory:
        """Map a whole devdax device (or a file standing in for one); ``capacity`` defaults to all of it."""
        size = device_size(path)
        usable = size - HEADER_SIZE
        if usable <= 0:
            raise PoolMemoryError(f"device {path}: {size} bytes is too small for the {HEADER_SIZE}-byte header")
        if capacity is None:
            capacity = usable
        if capacity > usable:
            raise PoolMemoryError(
                f"device {path}: holds {usable} usable bytes but the pool needs {capacity}; "
                "lower --size or use a larger device"
            )
        fd = os.open(path, os.O_RDWR)
        try:
            # devdax only maps in multiples of its alignment; the whole device always is one.
            return cls(path, fd, size, capacity, "dax")
        except BaseException:
            os.close(fd)
            raise

    def read_header(self) -> HeaderView | None:
        return read_header_from(self.mm)

    def refresh_uuid(self) -> str | None:
        """Re-read the uuid from the header (another node may have written it since)."""
        header = self.read_header()
        self.uuid = header.uuid if header is not None else None
        return self.uuid

    def write_header(self, epoch: int) -> None:
        raw = bytes.fromhex(self.uuid) if self.uuid else bytes(16)
        _HEADER.pack_into(self.mm, 0, MAGIC, VERSION, HEADER_SIZE, epoch, self.capacity, raw)

    def keep_header(self, epoch: int, *, newer_epoch_ok: bool = False) -> bool:
        """Put this daemon's header back if the memory holds anything else; True when it had to.

        Every client maps the header read-write. Nothing trusts its bytes while the pool runs, but a
        restart, another node's agent and a human do read it. ``newer_epoch_ok``: a plausible epoch above
        ``epoch`` is left alone (another node's agent adopted the metadata server's new epoch first).
        """
        found = self.read_header()
        if found is not None and found.uuid == self.uuid and found.capacity == self.capacity:
            if found.epoch == epoch:
                return False
            if newer_epoch_ok and epoch < found.epoch <= new_epoch_floor() + MAX_EPOCH_LEAD_MS:
                return False
        self.write_header(epoch)
        _restored.warning(
            f"header:{self.path}",
            "pool memory %s: its header was overwritten (by a client: they map it read-write); put back "
            "uuid %s, epoch %d. Nothing relied on it; if this repeats, find the client writing there",
            self.path, self.uuid, epoch,
        )  # fmt: skip
        return True

    def format(self, new_uuid: str, epoch: int = 0) -> None:
        """Make this memory part of a pool under ``new_uuid``."""
        self.uuid = new_uuid
        self.write_header(epoch)
        log.info("pool memory %s: now pool device %s", self.path, new_uuid)

    def bump_epoch(self) -> int:
        """Start a new epoch: above the one in memory, and above earlier starts even if the file was recreated."""
        previous = self.read_header()
        floor = new_epoch_floor()
        last = previous.epoch if previous else 0
        if last > floor + MAX_EPOCH_LEAD_MS:
            # Clients can write the header: an epoch this far ahead of the clock is a scribble, and taken
            # at its word it would overflow the header's 64 bits at a start to come.
            log.warning(
                "pool memory %s: the header's epoch %d is far ahead of the clock (overwritten by a client?); "
                "starting from the clock", self.path, last,
            )  # fmt: skip
            last = 0
        epoch = max(last + 1, floor)
        if self.uuid is None:
            self.uuid = new_device_uuid()
        self.write_header(epoch)
        log.info("pool memory %s: epoch %d (was %s)", self.path, epoch, previous.epoch if previous else "none")
        return epoch

    def data(self) -> memoryview:
        return memoryview(self.mm)[HEADER_SIZE : HEADER_SIZE + self.capacity]

    def close(self) -> None:
        # A view still exported (a test holding a buffer) keeps the mapping until it goes.
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)


def file_identity(fd: int) -> str:
    """Which file ``fd`` is, as the kernel knows it: the device number of a character device (devdax),
    else filesystem and inode. A client that opens the pool memory by path checks it is the daemon's."""
    st = os.fstat(fd)
    if stat.S_ISCHR(st.st_mode):
        return f"rdev:{st.st_rdev}"
    return f"file:{st.st_dev}:{st.st_ino}"


def discover_devices(dev_dir: str = "/dev") -> list[str]:
    """Devdax devices of this node in a stable order (dax0.0, dax0.1, dax1.0, ...)."""
    found = [p for p in glob.glob(os.path.join(dev_dir, "dax*.*")) if stat.S_ISCHR(os.stat(p).st_mode)]

    def order(path: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", os.path.basename(path)))

    return sorted(found, key=order)


def new_device_uuid() -> str:
    return uuid.uuid4().hex


def new_epoch_floor() -> int:
    """Milliseconds since the Unix epoch: a floor that makes epochs grow across restarts without state."""
    return time.time_ns() // 1_000_000


def read_header_from(mm: mmap.mmap) -> HeaderView | None:
    magic, version, header_size, epoch, capacity, raw_uuid = _HEADER.unpack_from(mm, 0)
    if magic != MAGIC or version != VERSION or header_size != HEADER_SIZE:
        return None
    return HeaderView(epoch=epoch, capacity=capacity, uuid=raw_uuid.hex() if any(raw_uuid) else None)
