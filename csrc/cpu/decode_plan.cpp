// compress._C.DecodePlan: a whole decode step in one call from Python. The runtime builds
// it once after loading (one add_layer per layer, holding the tensors
// compress::decode_layer takes; set_head for the embedding, rope tables, final norm and
// lm_head) and per step passes only what changes: decode() takes the token ids, their
// positions, the KV cache, the cache slot and the masks and returns the logits
// (decode_tokens() the same from Python ints, with the greedy tokens); step() runs the
// layers alone on a hidden state.
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

  // What surrounds the layers, so decode() is a whole step: the embedding table [vocab,
  // hidden], the rope tables [positions, head_dim], the final norm and the lm_head
  // linear (one of decode_layer's schemes: its tensors in `weights`).
  void set_head(at::Tensor embed, at::Tensor rope_cos, at::Tensor rope_sin, at::Tensor norm_weight, double eps,
                std::string scheme, int64_t group_size, std::vector<at::Tensor> weights,
                c10::optional<at::Tensor> bias) {
    TORCH_CHECK(embed.dim() == 2, "DecodePlan.set_head: embed must be [vocab, hidden], got ", embed.sizes());
    TORCH_CHECK(rope_cos.dim() == 2 && rope_sin.sizes() == rope_cos.sizes(),
                "DecodePlan.set_head: rope_cos and rope_sin must both be [positions, head_dim], got ", rope_cos.sizes(),
                " and ", rope_sin.sizes());
    TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == embed.size(1), "DecodePlan.set_head: norm_weight must be [",
                embed.size(1), "], got ", norm_weight.sizes());
    const int64_t n = decode_linear_tensors(scheme);
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == n, "DecodePlan.set_head: lm_head scheme '", scheme, "' takes ", n,
                " tensors, got ", weights.size());
    auto head = std::make_unique<Head>();
    head->embed = embed.contiguous();
    head->rope_cos = rope_cos.contiguous();
    head->rope_sin = rope_sin.contiguous();
    head->norm_weight = std::move(norm_weight);
    head->eps = eps;
    head->weights = std::move(weights);  // lm_head points into this vector: never resized again
    head->lm_head = DecodeLinear{scheme, group_size, head->weights.data(), std::move(bias)};
    check_decode_linear(head->lm_head, "DecodePlan.set_head");
    head_ = std::move(head);
  }

  // A whole decode step: token `ids` [B] (int64) at rope `positions` [B] (int64), written
  // at cache slot `pos`, through the embedding, every layer (as step()), the final norm
  // and the lm_head: fp32 logits [B, vocab].
  at::Tensor decode(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, int64_t pos, const std::vector<c10::optional<at::Tensor>>& masks) const {
    TORCH_CHECK(head_ != nullptr, "DecodePlan.decode: no head (call set_head first)");
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && positions.sizes() == ids.sizes() &&
                    positions.scalar_type() == at::kLong,
                "DecodePlan.decode: ids and positions must be int64 [B], got ", ids.sizes(), " ", ids.scalar_type(),
                " and ", positions.sizes(), " ", positions.scalar_type());
    const at::Tensor idc = ids.contiguous(), posc = positions.contiguous();
    const int64_t vocab = head_->embed.size(0), n_pos = head_->rope_cos.size(0);
    const int64_t *id = idc.data_ptr<int64_t>(), *ps = posc.data_ptr<int64_t>();
    for (int64_t b = 0; b < idc.numel(); ++b) {
      const int64_t t = id[b], p = ps[b];
      TORCH_CHECK(t >= 0 && t < vocab, "DecodePlan.decode: token id ", t, " (row ", b, ") outside the vocabulary of ", vocab);
      TORCH_CHECK(p >= 0 && p < n_pos, "DecodePlan.decode: position ", p, " (row ", b, ") outside the rope table's ", n_pos);
    }
    const at::Tensor x = at::index_select(head_->embed, 0, idc);
    const at::Tensor cos = at::index_select(head_->rope_cos, 0, posc).to(x.scalar_type());
    const at::Tensor sin = at::index_select(head_->rope_sin, 0, posc).to(x.scalar_type());
    const at::Tensor h = rms_norm(step(x, cos, sin, k_cache, v_cache, pos, masks), head_->norm_weight, head_->eps);
    return run_decode_linear(head_->lm_head, h).to(at::kFloat);
  }

  // decode() from Python ints, and with `greedy` each row's argmax token too (what
  // compress::argmax_rows gives, taken while the logits are still in cache). A step's
  // Python side then makes no ATen call of its own: the ~5 tensor ops it made around
  // decode() ran on caches the weights had just swept, ~130 us a step on the 345M int4
  // model (2 threads) against ~10 us warm.
  std::tuple<at::Tensor, std::vector<int64_t>> decode_tokens(std::vector<int64_t> ids, std::vector<int64_t> positions,
                                                             const at::Tensor& k_cache, const at::Tensor& v_cache,
                                                             int64_t pos,
                                                             const std::vector<c10::optional<at::Tensor>>& masks,
                                                             bool greedy) const {
    TORCH_CHECK(!ids.empty() && ids.size() == positions.size(), "DecodePlan.decode_tokens: ", ids.size(),
                " token ids and ", positions.size(), " positions; need one position per id, at least one");
    const int64_t B = static_cast<int64_t>(ids.size());
    const at::Tensor logits = decode(at::from_blob(ids.data(), {B}, at::kLong),
                                     at::from_blob(positions.data(), {B}, at::kLong), k_cache, v_cache, pos, masks);
    std::vector<int64_t> tokens;
    if (greedy) {
      const at::Tensor lc = logits.contiguous();
      const int64_t V = lc.size(1);
      tokens.resize(B);
      for (int64_t b = 0; b < B; ++b) tokens[b] = argmax_row_f32(lc.data_ptr<float>() + b * V, V);
    }
    return {logits, tokens};
  }

  int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool has_head() const { return head_ != nullptr; }

 private:
  struct Layer {
    at::Tensor attn_norm_weight, mlp_norm_weight;
    double eps = 0;
    std::vector<at::Tensor> weights;
    std::vector<DecodeLinear> linears;
    int64_t mask_slot = 0;
  };
  struct Head {
    at::Tensor embed, rope_cos, rope_sin, norm_weight;
    double eps = 0;
    std::vector<at::Tensor> weights;
    DecodeLinear lm_head;
  };
  int64_t n_heads_, n_kv_heads_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<Head> head_;
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
        .def("set_head", &DecodePlan::set_head, py::arg("embed"), py::arg("rope_cos"), py::arg("rope_sin"),
             py::arg("norm_weight"), py::arg("eps"), py::arg("scheme"), py::arg("group_size"), py::arg("weights"),
             py::arg("bias"))
        .def("decode", &DecodePlan::decode, py::arg("ids"), py::arg("positions"), py::arg("k_cache"),
             py::arg("v_cache"), py::arg("pos"), py::arg("masks"), py::call_guard<py::gil_scoped_release>())
        .def("decode_tokens", &DecodePlan::decode_tokens, py::arg("ids"), py::arg("positions"), py::arg("k_cache"),
             py::arg("v_cache"), py::arg("pos"), py::arg("masks"), py::arg("greedy"),
             py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("n_layers", &DecodePlan::n_layers)
        .def_property_readonly("has_head", &DecodePlan::has_head);
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;
  }
  return 0;
}
