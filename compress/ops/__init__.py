"""The ops layer: op schemas, references, and the native kernels when built.

``import compress.ops`` defines the ``torch.ops.compress.*`` ops (reference
implementation on every device) and then loads the native extensions that exist:
``compress._C`` (C++ CPU kernels) and ``compress._cuda`` (CUDA kernels), which
register faster implementations of the same ops on their dispatch keys.
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

from compress.ops import library, reference  # noqa: F401  (defines the ops)

BACKENDS = ("native", "reference")
_NATIVE_MODULES = ("compress._C", "compress._cuda")
_loaded: dict[str, bool] = {}


class CudaKernelsLoadError(RuntimeError):
    """compress._cuda exists but does not load on a machine with a GPU."""


def _load_native(import_module=importlib.import_module) -> None:
    for mod in _NATIVE_MODULES:
        try:
            import_module(mod)
            _loaded[mod] = True
        except ImportError as exc:
            _loaded[mod] = False
            if mod == "compress._C" and "No module named" not in str(exc):
                warnings.warn(f"compress: native CPU kernels failed to load ({exc}); "
                              "falling back to the PyTorch reference ops")
            # Not built: the reference ops run (and the GPU tests say why they skip). Built
            # but broken where a GPU is: every CUDA op would quietly run the reference, so stop.
            never_built = isinstance(exc, ModuleNotFoundError) and exc.name == mod
            if mod == "compress._cuda" and not never_built and torch.cuda.is_available():
                raise CudaKernelsLoadError(
                    f"compress._cuda (the CUDA kernels) is built but does not load: {exc}. Rebuild it against "
                    "this torch (COMPRESS_BUILD_CUDA=1 python setup.py build_ext --inplace), or delete "
                    "compress/_cuda*.so to run the PyTorch reference ops on the GPU") from exc


_load_native()


def native_available(device: str = "cpu") -> bool:
    """True when a compiled kernel library for ``device`` ('cpu' or 'cuda') is loaded."""
    return _loaded.get("compress._C" if device == "cpu" else "compress._cuda", False)


def get_op(name: str, backend: str = "native"):
    """The callable for op ``name``: the dispatcher op ('native': compiled kernel where
    one is registered for the tensors' device, reference otherwise) or the pure
    reference function ('reference')."""
    if name not in library.SCHEMAS:
        raise KeyError(f"unknown op {name!r}; ops: {sorted(library.SCHEMAS)}")
    if backend == "native":
        return getattr(torch.ops.compress, name)
    if backend == "reference":
        return library.REFERENCES[name]
    raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")


def set_cuda_paged_attention_kernel(name: str) -> str:
    """The CUDA paged decode attention kernel: 'split' (a block per row, kv head and 256
    positions, the default) or 'heads' (a block per row and query head, the baseline that
    csrc/cuda/lab/paged_attention_kv.py times it against); returns the previous one. The
    environment variable COMPRESS_CUDA_PAGED_KERNEL sets it at import."""
    if not native_available("cuda"):
        raise RuntimeError("compress._cuda (the CUDA kernels) is not built")
    return importlib.import_module("compress._cuda").set_paged_attention_kernel(str(name))


if native_available("cuda") and os.environ.get("COMPRESS_CUDA_PAGED_KERNEL"):
    # the lab's switch for a whole run (compress bench model under each kernel)
    try:
        set_cuda_paged_attention_kernel(os.environ["COMPRESS_CUDA_PAGED_KERNEL"])
    except ValueError as exc:
        raise ValueError(f"COMPRESS_CUDA_PAGED_KERNEL={os.environ['COMPRESS_CUDA_PAGED_KERNEL']!r}: {exc}") from None


# ---- CPU kernel ISA: query and override (tests force AVX2 / scalar with these) ----
_ISA_ORDER = ("avx512_vnni", "avx2", "scalar")


def _cpu_module():
    if not native_available("cpu"):
        raise RuntimeError("compress._C (native CPU kernels) is not built")
    return importlib.import_module("compress._C")


def cpu_isa() -> str:
    """The instruction set the CPU kernels use now: 'avx512_vnni', 'avx2' or 'scalar'."""
    return _cpu_module().cpu_isa()


def cpu_isas_available() -> list[str]:
    """Every kernel path this CPU can run, best first (the scalar path is always there)."""
    best = _cpu_module().cpu_isa_detected()
    return list(_ISA_ORDER[_ISA_ORDER.index(best):])


def set_cpu_isa(name: str) -> str:
    """Caps the CPU kernels' ISA ('auto', 'avx512_vnni', 'avx2', 'scalar'; a cap above
    what the CPU supports falls back to the best supported); returns the ISA now active.
    The environment variable COMPRESS_CPU_ISA sets the same cap at import."""
    return _cpu_module().set_cpu_isa(name)


def set_w8a8_int16_min_rows(rows: int) -> int:
    """Fewest rows (M) for which the W8A8 ops on AVX2 without VNNI take the int16 GEMM
    instead of the byte tiles (default 16; csrc/cpu/w8a8_i16_avx2.inc); returns the
    previous value. Both give the same bits: a tuning knob, and what
    csrc/cpu/lab/ab_many_rows.py uses to time one against the other."""
    return _cpu_module().set_w8a8_int16_min_rows(int(rows))


def w8a8_int16_min_rows() -> int:
    """The current row threshold of the W8A8 int16 GEMM (see set_w8a8_int16_min_rows)."""
    return _cpu_module().w8a8_int16_min_rows()


def set_w8a8_amx_min_rows(rows: int) -> int:
    """Fewest rows (M) for which the W8A8 ops at the avx512_vnni level take the AMX-INT8
    tiles instead of the VNNI tiles, where the CPU and OS allow AMX (default 16, never one row;
    csrc/cpu/w8a8_amx.inc); returns the previous value. Both give the same bits: a
    tuning knob, and what csrc/cpu/lab/ab_many_rows.py --path amx uses to time one against the other."""
    return _cpu_module().set_w8a8_amx_min_rows(int(rows))


def w8a8_amx_min_rows() -> int:
    """The current row threshold of the W8A8 AMX tiles (see set_w8a8_amx_min_rows)."""
    return _cpu_module().w8a8_amx_min_rows()


def w8a8_amx_available() -> bool:
    """Whether this CPU has AMX-INT8 and the OS lets this process use the tiles."""
    return bool(_cpu_module().w8a8_amx_available())


def set_w4a16_amx_min_rows(rows: int) -> int:
    """Fewest rows (M) for which the int8-activation int4 ops (``w4a8_gemm*``) at the
    avx512_vnni level take the AMX-BF16 tiles (bf16 activations, weights dequantized to
    bf16 per call, fp32 sums) instead of the int8 tiles, where the CPU and OS allow AMX
    (default 16, never one row; csrc/cpu/w4a16_amx.inc); returns the previous value. Not
    the same bits as the int8 tiles: both are held to the reference by SQNR. The float
    ops (``w4a16_gemm*``) never take them."""
    return _cpu_module().set_w4a16_amx_min_rows(int(rows))


def w4a16_amx_min_rows() -> int:
    """The current row threshold of the W4A8 AMX tiles (see set_w4a16_amx_min_rows)."""
    return _cpu_module().w4a16_amx_min_rows()


def set_w4a8_panel_min_rows(rows: int) -> int:
    """Fewest rows (M) for which the int8-activation int4 ops (``w4a8_gemm*``) at the
    avx512_vnni level take the panel GEMM (csrc/cpu/w4a8_panel.inc: 16 activation rows
    per vpdpbusd, weight panels unpacked per call) instead of the four-row tiles (default
    12; AMX, where allowed, still takes its rows first); returns the previous value. The
    same integer dots; only the order of the fp32 sums differs."""
    return _cpu_module().set_w4a8_panel_min_rows(int(rows))


def set_w4a8_shared_unpack(on: bool) -> bool:
    """Whether the int8-activation int4 ops' few-row tiles (below the panel GEMM's rows,
    avx512_vnni level) unpack each weight chunk once for up to eight activation rows
    (default True) or once per row, the form they replaced; returns the previous setting.
    Both give the same bytes (a lab switch for in-process timings)."""
    return bool(_cpu_module().set_w4a8_shared_unpack(bool(on)))


def w4a8_panel_min_rows() -> int:
    """The current row threshold of the W4A8 panel GEMM (see set_w4a8_panel_min_rows)."""
    return _cpu_module().w4a8_panel_min_rows()


def set_w4a8_lanes_amx_min_rows(rows: int) -> int:
    """Fewest rows (M) for which the int8-activation int4 op on the lanes layout
    (``w4a8_gemm_lanes``, what the runtime prepares) at the avx512_vnni level takes the
    AMX-INT8 tiles (csrc/cpu/w4a8_lanes_amx.inc) instead of the AVX-512 lanes tiles, where
    the CPU and OS allow AMX (default 64, never one row); returns the previous value. Both
    give the same bits: a tuning knob, and what csrc/cpu/lab/ab_many_rows.py --path
    w4-lanes-amx uses to time one against the other."""
    return _cpu_module().set_w4a8_lanes_amx_min_rows(int(rows))


def w4a8_lanes_amx_min_rows() -> int:
    """The current row threshold of the lanes op's AMX tiles (see set_w4a8_lanes_amx_min_rows)."""
    return _cpu_module().w4a8_lanes_amx_min_rows()


def set_w4a16_panel_min_rows(rows: int) -> int:
    """Fewest rows (M) for which the float-activation int4 ops (``w4a16_gemm*``) at the
    avx512_vnni level take their panel GEMM (csrc/cpu/w4a16_panel.inc: 16 activation rows
    per FMA, the reference's fp32 weights, each output summed in K order) instead of the
    register tiles or at::mm (default 32; at 16-24 rows the register tiles were 0.76-1.16x
    as fast); returns the previous value."""
    return _cpu_module().set_w4a16_panel_min_rows(int(rows))


def w4a16_panel_min_rows() -> int:
    """The current row threshold of the float int4 ops' panel GEMM (see set_w4a16_panel_min_rows)."""
    return _cpu_module().w4a16_panel_min_rows()


def set_w4a16_mm_min_rows(rows: int) -> int:
    """Fewest rows (M) for which the float-activation int4 ops (``w4a16_gemm*``) dequantize
    blocks of weight rows to fp32 and multiply them with ``at::mm`` instead of running their
    register tiles (default 32); returns the previous value. Both use the reference's
    weights, (u - zero) * scale in fp32; only the order of the sums differs."""
    return _cpu_module().set_w4a16_mm_min_rows(int(rows))


def w4a16_mm_min_rows() -> int:
    """The current row threshold of the float int4 ops' at::mm path (see set_w4a16_mm_min_rows)."""
    return _cpu_module().w4a16_mm_min_rows()


def w4a16_amx_available() -> bool:
    """Whether this CPU has AMX-BF16 (and AVX512-BF16) and the OS lets this process use the tiles."""
    return bool(_cpu_module().w4a16_amx_available())


class force_cpu_isa:
    """Context manager: ``with force_cpu_isa("scalar"): ...``; restores 'auto' after."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        return set_cpu_isa(self.name)

    def __exit__(self, *exc):
        set_cpu_isa("auto")
        return False
