"""Build of the native kernels: ``compress._C`` (C++ CPU) and, where a CUDA build of
torch and nvcc exist, ``compress._cuda``. Both register implementations of the
``torch.ops.compress`` ops; the Python package works without either (reference ops).

Set COMPRESS_BUILD_CUDA=0 to skip CUDA, =1 to require it. COMPRESS_SANITIZE=address builds
compress._C with AddressSanitizer (run Python with LD_PRELOAD=$(gcc -print-file-name=libasan.so)
and ASAN_OPTIONS=detect_leaks=0).
"""
import glob
import importlib.util
import os
import sys

from setuptools import setup


def _load_by_path(name, folder):
    """csrc/<folder>/<name>.py, loaded by path (the package itself is not importable here)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", folder, name + ".py")
    spec = importlib.util.spec_from_file_location("compress_build_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ext_modules = []
cmdclass = {}
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
except ImportError:  # metadata-only builds
    torch = None

if torch is not None:
    # one C++ runtime with torch where the compiler has only a static libstdc++ (csrc/cpu/cxx_runtime.py)
    libstdcxx_args = _load_by_path("cxx_runtime", "cpu").link_args_for(os.environ.get("CXX", "c++").split()[0])
    cpu_sources = sorted(glob.glob("csrc/cpu/*.cpp"))
    sanitize = os.environ.get("COMPRESS_SANITIZE", "")
    sanitize_flags = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"] if sanitize else []
    ext_modules.append(CppExtension(
        "compress._C",
        cpu_sources,
        include_dirs=[os.path.abspath("csrc")],
        # -ffp-contract=off: plain C++ arithmetic rounds where its source says, also inside
        # the FMA-enabled `#pragma GCC target` regions (explicit _mm256_fmadd_ps is
        # unaffected), so every ISA's scalar tails agree with each other, the reference's
        # rounding and the ISA emulation harness (tests/csrc/test_cpu_isa_emulation.py).
        extra_compile_args={"cxx": ["-O3", "-fopenmp", "-std=c++17", "-ffp-contract=off"] + sanitize_flags},
        extra_link_args=["-fopenmp"] + sanitize_flags + libstdcxx_args,
    ))
    want_cuda = os.environ.get("COMPRESS_BUILD_CUDA", "auto")
    has_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if want_cuda == "1" and not has_cuda:
        raise RuntimeError("COMPRESS_BUILD_CUDA=1 but torch has no CUDA build or nvcc is missing")
    build_cuda = want_cuda != "0" and has_cuda
    if build_cuda:
        # the kernels need sm_80+: older entries of TORCH_CUDA_ARCH_LIST are left out
        build_cuda, arch_list, note = _load_by_path("arch_list", "cuda").resolve_arch_list(
            os.environ.get("TORCH_CUDA_ARCH_LIST"), required=want_cuda == "1")
        if note:
            print(note, file=sys.stderr)
        if arch_list is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    if build_cuda:
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/bindings/*.cpp"))
        if cuda_sources:
            ext_modules.append(CUDAExtension(
                "compress._cuda",
                cuda_sources,
                include_dirs=[os.path.abspath("csrc")],
                # torch 2.13 headers need C++20 (bindings); the kernels build with either.
                # sm_80 SASS also runs on sm_86/89; PTX of sm_90 JITs on newer GPUs.
                # TORCH_CUDA_ARCH_LIST (e.g. "9.0"; entries before 8.0 left out above)
                # replaces these targets with torch's flags.
                extra_compile_args={
                    "cxx": ["-O3", "-std=c++20"],
                    "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr"] + ([] if os.environ.get(
                        "TORCH_CUDA_ARCH_LIST") else [
                             "-gencode=arch=compute_80,code=sm_80",
                             "-gencode=arch=compute_86,code=sm_86",
                             "-gencode=arch=compute_89,code=sm_89",
                             "-gencode=arch=compute_90,code=[sm_90,compute_90]"]),
                },
                extra_link_args=libstdcxx_args,
            ))
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
