// Python module entry for compress._C. Importing it runs the static
// TORCH_LIBRARY_IMPL registrations of every kernel file in csrc/cpu/, and exposes
// the run-time ISA query / override used by compress.ops (cpu_isa, set_cpu_isa), the
// W8A8 int16 GEMM's and AMX tiles' row thresholds (set_w8a8_int16_min_rows,
// w8a8_int16_min_rows, set_w8a8_amx_min_rows, w8a8_amx_min_rows, w8a8_amx_available), the
// W4A8 op's AMX tiles' (set_w4a16_amx_min_rows, w4a16_amx_min_rows, w4a16_amx_available) and panel
// GEMM's (set_w4a8_panel_min_rows, w4a8_panel_min_rows), the lanes op's tile pairs
// (set_w4a8_lanes_pair_min_rows, w4a8_lanes_pair_min_rows), its AMX-INT8 tiles
// (set_w4a8_lanes_amx_min_rows, w4a8_lanes_amx_min_rows) and their threads' take-over of
// each other's tiles (set_lanes_tile_stealing, set_lanes_test_hold_us, lanes_tiles_stolen), the
// float W4A16 op's at::mm threshold (set_w4a16_mm_min_rows, w4a16_mm_min_rows), paged
// attention's chunk and row kernel switches (set_paged_group_kernel, set_paged_row_kernel) and
// its split of items over the threads (set_paged_parts_split), the compute-peak probe and the DecodePlan class (decode_plan.cpp).
#include <Python.h>

#include "cpu/kernel_common.h"
#include "cpu/w4a16_common.h"
#include "cpu/w4a16_kernel.h"
#include "cpu/w4_lanes.h"
#include "cpu/w8a8_kernel.h"

static PyObject* py_cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(compress_cpu::isa_name(compress_cpu::active_isa()));
}

static PyObject* py_cpu_isa_detected(PyObject*, PyObject*) {
  return PyUnicode_FromString(compress_cpu::isa_name(compress_cpu::detected_isa()));
}

static PyObject* py_set_cpu_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  if (!compress_cpu::set_isa_override(name)) {
    PyErr_Format(PyExc_ValueError, "unknown CPU ISA %R; choose auto, avx512_vnni, avx2 or scalar", arg);
    return nullptr;
  }
  return PyUnicode_FromString(compress_cpu::isa_name(compress_cpu::active_isa()));
}

namespace compress_cpu {
bool set_paged_group_kernel(bool on);   // paged_attention.cpp
bool set_paged_row_kernel(bool on);     // paged_attention.cpp
bool set_paged_parts_split(bool on);    // paged_attention.cpp
bool set_w4a8_shared_unpack(bool on);   // w4a8_gemm.cpp
}

// The kernels' on / off switches: a setter that takes any truth value and returns the
// previous setting.
template <bool (*Setter)(bool)>
static PyObject* py_set_switch(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  return PyBool_FromLong(Setter(on != 0));
}

// The kernels' row thresholds: a setter that checks rows >= 1 and returns the previous
// value, and a getter, per knob.
static PyObject* set_min_rows(const char* name, PyObject* arg, int64_t (*setter)(int64_t)) {
  const long long rows = PyLong_AsLongLong(arg);
  if (rows == -1 && PyErr_Occurred()) return nullptr;
  if (rows < 1) {
    PyErr_Format(PyExc_ValueError, "%s: rows must be >= 1, got %lld", name, rows);
    return nullptr;
  }
  return PyLong_FromLongLong(setter(rows));
}

template <int64_t (*Getter)()>
static PyObject* py_get_rows(PyObject*, PyObject*) {
  return PyLong_FromLongLong(Getter());
}

static PyObject* py_set_w8a8_int16_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w8a8_int16_min_rows", arg, compress_cpu::w8::set_int16_min_rows);
}
static PyObject* py_set_w8a8_amx_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w8a8_amx_min_rows", arg, compress_cpu::w8::set_amx_min_rows);
}
static PyObject* py_set_w4a16_amx_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w4a16_amx_min_rows", arg, compress_cpu::w4::set_amx_min_rows);
}
static PyObject* py_set_w4a8_panel_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w4a8_panel_min_rows", arg, compress_cpu::w4::set_panel_min_rows);
}
static PyObject* py_set_w4a16_panel_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w4a16_panel_min_rows", arg, compress_cpu::w4::set_float_panel_min_rows);
}
static PyObject* py_set_w4a8_lanes_pair_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w4a8_lanes_pair_min_rows", arg, compress_cpu::lanes::set_pair_min_rows);
}
static PyObject* py_set_w4a8_lanes_amx_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w4a8_lanes_amx_min_rows", arg, compress_cpu::lanes::set_amx_min_rows);
}
static PyObject* py_set_w4a16_mm_min_rows(PyObject*, PyObject* arg) {
  return set_min_rows("set_w4a16_mm_min_rows", arg, compress_cpu::w4::set_float_mm_min_rows);
}

static PyObject* py_set_lanes_test_hold_us(PyObject*, PyObject* arg) {
  const long long us = PyLong_AsLongLong(arg);
  if (us == -1 && PyErr_Occurred()) return nullptr;
  if (us < 0 || us > 1000000) {
    PyErr_Format(PyExc_ValueError, "set_lanes_test_hold_us: microseconds must be in 0 .. 1000000, got %lld", us);
    return nullptr;
  }
  return PyLong_FromLongLong(compress_cpu::parts::g_test_hold_us.exchange(us));
}
static PyObject* py_lanes_tiles_stolen(PyObject*, PyObject*) {
  return PyLong_FromLongLong(compress_cpu::parts::g_items_stolen.load());
}

template <bool (*Available)()>
static PyObject* py_available(PyObject*, PyObject*) {
  return PyBool_FromLong(Available());
}

PyObject* py_compute_peak(PyObject*, PyObject* args);  // compute_peak.cpp
int register_decode_plan(PyObject* module);             // decode_plan.cpp

static PyMethodDef compress_c_methods[] = {
    {"cpu_isa", py_cpu_isa, METH_NOARGS, "ISA the CPU kernels use now (avx512_vnni, avx2 or scalar)."},
    {"cpu_isa_detected", py_cpu_isa_detected, METH_NOARGS, "Best ISA this CPU supports."},
    {"set_cpu_isa", py_set_cpu_isa, METH_O,
     "Caps the kernels' ISA (auto, avx512_vnni, avx2, scalar); returns the ISA now active."},
    {"set_w8a8_int16_min_rows", py_set_w8a8_int16_min_rows, METH_O,
     "Fewest rows for which W8A8 on AVX2 takes the int16 GEMM (the same bits as the byte tiles); "
     "returns the previous value."},
    {"w8a8_int16_min_rows", py_get_rows<compress_cpu::w8::int16_min_rows>, METH_NOARGS,
     "Fewest rows for which W8A8 on AVX2 takes the int16 GEMM (set_w8a8_int16_min_rows)."},
    {"set_w8a8_amx_min_rows", py_set_w8a8_amx_min_rows, METH_O,
     "Fewest rows for which W8A8 at the avx512_vnni level takes the AMX-INT8 tiles where the CPU has "
     "them (the same bits as the VNNI tiles); returns the previous value."},
    {"w8a8_amx_min_rows", py_get_rows<compress_cpu::w8::amx_min_rows>, METH_NOARGS,
     "Fewest rows for which W8A8 takes the AMX-INT8 tiles (set_w8a8_amx_min_rows)."},
    {"w8a8_amx_available", py_available<compress_cpu::amx_int8_available>, METH_NOARGS,
     "Whether this CPU and OS let the W8A8 ops use AMX-INT8 tiles."},
    {"set_w4a16_amx_min_rows", py_set_w4a16_amx_min_rows, METH_O,
     "Fewest rows for which the int8-activation int4 ops (w4a8_gemm*) at the avx512_vnni level take the "
     "AMX-BF16 tiles where the CPU has them (bf16 activations and dequantized weights, fp32 sums); returns "
     "the previous value."},
    {"w4a16_amx_min_rows", py_get_rows<compress_cpu::w4::amx_min_rows>, METH_NOARGS,
     "Fewest rows for which w4a8_gemm* takes the AMX-BF16 tiles (set_w4a16_amx_min_rows)."},
    {"set_w4a8_panel_min_rows", py_set_w4a8_panel_min_rows, METH_O,
     "Fewest rows for which w4a8_gemm* at the avx512_vnni level takes the panel GEMM (16 activation rows per "
     "vpdpbusd) instead of the four-row tiles (the same integer dots); returns the previous value."},
    {"w4a8_panel_min_rows", py_get_rows<compress_cpu::w4::panel_min_rows>, METH_NOARGS,
     "Fewest rows for which w4a8_gemm* takes the panel GEMM (set_w4a8_panel_min_rows)."},
    {"set_w4a8_lanes_pair_min_rows", py_set_w4a8_lanes_pair_min_rows, METH_O,
     "Fewest rows for which w4a8_gemm_lanes at the avx512_vnni level runs two weight tiles a call (each "
     "activation broadcast serves 32 weight rows; the same bits as one tile a call); returns the previous value."},
    {"w4a8_lanes_pair_min_rows", py_get_rows<compress_cpu::lanes::pair_min_rows>, METH_NOARGS,
     "Fewest rows for which w4a8_gemm_lanes runs two tiles a call (set_w4a8_lanes_pair_min_rows)."},
    {"set_w4a8_lanes_amx_min_rows", py_set_w4a8_lanes_amx_min_rows, METH_O,
     "Fewest rows for which w4a8_gemm_lanes at the avx512_vnni level takes the AMX-INT8 tiles where the CPU and "
     "OS allow AMX (never one row; the same bits as the AVX-512 tiles); returns the previous value."},
    {"w4a8_lanes_amx_min_rows", py_get_rows<compress_cpu::lanes::amx_min_rows>, METH_NOARGS,
     "Fewest rows for which w4a8_gemm_lanes takes the AMX-INT8 tiles (set_w4a8_lanes_amx_min_rows)."},
    {"set_lanes_tile_stealing", py_set_switch<compress_cpu::set_parts_stealing>, METH_O,
     "Whether the lanes ops' threads, done with their own run of weight tiles, take over the rest of another's "
     "(default true; which thread computes a tile moves no bit); returns the previous value."},
    {"set_lanes_test_hold_us", py_set_lanes_test_hold_us, METH_O,
     "For tests: the first intra-op thread of every lanes op waits this many microseconds before its first "
     "tiles, so the others take them over (0: none, the default); returns the previous value."},
    {"lanes_tiles_stolen", py_lanes_tiles_stolen, METH_NOARGS,
     "Weight tiles the lanes ops' threads have taken from another thread's run since the module loaded."},
    {"set_w4a16_panel_min_rows", py_set_w4a16_panel_min_rows, METH_O,
     "Fewest rows for which the float-activation int4 ops (w4a16_gemm*) take their AVX-512 panel GEMM "
     "(the same fp32 weights, each output summed in K order); returns the previous value."},
    {"w4a16_panel_min_rows", py_get_rows<compress_cpu::w4::float_panel_min_rows>, METH_NOARGS,
     "Fewest rows for which w4a16_gemm* takes the panel GEMM (set_w4a16_panel_min_rows)."},
    {"set_w4a16_mm_min_rows", py_set_w4a16_mm_min_rows, METH_O,
     "Fewest rows for which the float-activation int4 ops (w4a16_gemm*) dequantize weight blocks to fp32 "
     "and use at::mm instead of their register tiles (the same weights); returns the previous value."},
    {"w4a16_mm_min_rows", py_get_rows<compress_cpu::w4::float_mm_min_rows>, METH_NOARGS,
     "Fewest rows for which w4a16_gemm* uses at::mm (set_w4a16_mm_min_rows)."},
    {"w4a16_amx_available", py_available<compress_cpu::amx_bf16_available>, METH_NOARGS,
     "Whether this CPU and OS let the W4A16 ops use AMX-BF16 tiles."},
    {"set_paged_group_kernel", py_set_switch<compress_cpu::set_paged_group_kernel>, METH_O,
     "Whether paged attention runs rows that share their keys (a prompt chunk as one-token rows) through "
     "its AVX-512 chunk kernel where the CPU has it (default True; the per-row loops' bits); returns the "
     "previous setting."},
    {"set_paged_row_kernel", py_set_switch<compress_cpu::set_paged_row_kernel>, METH_O,
     "Whether paged attention runs a row that attends alone (a decode row) through its AVX-512 row kernel "
     "where the CPU has it (default True; the per-row loops' bits); returns the previous setting."},
    {"set_paged_parts_split", py_set_switch<compress_cpu::set_paged_parts_split>, METH_O,
     "Whether paged attention gives each thread one contiguous run of its (rows, kv head) items with take-over "
     "(default True) or hands them out one at a time (the same bits); returns the previous setting."},
    {"set_w4a8_shared_unpack", py_set_switch<compress_cpu::set_w4a8_shared_unpack>, METH_O,
     "Whether the int8-activation int4 GEMM's few-row tiles (below the panel GEMM's rows, AVX-512 VNNI) unpack "
     "each weight chunk once for up to eight activation rows (default True) instead of once per row; returns "
     "the previous setting."},
    {"compute_peak", py_compute_peak, METH_VARARGS,
     "compute_peak(recipe, iters): runs a register-only GEMM-step loop (fp32_fma, int8_avx2, int16_avx2, "
     "int8_vnni) "
     "iters times on every intra-op thread; returns the multiply-accumulates done."},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef compress_c_module = {PyModuleDef_HEAD_INIT, "_C", "compress CPU kernels", -1,
                                               compress_c_methods};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&compress_c_module);
  if (module != nullptr && register_decode_plan(module) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
