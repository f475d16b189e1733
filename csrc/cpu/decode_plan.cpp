// compress._C.DecodePlan: a whole decode step on the paged KV cache in one call from
// Python. The runtime builds it once after loading (compress/runtime/native_decode.py:
// one add_layer per layer with its tensors and attention window, set_head for the
// embedding, rope tables, final norm and lm_head) and per step passes only what changes:
// decode_tokens() takes the token ids and their positions (Python ints, one per row), the
// pools and the block tables, and returns the fp32 logits (and each row's argmax token
// when greedy).
//
// Why: a decode step from Python made ~15 PyTorch ops around the layers and converted
// ~30 arguments per layer call. Measured on the 345M int4 model (2 threads, temporary
// timers): 24 layer calls took 9.7 ms a step from Python against 8.3 ms inside them, ~58 us
// a call of argument handling, 12% of a step; and the ops around them ran on caches the
// weights had just swept, ~130 us a step against ~10 us warm. Here a step is one call,
// with the GIL released.
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu/ops.h"

namespace compress_cpu {
namespace {

constexpr const char* kOp = "DecodePlan.decode_tokens";

class DecodePlan {
 public:
  DecodePlan(int64_t n_heads, int64_t n_kv_heads) : n_heads_(n_heads), n_kv_heads_(n_kv_heads) {
    TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, "DecodePlan: n_heads ", n_heads,
                " must be a positive multiple of n_kv_heads ", n_kv_heads);
  }

  // One decoder layer: its norms, its four linears (qkv, o, gate_up, down; each a scheme
  // and that scheme's tensors from `weights`, decode_layer.cpp) and its attention window
  // (0 = full attention: keys 0..pos; w > 0: the last w of them); Qwen3's per-head q and
  // k norm weights where the model has them.
  void add_layer(at::Tensor attn_norm_weight, at::Tensor mlp_norm_weight, double eps, std::vector<std::string> schemes,
                 std::vector<int64_t> group_sizes, std::vector<at::Tensor> weights,
                 std::vector<c10::optional<at::Tensor>> biases, int64_t window,
                 c10::optional<at::Tensor> q_norm_weight, c10::optional<at::Tensor> k_norm_weight) {
    TORCH_CHECK(window >= 0, "DecodePlan.add_layer: window must be >= 0 (0 = full attention), got ", window);
    TORCH_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(),
                "DecodePlan.add_layer: q_norm_weight and k_norm_weight come together (both or neither)");
    for (const auto* w : {&q_norm_weight, &k_norm_weight})
      TORCH_CHECK(!w->has_value() || ((*w)->dim() == 1 && (*w)->scalar_type() == attn_norm_weight.scalar_type()),
                  "DecodePlan.add_layer: a q / k norm weight must be [head_dim] in the norms' dtype ",
                  attn_norm_weight.scalar_type(), ", got ", (*w)->sizes(), " ", (*w)->scalar_type());
    auto layer = std::make_unique<Layer>();
    layer->attn_norm_weight = std::move(attn_norm_weight);
    layer->mlp_norm_weight = std::move(mlp_norm_weight);
    layer->eps = eps;
    layer->weights = std::move(weights);  // the linears point into this vector: never resized again
    layer->linears = decode_linears(schemes, group_sizes, layer->weights, biases);
    layer->window = window;
    layer->q_norm_weight = std::move(q_norm_weight);
    layer->k_norm_weight = std::move(k_norm_weight);
    layers_.push_back(std::move(layer));
  }

  // What surrounds the layers: the embedding table [vocab, hidden], the rope tables
  // [positions, head_dim], the final norm and the lm_head linear (one of the layers'
  // schemes: its tensors in `weights`).
  void set_head(at::Tensor embed, at::Tensor rope_cos, at::Tensor rope_sin, at::Tensor norm_weight, double eps,
                std::string scheme, int64_t group_size, std::vector<at::Tensor> weights,
                c10::optional<at::Tensor> bias) {
    TORCH_CHECK(embed.dim() == 2, "DecodePlan.set_head: embed must be [vocab, hidden], got ", embed.sizes());
    TORCH_CHECK(rope_cos.dim() == 2 && rope_sin.sizes() == rope_cos.sizes() && rope_cos.size(1) % 2 == 0,
                "DecodePlan.set_head: rope_cos and rope_sin must both be [positions, head_dim] (head_dim even), got ",
                rope_cos.sizes(), " and ", rope_sin.sizes());
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

  // A whole decode step: token ids[b] at position positions[b] for each row b, through
  // the embedding, every layer (each writes its new k / v at the row's position through
  // block_tables [B, M] (int32) into its pools k_pool[i] / v_pool[i], then attends over
  // positions 0..positions[b] within its window), the final norm and the lm_head: fp32
  // logits [B, vocab], and with `greedy` each row's argmax token (what
  // compress::argmax_rows gives, taken while the logits are still in cache; else empty).
  // k_pool / v_pool: [layers, num_blocks, n_kv_heads, block_size, head_dim], float32,
  // bfloat16 or float16 (any of them under float32 or bfloat16 activations).
  // `logit_rows`: the rows whose logits (and tokens) are wanted, in order (none given:
  // every row; empty: none, the head does not run); a prompt chunk run as one-token rows
  // needs its last token's only.
  std::tuple<at::Tensor, std::vector<int64_t>> decode_tokens(const std::vector<int64_t>& ids,
                                                             const std::vector<int64_t>& positions,
                                                             const at::Tensor& k_pool, const at::Tensor& v_pool,
                                                             const at::Tensor& block_tables, bool greedy,
                                                             const std::optional<std::vector<int64_t>>& logit_rows) const {
    TORCH_CHECK(head_ != nullptr, kOp, ": no head (call set_head first)");
    const int64_t n_layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(n_layers > 0, kOp, ": the plan has no layers");
    TORCH_CHECK(!ids.empty() && ids.size() == positions.size(), kOp, ": ", ids.size(), " token ids and ",
                positions.size(), " positions; need one position per id, at least one");
    const int64_t B = static_cast<int64_t>(ids.size()), D = head_->rope_cos.size(1);
    TORCH_CHECK(k_pool.dim() == 5 && v_pool.dim() == 5 && k_pool.size(0) == n_layers && v_pool.size(0) == n_layers, kOp, ": k_pool and v_pool must be [", n_layers,
                " layers, num_blocks, n_kv_heads, block_size, head_dim], got k_pool ", k_pool.sizes(), ", v_pool ",
                v_pool.sizes());
    check_paged_pools(kOp, k_pool.select(0, 0), v_pool.select(0, 0), n_kv_heads_, D);
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kInt &&
                    block_tables.device().is_cpu(),
                kOp, ": block_tables must be an int32 CPU tensor [B, M] with B = ", B, " rows, got ",
                block_tables.scalar_type(), " ", block_tables.sizes());
    const int64_t vocab = head_->embed.size(0), n_rope = head_->rope_cos.size(0);
    std::vector<int32_t> lens(B);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t t = ids[b], p = positions[b];
      TORCH_CHECK(t >= 0 && t < vocab, kOp, ": token id ", t, " (row ", b, ") outside the vocabulary of ", vocab);
      TORCH_CHECK(p >= 0 && p < n_rope, kOp, ": position ", p, " (row ", b, ") outside the rope table's ", n_rope);
      lens[b] = static_cast<int32_t>(p + 1);
    }
    const at::Tensor tables = block_tables.contiguous();
    const PagedRows rows{B, tables.size(1), positions.data(), tables.data_ptr<int32_t>(), lens.data()};
    // every block a layer reads or writes: the widest window's (0 = all of them)
    check_paged_tables(kOp, rows.tables, B, rows.M, rows.lens, k_pool.size(3), k_pool.size(1), widest_window());

    const at::Tensor idt = at::from_blob(const_cast<int64_t*>(ids.data()), {B}, at::kLong);
    const at::Tensor post = at::from_blob(const_cast<int64_t*>(positions.data()), {B}, at::kLong);
    at::Tensor h = at::index_select(head_->embed, 0, idt);
    const at::Tensor cos = at::index_select(head_->rope_cos, 0, post).to(h.scalar_type());
    const at::Tensor sin = at::index_select(head_->rope_sin, 0, post).to(h.scalar_type());
    for (int64_t i = 0; i < n_layers; ++i) {
      const Layer& l = *layers_[i];
      h = decode_layer_run(h, l.attn_norm_weight, l.mlp_norm_weight, l.eps, l.linears, cos, sin, k_pool.select(0, i),
                           v_pool.select(0, i), rows, l.window, n_heads_, n_kv_heads_, l.q_norm_weight,
                           l.k_norm_weight);
    }
    if (logit_rows) {
      for (const int64_t r : *logit_rows)
        TORCH_CHECK(r >= 0 && r < B, kOp, ": logit row ", r, " outside the ", B, " rows");
      if (logit_rows->empty()) return {at::empty({0, head_->embed.size(0)}, h.options().dtype(at::kFloat)), {}};
      const at::Tensor wanted = at::from_blob(const_cast<int64_t*>(logit_rows->data()),
                                              {static_cast<int64_t>(logit_rows->size())}, at::kLong);
      h = at::index_select(h, 0, wanted);
    }
    h = rms_norm(h, head_->norm_weight, head_->eps);
    const at::Tensor logits = run_decode_linear(head_->lm_head, h).to(at::kFloat).contiguous();
    std::vector<int64_t> tokens;
    if (greedy) {
      const int64_t V = logits.size(1), R = logits.size(0);
      tokens.resize(R);
      for (int64_t b = 0; b < R; ++b) tokens[b] = argmax_row_f32(logits.data_ptr<float>() + b * V, V);
    }
    return {logits, tokens};
  }

  int64_t n_layers() const { return static_cast<int64_t>(layers_.size()); }
  bool has_head() const { return head_ != nullptr; }
  std::vector<int64_t> windows() const {
    std::vector<int64_t> w;
    for (const auto& l : layers_) w.push_back(l->window);
    return w;
  }

 private:
  int64_t widest_window() const {
    int64_t widest = 0;
    for (const auto& l : layers_) {
      if (l->window == 0) return 0;
      widest = std::max(widest, l->window);
    }
    return widest;
  }

  struct Layer {
    at::Tensor attn_norm_weight, mlp_norm_weight;
    double eps = 0;
    std::vector<at::Tensor> weights;
    std::vector<DecodeLinear> linears;
    int64_t window = 0;
    c10::optional<at::Tensor> q_norm_weight, k_norm_weight;   // Qwen3's per-head q / k norms
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
    py::class_<DecodePlan>(m, "DecodePlan", "A whole decode step on the paged KV cache in one call.")
        .def(py::init<int64_t, int64_t>(), py::arg("n_heads"), py::arg("n_kv_heads"))
        .def("add_layer", &DecodePlan::add_layer, py::arg("attn_norm_weight"), py::arg("mlp_norm_weight"),
             py::arg("eps"), py::arg("schemes"), py::arg("group_sizes"), py::arg("weights"), py::arg("biases"),
             py::arg("window"), py::arg("q_norm_weight") = py::none(), py::arg("k_norm_weight") = py::none())
        .def("set_head", &DecodePlan::set_head, py::arg("embed"), py::arg("rope_cos"), py::arg("rope_sin"),
             py::arg("norm_weight"), py::arg("eps"), py::arg("scheme"), py::arg("group_size"), py::arg("weights"),
             py::arg("bias"))
        .def("decode_tokens", &DecodePlan::decode_tokens, py::arg("ids"), py::arg("positions"), py::arg("k_pool"),
             py::arg("v_pool"), py::arg("block_tables"), py::arg("greedy"),
             py::arg("logit_rows") = py::none(), py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("n_layers", &DecodePlan::n_layers)
        .def_property_readonly("has_head", &DecodePlan::has_head)
        .def_property_readonly("windows", &DecodePlan::windows);
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;
  }
  return 0;
}
