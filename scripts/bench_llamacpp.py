"""Fetches llama.cpp's HF -> GGUF converter from the llama-cpp-python source
distribution (PyPI, with pip) into a local tools folder and prints the converter's
path, for ``compress bench model --llamacpp-converter PATH``. Nothing is copied into
this repository; the converter's own requirements (an old torch) are not installed.

    python scripts/bench_llamacpp.py --dest ~/.cache/compress/llamacpp-tools
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
