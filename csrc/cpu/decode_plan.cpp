// compress._C.DecodePlan: a whole decode step (every decoder layer) in one call from
// Python. The runtime builds it once after loading (one add_layer per layer, holding the
// tensors compress::decode_layer takes) and per step passes only what changes: the hidden
// state, rope rows, the KV cache, the cache slot and the masks.
//
// Why: calling the decode_layer op from Python converts its ~30 arguments (a list of ~10
// weight tensors, four scheme strings, four optional biases, ...) every call. Measured on
// the 345M int4 model (2 threads, temporary timers): 24 calls took 9.7 ms a step from
// Python against 8.3 ms inside the op, ~58 us a call of argument handling, 12% of a step.
// step() runs the same C++ function per layer (decode_layer_run), so its outputs are the
// op's outputs bit for bit, with the GIL released.
#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

#include "cpu/ops.h"

namespace compress_cpu {
namespace {

class DecodePlan {
 public:
  DecodePlan(int64_t n_heads, int64_t n_kv_heads) : n_heads_(n_heads), n_kv_heads_(n_kv_heads) {
    TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, "DecodePlan: n_heads ", n_heads,
                " must be a positive multiple of n_kv_heads ", n_kv_heads);
  }

  // One decoder layer, with compress::decode_layer's arguments; `mask_slot` picks the
  // entry of step()'s `masks` this layer attends with (layers share masks by window).
  void add_layer(at::Tensor attn_norm_weight, at::Tensor mlp_norm_weight, double eps, std::vector<std::string> schemes,
                 std::vector<int64_t> group_sizes, std::vector<at::Tensor> weights,
                 std::vector<c10::optional<at::Tensor>> biases, int64_t mask_slot) {
    TORCH_CHECK(mask_slot >= 0, "DecodePlan.add_layer: mask_slot must be >= 0, got ", mask_slot);
    auto layer = std::make_unique<Layer>();
    layer->attn_norm_weight = std::move(attn_norm_weight);
    layer->mlp_norm_weight = std::move(mlp_norm_weight);
    layer->eps = eps;
    layer->weights = std::move(weights);  // the linears point into this vector: never resized again
    layer->linears = decode_linears(schemes, group_sizes, layer->weights, biases);
    layer->mask_slot = mask_slot;
    layers_.push_back(std::move(layer));
  }

  // x [B, hidden] through every layer at cache slot `pos`. k_cache / v_cache hold every
  // layer's cache: [layers, rows, n_kv_heads, slots, head_dim] (the runtime's KVCache.k /
  // .v), written in place at `pos`; masks[slot] is a [B|1, pos+1] key mask or None.
  at::Tensor step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, int64_t pos, const std::vector<c10::optional<at::Tensor>>& masks) const {
    const int64_t n = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(n > 0, "DecodePlan.step: the plan has no layers");
    TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.size(0) == n && v_cache.size(0) == n,
                "DecodePlan.step: caches must be [", n, " layers, rows, n_kv_heads, slots, head_dim], got k ",
                k_cache.sizes(), " v ", v_cache.sizes());
    at::Tensor h = x;
    for (int64_t i = 0; i < n; ++i) {
      const Layer& l = *layers_[i];
      TORCH_CHECK(l.mask_slot < static_cast<int64_t>(masks.size()), "DecodePlan.step: layer ", i, " uses mask ",
                  l.mask_slot, " but ", masks.size(), " masks were given");
      h = decode_layer_run(h, l.attn_norm_weight, l.mlp_norm_weight, l.eps, l.linears, cos, sin, k_cache.select(0, i),
                           v_cache.select(0, i), pos, masks[l.mask_slot], n_heads_, n_kv_heads_);
    }
    return h;
  }

  int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    at::Tensor attn_norm_weight, mlp_norm_weight;
    double eps = 0;
    std::vector<at::Tensor> weights;
    std::vector<DecodeLinear> linears;
    int64_t mask_slot = 0;
  };
  int64_t n_heads_, n_kv_heads_;
  std::vector<std::unique_ptr<Layer>> layers_;
};

}  // namespace
}  // namespace compress_cpu

// Adds DecodePlan to the compress._C module (called from PyInit__C).
int register_decode_plan(PyObject* module) {
  namespace py = pybind11;
  using compress_cpu::DecodePlan;
  try {
    py::module_ m = py::reinterpret_borrow<py::module_>(module);
    py::class_<DecodePlan>(m, "DecodePlan",
                           "A whole decode step (every decoder layer, compress::decode_layer each) in one call.")
        .def(py::init<int64_t, int64_t>(), py::arg("n_heads"), py::arg("n_kv_heads"))
        .def("add_layer", &DecodePlan::add_layer, py::arg("attn_norm_weight"), py::arg("mlp_norm_weight"),
             py::arg("eps"), py::arg("schemes"), py::arg("group_sizes"), py::arg("weights"), py::arg("biases"),
             py::arg("mask_slot"))
        .def("step", &DecodePlan::step, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
             py::arg("v_cache"), py::arg("pos"), py::arg("masks"),
             py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("n_layers", &DecodePlan::n_layers);
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;
  }
  return 0;
}
