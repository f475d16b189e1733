"""``compress bench llamacpp [--dir DIR]``: llama.cpp's own benchmark tools and server, built
for this CPU, as the baseline of ``compress bench model`` and a peer of ``compress bench serve``.

The llama-cpp-python source distribution (PyPI, fetched with pip) vendors llama.cpp; this
extracts that tree, builds ``llama-bench``, ``llama-batched-bench``, ``llama-quantize`` and
``llama-server`` (without its web UI: no npm, no download of prebuilt assets)
with cmake (Release, ``-DGGML_NATIVE=ON``, CPU only, static, nothing else; one fix of
llama-batched-bench's output, see ``PATCHES``), and records their paths with the HF ->
GGUF converter (``convert_hf_to_gguf.py`` and its ``gguf-py``; it needs ``sentencepiece``)
in ``tools.json`` in the cache directory (default ``~/.cache/compress/llamacpp``). A
second call finds the manifest and returns at once; a different version, different cmake
arguments or a different CPU (a native build may not run on another) rebuild. Nothing
of it enters this repository. On 2 busy cores the build took 16 minutes.

On CPUs with AMX, llama.cpp 0.3.36's AMX matmul crashed on the benchmark model (SIGSEGV in
``ggml_backend_amx_mul_mat``, as in ggml-org/llama.cpp#20824); build without it there,
keeping AVX-512 and VNNI: ``--cmake-arg=-DGGML_NATIVE=OFF --cmake-arg=-DGGML_AVX512=ON ...``
(every ISA option spelled out, ``GGML_AMX_*=OFF``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from compress.bench.cpu_info import describe_cpu
from compress.errors import UserError
from compress.io.files import atomic_write_text, make_temp_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist whose vendored llama.cpp is built
BUILD_TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")
MANIFEST = "tools.json"
CONVERTER_MODULES = ("sentencepiece", "numpy", "torch", "transformers")  # what convert_hf_to_gguf.py imports
CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
              "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_RPC=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # llama-server with an empty web UI
              "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF")
VENDORED = "/vendor/llama.cpp/"  # where the sdist keeps llama.cpp


@dataclass(frozen=True)
class SourcePatch:
    """One edit of the extracted sources: ``old`` -> ``new`` in ``path``, and why."""
    path: str
    old: str
    new: str
    why: str


# llama-batched-bench prints its table through common's asynchronous logger, whose
# singleton is never destroyed (ggml-org/llama.cpp#22142): the process can exit before the
# worker thread has written the last rows, and 1 to 2 of 2 rows came out. Stop the worker
# (it drains its queue first) before main returns; nothing that is timed changes.
PATCHES = (SourcePatch("tools/batched-bench/batched-bench.cpp",
                       "    llama_backend_free();\n\n    return 0;\n}",
                       "    llama_backend_free();\n\n    common_log_pause(common_log_main());\n\n    return 0;\n}",
                       "llama-batched-bench: drain the log queue before exit (its results table could be lost)"),)


class LlamaCppToolsError(UserError):
    """llama.cpp's tools are missing or could not be built."""


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "compress" / "llamacpp"


@dataclass
class LlamaCppTools:
    """What ``tools.json`` records: the built tools and the converter, by absolute path."""
    version: str
    source_dir: str
    cmake_args: list[str]
    cpu: dict
    tools: dict[str, str] = field(default_factory=dict)  # target name -> executable
    patches: list[str] = field(default_factory=list)     # why each edit of the sources was made
    converter: str = ""   # convert_hf_to_gguf.py
    gguf_py: str = ""     # the gguf package the converter imports

    def tool(self, name: str) -> str:
        return self.tools[name]

    def missing(self) -> list[str]:
        """Recorded paths that no longer exist (names of the tools, or the converter)."""
        out = [name for name in BUILD_TARGETS if not Path(self.tools.get(name, "")).is_file()]
        if not Path(self.converter).is_file():
            out.append("convert_hf_to_gguf.py")
        return out


def load_tools(directory: str | Path | None = None) -> LlamaCppTools:
    """The tools recorded in ``directory``/tools.json; an error that says to run
    ``compress bench llamacpp`` when there are none or one has gone."""
    directory = Path(directory) if directory else default_dir()
    manifest = directory / MANIFEST
    hint = "run `compress bench llamacpp" + (f" --dir {directory}" if directory != default_dir() else "") + "` first"
    if not manifest.is_file():
        raise LlamaCppToolsError(f"no llama.cpp tools in {directory} (no {MANIFEST}): {hint}")
    try:
        tools = LlamaCppTools(**json.loads(manifest.read_text()))
    except (ValueError, TypeError) as e:
        raise LlamaCppToolsError(f"{manifest} is not a llama.cpp tools manifest ({e}): {hint}") from None
    missing = tools.missing()
    if missing:
        raise LlamaCppToolsError(f"{manifest} names {', '.join(missing)}, which no longer exist: {hint}")
    return tools


def _up_to_date(directory: Path, version: str, cmake_args: list[str], cpu: dict) -> LlamaCppTools | None:
    try:
        tools = load_tools(directory)
    except LlamaCppToolsError:
        return None
    same = tools.version == version and tools.cmake_args == cmake_args and tools.cpu.get("flags") == cpu["flags"]
    # patches added since the build: applied now (a no-op when in place), then rebuilt
    return tools if same and tools.patches == apply_patches(Path(tools.source_dir), log=lambda *_: None) else None


def find_cmake() -> str:
    """cmake on PATH or beside this interpreter (``pip install cmake`` puts it there)."""
    for cand in (shutil.which("cmake"), str(Path(sys.executable).parent / "cmake")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise LlamaCppToolsError("cmake not found (building llama.cpp needs it): `pip install cmake` "
                             "or `apt-get install cmake`")


def fetch_sdist(directory: Path, version: str, log=print) -> Path:
    """The llama-cpp-python sdist in ``directory``, downloaded with pip when absent."""
    name = f"llama_cpp_python-{version}.tar.gz"
    sdist = directory / name
    if sdist.is_file():
        return sdist
    directory.mkdir(parents=True, exist_ok=True)
    log(f"# downloading llama-cpp-python=={version} (source distribution) with pip")
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / name
        if res.returncode != 0 or not got.is_file():
            raise LlamaCppToolsError(f"pip could not download llama-cpp-python=={version}'s source distribution "
                                     f"(exit {res.returncode}): {(res.stderr or res.stdout).strip()[-800:]}")
        os.replace(got, sdist)
    return sdist


def extract_vendored(sdist: Path, dest: Path) -> Path:
    """The sdist's ``vendor/llama.cpp`` tree (regular files and folders only, no ``.git``)
    written to ``dest``, which appears whole or not at all."""
    if dest.is_dir():
        return dest
    tmp = make_temp_dir(dest, "extract")
    try:
        with tarfile.open(sdist) as tar:
            for m in tar:
                parts = m.name.split(VENDORED, 1)
                if len(parts) != 2 or not m.isfile():
                    continue
                rel = Path(parts[1])
                if rel.is_absolute() or ".." in rel.parts or ".git" in rel.parts:
                    continue
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(out, "wb") as f:
                    shutil.copyfileobj(src, f)
                os.chmod(out, 0o755 if m.mode & 0o100 else 0o644)
        if not (tmp / "CMakeLists.txt").is_file():
            raise LlamaCppToolsError(f"{sdist} holds no vendored llama.cpp (no {VENDORED}CMakeLists.txt)")
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def apply_patches(source: Path, patches=PATCHES, log=print) -> list[str]:
    """Apply each patch whose ``old`` text is in its file (already applied: skipped); one
    that fits neither way (another llama.cpp version) is left out with a note. Returns
    the ``why`` of the patches in effect."""
    done = []
    for patch in patches:
        f = source / patch.path
        text = f.read_text() if f.is_file() else ""
        if patch.new in text:
            done.append(patch.why)
        elif text.count(patch.old) == 1:
            f.write_text(text.replace(patch.old, patch.new))
            done.append(patch.why)
        else:
            log(f"# note: not applied to {f} (its text differs from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s): "
                f"{patch.why}")
    return done


def _run_logged(cmd: list[str], log_file: Path, stage: str) -> None:
    with open(log_file, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-25:])
        raise LlamaCppToolsError(f"llama.cpp {stage} failed (exit {res.returncode}; full log: {log_file}):\n{tail}")


def build_tools(directory: str | Path | None = None, version: str = LLAMA_CPP_PYTHON_VERSION,
                extra_cmake_args: list[str] | None = None, jobs: int = 2, log=print) -> LlamaCppTools:
    """Fetch, extract and build llama.cpp's tools into ``directory`` unless ``tools.json``
    there already records this version, these cmake arguments and this CPU."""
    directory = Path(directory) if directory else default_dir()
    cmake_args = list(CMAKE_ARGS) + list(extra_cmake_args or [])
    cpu = describe_cpu()
    done = _up_to_date(directory, version, cmake_args, cpu)
    if done is not None:
        return done
    cmake = find_cmake()
    source = extract_vendored(fetch_sdist(directory, version, log), directory / f"llama.cpp-{version}")
    patches = apply_patches(source, log=log)
    build = directory / f"build-{version}"
    log_file = directory / "build.log"
    log(f"# building {', '.join(BUILD_TARGETS)} in {build} (log: {log_file}); minutes on a small machine")
    _run_logged([cmake, "-S", str(source), "-B", str(build), *cmake_args], log_file, "configure (cmake)")
    _run_logged([cmake, "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *BUILD_TARGETS],
                log_file, "build (cmake --build)")
    tools = LlamaCppTools(version=version, source_dir=str(source), cmake_args=cmake_args, cpu=cpu,
                          tools={t: str(build / "bin" / t) for t in BUILD_TARGETS},
                          converter=str(source / "convert_hf_to_gguf.py"), gguf_py=str(source / "gguf-py"),
                          patches=patches)
    missing = tools.missing()
    if missing:
        raise LlamaCppToolsError(f"the llama.cpp build in {build} did not produce {', '.join(missing)} "
                                 f"(log: {log_file})")
    atomic_write_text(directory / MANIFEST, json.dumps(asdict(tools), indent=1))
    return tools


def main(args) -> int:
    tools = build_tools(args.dir, args.version, args.cmake_arg, args.jobs)
    for name, path in tools.tools.items():
        print(f"{name:<22} {path}")
    print(f"{'convert_hf_to_gguf.py':<22} {tools.converter}")
    print(f"# recorded in {Path(args.dir or default_dir()) / MANIFEST} (llama.cpp from llama-cpp-python "
          f"{tools.version}, {tools.cpu['model']})")
    missing = [m for m in CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(f"# note: llama.cpp's converter also needs: pip install {' '.join(missing)}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--dir", help=f"cache directory for the sources, the build and {MANIFEST} "
                                 f"(default: {default_dir()})")
    p.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION,
                   help="llama-cpp-python version whose vendored llama.cpp is built")
    p.add_argument("--cmake-arg", action="append", default=[],
                   help="extra cmake argument (repeatable), e.g. --cmake-arg=-DGGML_AMX_INT8=OFF")
    p.add_argument("--jobs", type=int, default=2, help="parallel build jobs")
