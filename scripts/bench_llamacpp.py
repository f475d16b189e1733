"""Fetches llama.cpp's HF -> GGUF converter from the llama-cpp-python source
distribution (PyPI, with pip) into a local tools folder and prints the converter's
path, for ``compress bench model --llamacpp-converter PATH``. Nothing is copied into
this repository; the converter's own requirements (an old torch) are not installed.

    python scripts/bench_llamacpp.py --dest ~/.cache/compress/llamacpp-tools

llama-cpp-python itself is the user's install (`pip install llama-cpp-python
sentencepiece torch==2.13.0`; it builds llama.cpp for this CPU). On CPUs with AMX, the
native build's AMX matmul crashed in the first evaluation of the benchmark model
(SIGSEGV in `ggml_backend_amx_mul_mat`, as in ggml-org/llama.cpp#20824; seen on the
Intel Xeon development machine, llama-cpp-python 0.3.36): build it without AMX there,
keeping AVX-512 and VNNI:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
      -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
      pip install --force-reinstall --no-deps llama-cpp-python==0.3.36
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

WANTED = ("convert_hf_to_gguf.py", "gguf-py/", "conversion/")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dest", default=str(Path.home() / ".cache/compress/llamacpp-tools"))
    p.add_argument("--version", help="llama-cpp-python version (default: the installed one)")
    args = p.parse_args()
    dest = Path(args.dest)
    conv = dest / "convert_hf_to_gguf.py"
    if conv.exists():
        print(conv)
        return
    version = args.version
    if version is None:
        from importlib.metadata import version as pkg_version
        version = pkg_version("llama-cpp-python")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                rel = m.name.split("/vendor/llama.cpp/", 1)
                if len(rel) == 2 and any(rel[1] == w or rel[1].startswith(w) for w in WANTED) and m.isfile():
                    out = dest / rel[1]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as src, open(out, "wb") as f:
                        shutil.copyfileobj(src, f)
    print(conv)


if __name__ == "__main__":
    main()
