"""The NEON path of the compiled copy+checksum, built for AArch64 and run under user-mode emulation.

On an x86-64 machine the NEON kernel is neither compiled nor run by the other tests. Here the C source
is compiled for ``aarch64-linux-musl`` by zig's clang (PyPI ``ziglang``) into a static program that
feeds every code path the same bytes in uneven pieces, run with ``qemu-aarch64-static`` (Debian
``qemu-user-static``), and each checksum is compared with the ``xxhash`` package's and each copy
with its source. Skipped where either tool is missing.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import xxhash

SOURCE_DIR = Path(__file__).resolve().parents[2] / "connector" / "maru_pool"
LENGTHS = (241, 255, 256, 1000, 1024, 1025, 4096, 4097, 65536, 69999)

HARNESS = r"""
#include "_copyhash.c"
#include <stdio.h>
static uint8_t data[70000], out[70000];
int main(void) {
    uint64_t x = 0x9E3779B97F4A7C15ULL;
    for (size_t i = 0; i < sizeof data; i++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
        data[i] = (uint8_t)(x >> 56);
    }
    static const size_t lens[] = {@LENGTHS@};
    for (size_t p = 0; p < NPATHS; p++)
        for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
            size_t n = lens[l], at = 0, piece = 37;
            memset(out, 0, n);
            stream st;
            stream_init(&st, n, PATHS[p].kernel, 0);
            while (at < n) {  /* uneven pieces, as the pages of a chunk arrive */
                size_t take = n - at < piece ? n - at : piece;
                stream_feed(&st, out + at, data + at, take);
                at += take;
                piece = piece * 3 % 1500 + 1;
            }
            printf("%s %zu %llu %d\n", PATHS[p].name, n, (unsigned long long)stream_digest(&st),
                   memcmp(out, data, n) == 0);
        }
    return 0;
}
"""


def expected_data() -> bytes:
    x, mask, data = 0x9E3779B97F4A7C15, (1 << 64) - 1, bytearray(max(LENGTHS))
    for i in range(len(data)):
        x = (x * 6364136223846793005 + 1442695040888963407) & mask
        data[i] = x >> 56
    return bytes(data)


@pytest.mark.skipif(importlib.util.find_spec("ziglang") is None, reason="no AArch64 C compiler (pip install ziglang)")
@pytest.mark.skipif(shutil.which("qemu-aarch64-static") is None, reason="no qemu-aarch64-static (qemu-user-static)")
def test_the_neon_path_matches_xxhash_and_copies_exactly(tmp_path: Path) -> None:
    (tmp_path / "harness.c").write_text(HARNESS.replace("@LENGTHS@", ", ".join(map(str, LENGTHS))))
    program = tmp_path / "harness"
    build = subprocess.run(
        [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl", "-static", "-O2", "-std=c11",
         "-Wall", "-Werror=implicit-function-declaration", "-ffunction-sections", "-fdata-sections",
         "-Wl,--gc-sections", "-DPy_LIMITED_API=0x030B0000", f"-I{sysconfig.get_paths()['include']}",
         f"-I{SOURCE_DIR}", str(tmp_path / "harness.c"), "-o", str(program)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(["qemu-aarch64-static", str(program)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    data = expected_data()
    results = [line.split() for line in run.stdout.splitlines()]
    assert {path for path, *_ in results} == {"neon", "scalar"}
    for path, length, digest, copied in results:
        want = xxhash.xxh3_64_intdigest(data[: int(length)])
        assert int(digest) == want, f"{path} path, {length} bytes: {int(digest):#x} != {want:#x}"
        assert copied == "1", f"{path} path, {length} bytes: the copy differs from its source"
