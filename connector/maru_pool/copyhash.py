"""Copy chunk bytes and checksum them (xxh3_64) in one pass.

Every byte a chunk store or load moves is also hashed: writers compute the checksum, readers verify
it. Done as a copy and then a hash, that is two passes over memory in Python with the GIL held; the
compiled module ``maru_pool._copyhash`` (built at install from ``_copyhash.c``) hashes each
64-byte stripe from the registers it copies it through, with the GIL released, so a store or a load
costs about one memcpy. Without it (a build without a C compiler) the same functions run on the
``xxhash`` package, which is also the reference the compiled hash is tested against.

Segments are ``(address, length)`` ranges of process memory (the pages of a chunk in the engine's KV
cache): :func:`gather_checksum` copies them into a buffer, :func:`scatter_checksum` copies a buffer
out into them, address 0 meaning "hash this part, copy it nowhere". Addresses are trusted: the caller
holds whatever they point into for the whole call.

Copies into the pool store around the CPU cache (non-temporal stores): other processes read that
memory, this one does not, and such stores need not first read each line they overwrite. Loads do
the same when the chunk is too large to stay in cache anyway, as glibc's memcpy does for large copies.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import xxhash

log = logging.getLogger(__name__)

try:
    from maru_pool import _copyhash as _compiled
except ImportError as err:
    _compiled = None
    log.warning(
        "maru pool: the compiled copy+checksum module is missing (%s); copies run at Python speed, several "
        "times slower. Install a C compiler and the Python headers, then reinstall the package",
        err,
    )

#: True when the compiled module was built and imports.
NATIVE = _compiled is not None
# The implementation in use: the compiled module, or None for the xxhash fallback.
_native = _compiled

Segment = tuple[int, int]

# Fallback only: copy and hash block by block so the hash pass reads what the copy just touched.
# Measured on an EPYC (1 MiB of L2 per core) between shm and heap buffers: 1 MiB blocks beat
# 32-256 KiB blocks by ~45% on loads and match them on stores.
_BLOCK = 1 << 20
# Loads larger than this store around the cache: more than a core's share of L3 on current servers.
_NONTEMPORAL_LOAD_BYTES = 4 << 20


def use_native(enabled: bool) -> bool:
    """Run on the compiled module (when built) or on the fallback; returns the previous choice.

    For measuring the one against the other and for testing the fallback; production never calls it.
    """
    global _native
    previous = _native is not None
    _native = _compiled if enabled else None
    return previous


def simd() -> str:
    """The code path copies run on: ``avx512``, ``avx2``, ``sse2``, ``neon``, ``scalar``, or ``python`` (fallback)."""
    return _native.simd() if _native is not None else "python"


def checksum(buf: Any) -> int:
    """xxh3_64 of a buffer's bytes."""
    if _native is not None:
        return _native.hash(buf)
    return xxhash.xxh3_64_intdigest(buf)


def copy_checksum(dst: memoryview, src: memoryview, *, to_pool: bool) -> int:
    """Copy ``src`` into ``dst`` (same size) and return the checksum of the bytes copied.

    ``to_pool``: a store (``dst`` is pool memory) rather than a load. The fallback, which reads memory
    twice, then hashes ``src`` (the checksum describes the caller's bytes), and on a load what landed
    in ``dst`` (pool memory is read once, so what the caller gets is what was checked). The compiled
    module hashes the very registers it copies through, which is both.
    """
    if _native is not None:
        return _native.copy_hash(dst, src, nontemporal=to_pool or src.nbytes > _NONTEMPORAL_LOAD_BYTES)
    if dst.readonly:
        raise TypeError("copy_hash: dst is read-only; it must be a writable buffer")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy_hash: dst holds {dst.nbytes} bytes, src {src.nbytes}; they must be the same size")
    hashed = src if to_pool else dst
    hasher = xxhash.xxh3_64()
    for start in range(0, src.nbytes, _BLOCK):
        end = min(start + _BLOCK, src.nbytes)
        dst[start:end] = src[start:end]
        hasher.update(hashed[start:end])
    return hasher.intdigest()


def gather_checksum(dst: memoryview, segments: Sequence[Segment]) -> int:
    """Copy the memory ``segments`` back to back into ``dst``, pool memory of their total size; checksum of
    the bytes."""
    if _native is not None:
        return _native.gather_hash(dst, segments, nontemporal=True)
    if dst.readonly:
        raise TypeError("gather_hash: dst is read-only; it must be a writable buffer")
    _check_segments("gather_hash", segments, dst.nbytes, holes=False)
    hasher = xxhash.xxh3_64()
    at = 0
    for address, length in segments:
        src = _memory_at(address, length)
        dst[at : at + length] = src
        hasher.update(src)
        at += length
    return hasher.intdigest()


def scatter_checksum(src: memoryview, segments: Sequence[Segment]) -> int:
    """Copy ``src`` back to back into the memory ``segments`` (address 0: skip); checksum of all of ``src``."""
    if _native is not None:
        return _native.scatter_hash(src, segments, nontemporal=src.nbytes > _NONTEMPORAL_LOAD_BYTES)
    _check_segments("scatter_hash", segments, src.nbytes, holes=True)
    hasher = xxhash.xxh3_64()
    at = 0
    for address, length in segments:
        if address:
            dst = _memory_at(address, length)
            dst[:] = src[at : at + length]
            hasher.update(dst)  # the copy, as copy_checksum does on a load
        else:
            hasher.update(src[at : at + length])
        at += length
    return hasher.intdigest()


def gather_checksum_many(items: Sequence[tuple[memoryview, Sequence[Segment]]]) -> list[int]:
    """:func:`gather_checksum` for each ``(dst, segments)`` item, in one call.

    The compiled module releases the GIL once for all of them: a copy thread must not queue for the
    GIL between chunks behind the engine's busy thread (each wait can last a switch interval).
    """
    if _native is not None:
        return _native.gather_hash_many(items, nontemporal=True)
    return [gather_checksum(dst, segments) for dst, segments in items]


def scatter_checksum_many(items: Sequence[tuple[memoryview, Sequence[Segment]]]) -> list[int]:
    """:func:`scatter_checksum` for each ``(src, segments)`` item, in one call (see :func:`gather_checksum_many`)."""
    if _native is not None:
        large = any(src.nbytes > _NONTEMPORAL_LOAD_BYTES for src, _ in items)
        return _native.scatter_hash_many(items, nontemporal=large)
    return [scatter_checksum(src, segments) for src, segments in items]


def _check_segments(fn: str, segments: Sequence[Segment], nbytes: int, *, holes: bool) -> None:
    total = 0
    for i, (address, length) in enumerate(segments):
        if address < 0 or length < 0:
            raise ValueError(f"{fn}: segment {i} has a negative {'length' if length < 0 else 'address'}")
        if address == 0 and length and not holes:
            raise ValueError(f"{fn}: segment {i} has address 0; every source must be real memory")
        total += length
    if total != nbytes:
        side = "src" if holes else "dst"
        raise ValueError(f"{fn}: segments hold {total} bytes, {side} {nbytes}; they must be equal")


def _memory_at(address: int, length: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")
