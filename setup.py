"""Build of the one compiled module, ``maru_pool._copyhash``; everything else is in pyproject.toml.

No -march=native: wheels and images run on other CPUs than the one that built them, so the SIMD code
paths are compiled for their instruction sets one by one and picked at run time. The module uses the
limited C API of Python 3.11 (one ``abi3`` wheel for every CPython from 3.11 on: the vLLM image has
its own Python).

The module is optional: where it cannot be compiled (no C compiler, no Python headers) the install
goes on without it, says so loudly, and copies run on the pure Python path (``pool/copyhash.py``),
correct but several times slower. The import-time warning repeats it wherever the package runs.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

WARNING = """
{rule}
WARNING: maru_pool._copyhash was NOT built ({error}).
The install continues without it: KV copies into and out of the pool run on the pure Python
fallback, several times slower. Install a C compiler and the Python headers (e.g. gcc and
python3-dev) and reinstall to get the compiled module.
{rule}
"""


class OptionalBuildExt(build_ext):
    """Build extensions when a compiler works; otherwise warn loudly and install without them."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as err:  # a missing compiler fails here, before any extension
            self._warn(err)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as err:
            self._warn(err)

    def _warn(self, err: Exception) -> None:
        print(WARNING.format(rule="*" * 78, error=str(err).strip() or type(err).__name__), file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "maru_pool._copyhash",
            sources=["connector/maru_pool/_copyhash.c"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
