"""Build of roundpipe._C: C++17 + OpenMP, SIMD levels compiled per file.

Sources named `*_avx2.cpp` are compiled with AVX2/FMA/F16C flags and `*_avx512.cpp`
with AVX-512 F/BW/VL/BF16 flags; everything else targets baseline x86-64, and
csrc/cpu_features.cpp picks the level at load time.  No -march=native, no torch
headers: the build needs setuptools and pybind11 only.
"""
import glob
import os
import platform
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

X86 = platform.machine().lower() in ("x86_64", "amd64")
LEVEL_FLAGS = {
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"],
}
BASE_FLAGS = ["-O3", "-fno-math-errno", "-fvisibility=hidden", "-fopenmp"]
if os.environ.get("ROUNDPIPE_DEBUG_BUILD"):
    BASE_FLAGS = ["-O0", "-g", "-fopenmp"]


class BuildExt(build_ext):
    """Compiles SIMD-level sources with their own flags, then links everything."""

    def build_extension(self, ext):
        extra_objects = []
        for suffix, flags in LEVEL_FLAGS.items():
            level_sources = [s for s in ext.sources if s.endswith(suffix)]
            if not level_sources:
                continue
            ext.sources = [s for s in ext.sources if s not in level_sources]
            if not X86:  # the level files compile to scalar forwarders there
                flags = []
            extra_objects += self.compiler.compile(
                level_sources,
                output_dir=self.build_temp,
                include_dirs=ext.include_dirs,
                macros=ext.define_macros,
                extra_postargs=ext.extra_compile_args + flags,
                depends=ext.depends,
            )
        ext.extra_objects = list(ext.extra_objects or []) + extra_objects
        super().build_extension(ext)


# One compiler process per CPU (ROUNDPIPE_BUILD_JOBS overrides): 28 sources build in ~1 min serially.
ParallelCompile("ROUNDPIPE_BUILD_JOBS", default=0).install()

sources = sorted(glob.glob("csrc/*.cpp"))
ext = Pybind11Extension(
    "roundpipe._C",
    sources,
    include_dirs=["csrc"],
    depends=sorted(glob.glob("csrc/*.h")),
    cxx_std=17,
    extra_compile_args=BASE_FLAGS,
    extra_link_args=["-fopenmp", "-ldl"],  # dlopen of the CUDA runtime (separate libdl before glibc 2.34)
)

if sys.platform == "darwin":  # Apple clang has no -fopenmp without libomp
    ext.extra_compile_args = [f for f in ext.extra_compile_args if f != "-fopenmp"]
    ext.extra_link_args = []

# kernels/ sits at the top of the repository and installs as roundpipe.kernels.
packages = find_packages(include=["roundpipe", "roundpipe.*"]) + ["roundpipe.kernels"]

setup(
    packages=packages,
    package_dir={"roundpipe.kernels": "kernels"},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
