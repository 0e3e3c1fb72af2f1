"""The one-pass copy and checksum: the compiled module against the xxhash package, on every code path.

xxhash is the independent reference: every checksum here must equal ``xxhash.xxh3_64_intdigest`` of
the bytes, on every SIMD path this CPU can run, for every length up to 4 KiB, for large sizes, at odd
alignments and in any split into segments. The mutation tests build copies of the C source with one
constant changed and show that these checks catch each of them.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import random
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from maru_pool import copyhash

SOURCE = Path(__file__).resolve().parents[2] / "connector" / "maru_pool" / "_copyhash.c"
ALL_PATHS = ("avx512", "avx2", "sse2", "neon", "scalar")
RNG = random.Random(20240611)
DATA = RNG.randbytes(3 * (1 << 20) + 4099)


def native():
    from maru_pool import _copyhash

    return _copyhash


def test_the_compiled_module_is_built_and_in_use() -> None:
    """CI must not pass on the Python fallback: the editable install (make venv) builds the module."""
    module = native()  # ImportError here: `pip install -e .` (or `python setup.py build_ext --inplace`)
    assert copyhash.NATIVE
    assert copyhash.simd() == module.simd() in module.simd_paths()
    assert module.simd_paths()[-1] == "scalar"
    if sys.platform == "linux" and "x86_64" in sysconfig.get_platform():
        assert "sse2" in module.simd_paths()  # the x86-64 baseline


@pytest.fixture(params=ALL_PATHS)
def simd(request: pytest.FixtureRequest) -> Iterator[str]:
    module = native()
    if request.param not in module.simd_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    previous = module.set_simd(request.param)
    yield request.param
    module.set_simd(previous)


def addr(buf: bytearray | memoryview, offset: int = 0) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) + offset


def aligned(n: int, to: int = 64) -> memoryview:
    """n writable bytes starting at an address that is a multiple of ``to`` (non-temporal stores need it)."""
    raw = bytearray(n + to)
    skip = -ctypes.addressof((ctypes.c_char * len(raw)).from_buffer(raw)) % to
    return memoryview(raw)[skip : skip + n]


def split(n: int, rng: random.Random) -> list[int]:
    """Random piece lengths summing to n: zero-length, one-byte, odd and stripe-sized pieces mixed."""
    out = []
    while n:
        piece = min(n, rng.choice([0, 1, 7, 63, 64, 65, 100, 1024, 4096, rng.randrange(1, 70_000)]))
        out.append(piece)
        n -= piece
    return out


def mismatches(module, *, first: bool = False) -> list[str]:
    """Every length 0..4096 and some large ones, aligned and not: what differs from xxhash (the mutation
    tests run this same check on broken builds, stopping at the ``first`` difference)."""
    bad = []
    lengths = [*range(4097), *(RNG.randrange(4097, len(DATA) - 64) for _ in range(40)), len(DATA) - 64]
    for n in lengths:
        offset = n % 61
        src = memoryview(DATA)[offset : offset + n]
        want = xxhash.xxh3_64_intdigest(src)
        dst = bytearray(n + 1)
        got = module.copy_hash(memoryview(dst)[1:], src)
        around = aligned(n)  # whole aligned kilobytes go around the cache
        got_nontemporal = module.copy_hash(around, src, nontemporal=True)
        if got != want or dst[1:] != src or module.hash(src) != want or got_nontemporal != want or around != src:
            bad.append(f"length {n} at offset {offset}")
            if first:
                break
    return bad


def test_every_length_and_alignment_matches_xxhash(simd: str) -> None:
    assert mismatches(native()) == []


def test_gather_in_any_split_is_the_hash_of_the_whole(simd: str) -> None:
    module = native()
    src = bytearray(DATA[: 1 << 20])
    for n in (241, 1000, 1024, 1025, 65_536, 1 << 20):
        for trial in range(4):
            pieces = split(n, random.Random(n * 10 + trial))
            segments, at = [], 0
            for length in pieces:
                segments.append((addr(src, at), length))
                at += length
            for nontemporal in (False, True):
                dst = aligned(n)
                digest = module.gather_hash(dst, segments, nontemporal=nontemporal)
                assert digest == xxhash.xxh3_64_intdigest(src[:n]), (n, pieces, nontemporal)
                assert dst == src[:n]


def test_scatter_copies_each_range_and_hashes_the_holes_too(simd: str) -> None:
    module = native()
    for n, nontemporal in itertools.product((300, 4096, 70_001, 1 << 20), (False, True)):
        src = memoryview(DATA)[3 : 3 + n]
        out = aligned(n + 128)  # ranges start 64 bytes in: aligned, as KV pages are
        out[:] = b"\xee" * len(out)
        segments, at, holes = [], 0, []
        for i, length in enumerate(split(n, random.Random(n))):
            if i % 3 == 1:
                segments.append((0, length))  # hashed, copied nowhere
                holes.append((at, length))
            else:
                segments.append((addr(out, 64 + at), length))
            at += length
        assert module.scatter_hash(src, segments, nontemporal=nontemporal) == xxhash.xxh3_64_intdigest(src)
        want = bytearray(src)
        for start, length in holes:
            want[start : start + length] = b"\xee" * length
        assert out[64 : 64 + n] == want
        assert out[:64] == b"\xee" * 64 and out[64 + n :] == b"\xee" * 64  # nothing past the ranges


def test_short_inputs_and_empty_segments() -> None:
    module = native()
    for n in (0, 1, 16, 17, 128, 129, 240):
        src = bytearray(DATA[:n])
        dst = bytearray(n)
        assert module.gather_hash(dst, [(addr(src), n)] if n else []) == xxhash.xxh3_64_intdigest(src)
        assert dst == src
        assert module.scatter_hash(src, [(0, n), (0, 0)]) == xxhash.xxh3_64_intdigest(src)
    assert module.gather_hash(bytearray(), []) == xxhash.xxh3_64_intdigest(b"")


def test_bad_arguments_are_refused_with_clear_errors() -> None:
    module = native()
    src = bytearray(1000)
    with pytest.raises(TypeError, match="dst is read-only"):
        module.copy_hash(bytes(1000), src)
    with pytest.raises(TypeError, match="dst is read-only"):
        module.gather_hash(memoryview(bytearray(1000)).toreadonly(), [(addr(src), 1000)])
    with pytest.raises(ValueError, match="dst holds 999 bytes, src 1000"):
        module.copy_hash(bytearray(999), src)
    with pytest.raises(ValueError, match="segments hold 999 bytes, dst 1000"):
        module.gather_hash(bytearray(1000), [(addr(src), 999)])
    with pytest.raises(ValueError, match="segments hold 1001 bytes, src 1000"):
        module.scatter_hash(src, [(0, 1000), (0, 1)])
    with pytest.raises(ValueError, match="segment 1 has a negative length"):
        module.scatter_hash(src, [(0, 1001), (0, -1)])
    with pytest.raises(ValueError, match="segment 0 has a negative address"):
        module.scatter_hash(src, [(-5, 1000)])
    with pytest.raises(ValueError, match="segment 0 has address 0"):
        module.gather_hash(bytearray(1000), [(0, 1000)])
    with pytest.raises(TypeError, match=r"segment 0 is not an \(address, length\) pair"):
        module.gather_hash(bytearray(1000), [(addr(src), 1000, 1)])
    with pytest.raises(TypeError, match="segments must be a sequence"):
        module.gather_hash(bytearray(1000), 42)
    with pytest.raises(TypeError, match="src must be a contiguous buffer"):
        module.copy_hash(bytearray(2), memoryview(bytearray(4))[::2])
    with pytest.raises(ValueError, match="unknown path"):
        module.set_simd("mmx")


@pytest.fixture
def fallback() -> Iterator[None]:
    previous = copyhash.use_native(False)
    yield
    copyhash.use_native(previous)


def test_the_fallback_gives_the_same_answers(fallback: None) -> None:
    """Without the compiled module (a build without a C compiler) the same calls run on xxhash."""
    assert copyhash.simd() == "python"
    src = bytearray(DATA[: 3 * copyhash._BLOCK + 5])
    want = xxhash.xxh3_64_intdigest(src)
    for to_pool in (False, True):
        dst = bytearray(len(src))
        assert copyhash.copy_checksum(memoryview(dst), memoryview(src), to_pool=to_pool) == want
        assert dst == src
    assert copyhash.checksum(src) == want
    segments = [(addr(src, 0), 100), (addr(src, 100), 0), (addr(src, 100), len(src) - 100)]
    dst = bytearray(len(src))
    assert copyhash.gather_checksum(memoryview(dst), segments) == want and dst == src
    out = bytearray(len(src))
    holes = [(addr(out, 0), 100), (0, 1000), (addr(out, 1100), len(src) - 1100)]
    assert copyhash.scatter_checksum(memoryview(src), holes) == want
    assert out[:100] == src[:100] and out[100:1100] == bytes(1000) and out[1100:] == src[1100:]
    with pytest.raises(ValueError, match="segments hold 100 bytes, dst"):
        copyhash.gather_checksum(memoryview(dst), segments[:1])
    with pytest.raises(TypeError, match="read-only"):
        copyhash.gather_checksum(memoryview(dst).toreadonly(), segments)


# --- mutation tests: a wrong constant must fail the checks above ------------------------------------

MUTATIONS = {
    # (what is replaced, by what): each must occur exactly once in the source.
    "secret byte": ("0x45, 0xcb, 0x3a, 0x8f", "0x45, 0xcb, 0x3b, 0x8f"),
    "scramble prime": ("#define PRIME32_1 0x9E3779B1U", "#define PRIME32_1 0x9E3779B3U"),
    "last stripe offset": ("(SECRET_SIZE - STRIPE - 7)", "(SECRET_SIZE - STRIPE - 8)"),
    "avalanche multiplier": ("AVALANCHE_MUL 0x165667919E3779F9ULL", "AVALANCHE_MUL 0x165667B19E3779F9ULL"),
    "lane swap": ("acc[j ^ 1] += v;", "acc[j] += v;"),
}


def build(source: str, where: Path) -> Path:
    """Compile ``source`` as a top-level module ``_copyhash`` in ``where`` (the build flags of the real one)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    c_file = where / "_copyhash.c"
    c_file.write_text(source)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    cmd = [compiler, "-O1", "-std=c11", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}"]
    subprocess.run([*cmd, str(c_file), "-o", str(where / f"_copyhash{suffix}")], check=True, timeout=120)
    return where


def run_check(where: Path, simd: str, *, first: bool) -> list[str]:
    code = (
        "import sys, json\n"
        f"sys.path.insert(0, {str(where)!r})\n"
        "import _copyhash\n"
        "from tests.pool.test_copyhash import mismatches\n"
        f"_copyhash.set_simd({simd!r})\n"
        f"print(json.dumps(mismatches(_copyhash, first={first})))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def original_source() -> str:
    return SOURCE.read_text()


def test_an_unchanged_build_passes_the_check(tmp_path: Path, original_source: str) -> None:
    """The control of the mutation tests: the check passes on a fresh build of the real source."""
    assert run_check(build(original_source, tmp_path), native().simd(), first=False) == []


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_constant_fails_the_check(tmp_path: Path, original_source: str, mutation: str) -> None:
    old, new = MUTATIONS[mutation]
    assert original_source.count(old) == 1, f"the source changed: update the mutation {mutation!r}"
    where = build(original_source.replace(old, new), tmp_path)
    for simd in sorted({native().simd(), "scalar"}):
        assert run_check(where, simd, first=True), f"{mutation} on the {simd} path went unnoticed"


def test_a_wrong_shuffle_fails_the_check(tmp_path: Path, original_source: str) -> None:
    """The SIMD paths' own lane pairing (acc[j^1] += v[j]) is a shuffle: break it and the check fails."""
    old = "#define SWAP_LANES _MM_SHUFFLE(1, 0, 3, 2)"
    if old not in original_source or native().simd() == "scalar":
        pytest.skip("no SIMD path here")
    where = build(original_source.replace(old, "#define SWAP_LANES _MM_SHUFFLE(3, 2, 1, 0)"), tmp_path)
    assert run_check(where, native().simd(), first=True)
