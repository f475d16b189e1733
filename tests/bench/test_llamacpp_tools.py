"""`compress bench llamacpp`: the sdist's vendored llama.cpp is extracted, built once and
recorded in tools.json; a second call is instant; a missing tool is an error that says
what to run. cmake and pip are replaced by fakes here: no test builds or downloads."""
from __future__ import annotations

import io
import json
import tarfile

import pytest

from compress.bench import llamacpp
from compress.bench.cpu_info import cpu_line, parse_cpuinfo
from compress.bench.llamacpp import (BUILD_TARGETS, LlamaCppToolsError, build_tools, extract_vendored,
                                     fetch_sdist, load_tools)
from compress.errors import UserError

VERSION = "9.9.9"
BATCHED_BENCH_MAIN_END = """    LOG("\\n");
    llama_perf_context_print(ctx);


    llama_free(ctx);
    llama_model_free(model);

    llama_backend_free();

    return 0;
}
"""


def _fake_sdist(directory):
    """A llama-cpp-python-shaped sdist: vendor/llama.cpp with a CMakeLists, the converter,
    gguf-py, a .git pointer (left out) and a file outside vendor/ (left out)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"llama_cpp_python-{VERSION}.tar.gz"
    root = f"llama_cpp_python-{VERSION}"
    files = {f"{root}/vendor/llama.cpp/CMakeLists.txt": b"project(llama.cpp)\n",
             f"{root}/vendor/llama.cpp/convert_hf_to_gguf.py": b"print('convert')\n",
             f"{root}/vendor/llama.cpp/gguf-py/gguf/__init__.py": b"",
             f"{root}/vendor/llama.cpp/tools/batched-bench/batched-bench.cpp": BATCHED_BENCH_MAIN_END.encode(),
             f"{root}/vendor/llama.cpp/.git": b"gitdir: ../../.git/modules/vendor/llama.cpp\n",
             f"{root}/llama_cpp/__init__.py": b""}
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(".py") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A tools dir holding a fake sdist; cmake is a recorder whose --build writes the
    three executables. Returns (dir, list of the cmake command lines run)."""
    _fake_sdist(tmp_path)
    calls = []

    def run_logged(cmd, log_file, stage):
        calls.append(cmd)
        if "--build" in cmd:
            bin_dir = tmp_path / f"build-{VERSION}" / "bin"
            bin_dir.mkdir(parents=True, exist_ok=True)
            for t in BUILD_TARGETS:
                (bin_dir / t).write_text("#!/bin/sh\n")

    monkeypatch.setattr(llamacpp, "_run_logged", run_logged)
    monkeypatch.setattr(llamacpp, "find_cmake", lambda: "/usr/bin/cmake")
    return tmp_path, calls


def test_build_records_tools_and_second_call_is_instant(fake_build):
    d, calls = fake_build
    tools = build_tools(d, VERSION, log=lambda *_: None)
    assert [c[1] for c in calls] == ["-S", "--build"]
    configure = calls[0]
    assert "-DGGML_NATIVE=ON" in configure and "-DCMAKE_BUILD_TYPE=Release" in configure
    assert "-DGGML_CUDA=OFF" in configure and "-DLLAMA_BUILD_SERVER=ON" in configure
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in configure, "llama-server's web UI must not be downloaded"
    assert "llama-server" in BUILD_TARGETS
    assert calls[1][calls[1].index("--target") + 1:] == list(BUILD_TARGETS)
    assert calls[1][calls[1].index("-j") + 1] == "2"
    manifest = json.loads((d / "tools.json").read_text())
    assert set(manifest["tools"]) == set(BUILD_TARGETS) and manifest["version"] == VERSION
    assert manifest["converter"].endswith("llama.cpp-9.9.9/convert_hf_to_gguf.py")
    assert manifest["cpu"]["model"]

    again = build_tools(d, VERSION, log=lambda *_: None)
    assert len(calls) == 2, "a second call with the same version, cmake arguments and CPU builds nothing"
    assert again == tools == load_tools(d)


def test_other_cmake_arguments_rebuild(fake_build):
    d, calls = fake_build
    build_tools(d, VERSION, log=lambda *_: None)
    build_tools(d, VERSION, extra_cmake_args=["-DGGML_AMX_INT8=OFF"], log=lambda *_: None)
    assert len(calls) == 4 and "-DGGML_AMX_INT8=OFF" in calls[2]
    assert "-DGGML_AMX_INT8=OFF" in load_tools(d).cmake_args


def test_extract_takes_only_vendored_llamacpp_without_git(tmp_path):
    src = extract_vendored(_fake_sdist(tmp_path), tmp_path / "src")
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    assert names == ["CMakeLists.txt", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py",
                     "tools/batched-bench/batched-bench.cpp"]
    assert list(tmp_path.glob(".src.extract-*")) == [], "the temporary extraction folder is gone"


def test_batched_bench_drains_its_log_before_exit(fake_build):
    """llama-batched-bench's table goes through an asynchronous logger that can lose the
    last rows at exit: the build patches main to stop (drain) it, once."""
    d, calls = fake_build
    tools = build_tools(d, VERSION, log=lambda *_: None)
    main_cpp = d / f"llama.cpp-{VERSION}" / "tools/batched-bench/batched-bench.cpp"
    text = main_cpp.read_text()
    assert text.count("common_log_pause(common_log_main());") == 1
    assert text.index("llama_backend_free();") < text.index("common_log_pause") < text.index("return 0;")
    assert tools.patches == [p.why for p in llamacpp.PATCHES]
    assert llamacpp.apply_patches(main_cpp.parents[2]) == tools.patches and main_cpp.read_text() == text


def test_a_build_without_a_later_patch_is_rebuilt(fake_build):
    d, calls = fake_build
    build_tools(d, VERSION, log=lambda *_: None)
    manifest = json.loads((d / "tools.json").read_text())
    manifest["patches"] = []
    (d / "tools.json").write_text(json.dumps(manifest))
    build_tools(d, VERSION, log=lambda *_: None)
    assert len(calls) == 4


def test_a_patch_that_does_not_fit_is_left_out_with_a_note(tmp_path):
    (tmp_path / "tools/batched-bench").mkdir(parents=True)
    (tmp_path / "tools/batched-bench/batched-bench.cpp").write_text("int main() { return 1; }\n")
    notes = []
    assert llamacpp.apply_patches(tmp_path, log=notes.append) == []
    assert len(notes) == 1 and "not applied" in notes[0] and "batched-bench.cpp" in notes[0]


def test_no_manifest_says_to_run_the_build_command(tmp_path):
    with pytest.raises(UserError, match=r"no llama.cpp tools in .*run `compress bench llamacpp --dir .*` first"):
        load_tools(tmp_path)


def test_a_vanished_tool_is_named(fake_build):
    d, _ = fake_build
    tools = build_tools(d, VERSION, log=lambda *_: None)
    (d / f"build-{VERSION}" / "bin" / "llama-batched-bench").unlink()
    with pytest.raises(LlamaCppToolsError, match=r"names llama-batched-bench, which no longer exist.*"
                                                 r"run `compress bench llamacpp"):
        load_tools(d)
    assert tools.missing() == ["llama-batched-bench"]


def test_missing_cmake_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    monkeypatch.setattr(llamacpp.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(LlamaCppToolsError, match=r"cmake not found.*pip install cmake"):
        llamacpp.find_cmake()


def test_pip_failure_is_reported_without_leaving_a_file(monkeypatch, tmp_path):
    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for llama-cpp-python==9.9.9"

    monkeypatch.setattr(llamacpp.subprocess, "run", lambda cmd, **kw: Failed())
    with pytest.raises(LlamaCppToolsError, match=r"pip could not download llama-cpp-python==9\.9\.9.*No matching"):
        fetch_sdist(tmp_path, VERSION, log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_the_tools(fake_build, capsys):
    import argparse

    from compress.bench import add_bench_parser

    d, _ = fake_build
    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "llamacpp", "--dir", str(d), "--version", VERSION])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for t in BUILD_TARGETS:
        assert f"build-{VERSION}/bin/{t}" in out
    assert "convert_hf_to_gguf.py" in out and "tools.json" in out


def test_cli_names_the_converter_packages_that_are_missing(fake_build, capsys, monkeypatch):
    import argparse

    from compress.bench import add_bench_parser

    d, _ = fake_build
    real = llamacpp.importlib.util.find_spec
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda m: None if m == "sentencepiece" else real(m))
    p = argparse.ArgumentParser()
    add_bench_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "llamacpp", "--dir", str(d), "--version", VERSION])
    assert args.func(args) == 0
    assert "# note: llama.cpp's converter also needs: pip install sentencepiece" in capsys.readouterr().out


def test_cpuinfo_names_model_and_isa_flags():
    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\n"
            "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16\n"
            "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu\n")
    info = parse_cpuinfo(text)
    assert info == {"model": "AMD EPYC", "family_model": "25/17",
                    "flags": ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                              "avx512_bf16"]}
    info["logical_cpus"] = 2
    assert cpu_line(info) == ("CPU: AMD EPYC (family/model 25/17; avx2 fma f16c avx512f avx512bw avx512vl "
                              "avx512_vnni avx512_bf16), 2 logical CPUs")
    arm = parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU part\t: 0xd4f\n")
    assert arm == {"model": "", "family_model": "", "flags": ["asimd", "asimddp", "i8mm"]}
