"""Build of the one compiled module, ``maru_connector._copyhash``; everything else is in pyproject.toml.

No -march=native: wheels and images run on other CPUs than the one that built them, so the SIMD code
paths are compiled for their instruction sets one by one and picked at run time. The module uses the
limited C API of Python 3.11 (one ``abi3`` wheel for every CPython from 3.11 on: the vLLM image has
its own Python).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "maru_connector._copyhash",
            sources=["connector/maru_connector/_copyhash.c"],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
