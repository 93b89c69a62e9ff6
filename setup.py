"""Extension list: every pyx/<name>.pyx becomes txmq._<name> (docs/ARCHITECTURE.md)."""
import os
import sys
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
C_SOURCES = ["csrc/crc32c.c"]
# C that one module owns: the SIGBUS handler's table must exist once.
MODULE_SOURCES = {"mapping": ["csrc/sigbus.c"]}
CFLAGS = ["-O3", "-std=c11", "-fno-strict-aliasing"]
if os.environ.get("TXMQ_DEBUG_BUILD"):
    CFLAGS = ["-O0", "-g"]


def extension(pyx: Path) -> Extension:
    name = pyx.stem.lstrip("_")
    return Extension(
        f"txmq._{name}",
        sources=[str(pyx.relative_to(HERE))] + C_SOURCES + MODULE_SOURCES.get(name, []),
        include_dirs=["csrc", "pyx", numpy.get_include()],
        extra_compile_args=CFLAGS,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )


extensions = [extension(p) for p in sorted((HERE / "pyx").glob("*.pyx"))]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        include_path=["pyx"],
        compiler_directives={"embedsignature": True},
        quiet=True,
    ),
)
