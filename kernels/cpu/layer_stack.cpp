// A GGUF model's decoder layers, one decode or verify step of all of them in one call: the same
// kernel calls that models/lean_layer.py's LeanLayer makes from Python for each layer (two norms,
// four quantized linears, rope, the KV store, attention, silu * up, two residual adds), made here
// in a loop, so a step of SmolLM2-135M's 30 layers makes one call from Python instead of 30, each
// with about fifteen Python-level operations (slices, views, adds, the kernels' argument parsing).
//
// The functions are the two extensions' own: this file includes decode_ops.cpp and
// quant_linear.cpp (each in a namespace, without their Python modules) and is compiled with the
// same flags as both (kernels/layer_stack.py), so each call gives the bits the extension gives
// for the same arguments, and the tensor operations between them (slices, views, contiguous, add)
// are the ATen calls Python's make. A step's output equals LeanLayer's bit for bit
// (tests/unit/models/test_lean_layer.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>
#include <sys/syscall.h>
#include <unistd.h>

#define SPECSPLIT_NO_MODULE
namespace dops {
#include "decode_ops.cpp"
}  // namespace dops
namespace qlin {
#include "quant_linear.cpp"
}  // namespace qlin

namespace {

// One bound quantized linear: what kernels/quant_linear.py's bind() fixes.
struct QuantLinear {
  torch::Tensor blocks;  // rows: [N, K/32 * B]; tiles: [N/16, ...] uint8
  int64_t qtype = 0;
  c10::optional<torch::Tensor> bias;
  bool tiles = false;   // the AMX tile layout
  bool avx512 = true;   // rows: let the AVX-512 loop run where the CPU has it

  torch::Tensor operator()(const torch::Tensor& x) const {  // [T, K] -> [T, N]
    return tiles ? qlin::quant_linear_amx(x, blocks, qtype, bias) : qlin::quant_linear(x, blocks, qtype, bias, avx512);
  }
};

struct Layer {
  QuantLinear qkv, o, gate_up, down;
  torch::Tensor input_norm, post_attn_norm;  // [hidden] fp32
  double input_eps = 0, post_attn_eps = 0;
};

QuantLinear linear_of(const torch::Tensor& blocks, int64_t qtype, const c10::optional<torch::Tensor>& bias, bool tiles,
                      bool avx512) {
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2, "layer_stack: blocks must be uint8 [rows, bytes]");
  return QuantLinear{blocks, qtype, bias, tiles, avx512};
}

}  // namespace

// The layers of one model, added in order; run() steps layers [begin, end) of them.
class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), scale_(scale) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "layer_stack: heads ", num_heads, ", KV heads ", num_kv_heads, ", head_dim ", head_dim);
  }

  // each linear as (blocks, qtype code, bias or None, tiles layout, AVX-512 allowed)
  void add(const torch::Tensor& qkv, int64_t qkv_type, const c10::optional<torch::Tensor>& qkv_bias, bool qkv_tiles,
           const torch::Tensor& o, int64_t o_type, const c10::optional<torch::Tensor>& o_bias, bool o_tiles,
           const torch::Tensor& gate_up, int64_t gate_up_type, const c10::optional<torch::Tensor>& gate_up_bias,
           bool gate_up_tiles, const torch::Tensor& down, int64_t down_type,
           const c10::optional<torch::Tensor>& down_bias, bool down_tiles, bool avx512, const torch::Tensor& input_norm,
           double input_eps, const torch::Tensor& post_attn_norm, double post_attn_eps) {
    Layer l;
    l.qkv = linear_of(qkv, qkv_type, qkv_bias, qkv_tiles, avx512);
    l.o = linear_of(o, o_type, o_bias, o_tiles, avx512);
    l.gate_up = linear_of(gate_up, gate_up_type, gate_up_bias, gate_up_tiles, avx512);
    l.down = linear_of(down, down_type, down_bias, down_tiles, avx512);
    l.input_norm = input_norm;
    l.post_attn_norm = post_attn_norm;
    l.input_eps = input_eps;
    l.post_attn_eps = post_attn_eps;
    layers_.push_back(std::move(l));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, hidden] -> the residual stream after layers [begin, end), [T, hidden].
  //   cos, sin [T, 1, D] (RotaryEmbedding.tables); slot_mapping [T], block_tables [B, max_blocks],
  //   q_lens [B], kv_lens [B] int64 (BatchMetadata); kv [layers, 2, blocks, block_size, Hkv, D]
  //   (PagedKVCache.data); tree_mask [T] int64 or None (BatchMetadata.tree_mask: draft trees'
  //   rows, decode_ops.cpp's paged_attention)
  torch::Tensor run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& slot_mapping, const torch::Tensor& block_tables, const torch::Tensor& q_lens,
                    const torch::Tensor& kv_lens, const torch::Tensor& kv, int64_t begin, int64_t end,
                    const c10::optional<torch::Tensor>& tree_mask) const {
    TORCH_CHECK(0 <= begin && begin <= end && end <= size(), "layer_stack: layers [", begin, ", ", end, ") of ", size());
    TORCH_CHECK(kv.dim() == 6 && kv.size(0) >= end && kv.size(1) == 2 && kv.size(4) == Hkv_ && kv.size(5) == D_,
                "layer_stack: kv must be [layers, 2, blocks, block_size, ", Hkv_, ", ", D_, "]");
    const int64_t t = x.size(0), q_size = H_ * D_, qk_size = (H_ + Hkv_) * D_, qk_heads = H_ + Hkv_;
    for (int64_t i = begin; i < end; ++i) {
      const Layer& l = layers_[i];
      const torch::Tensor k_cache = kv.select(0, i).select(0, 0), v_cache = kv.select(0, i).select(0, 1);
      const torch::Tensor qkv = l.qkv(dops::decode_rms_norm(x, l.input_norm, l.input_eps));  // [T, q + 2kv]
      const torch::Tensor qk = dops::decode_rope(qkv.slice(1, 0, qk_size).view({t, qk_heads, D_}), cos, sin);
      const torch::Tensor q = qk.slice(1, 0, H_), k = qk.slice(1, H_, qk_heads);  // [T, H, D], [T, Hkv, D]
      const torch::Tensor v = qkv.slice(1, qk_size, qkv.size(1)).view({t, Hkv_, D_});
      dops::decode_store_kv(k, v, k_cache, v_cache, slot_mapping);
      const torch::Tensor attn =
          dops::decode_paged_attention(q.contiguous(), k_cache, v_cache, block_tables, q_lens, kv_lens, scale_, l.qkv.avx512,
                                       tree_mask);
      x = x + l.o(attn.reshape({t, q_size}));
      const torch::Tensor gate_up = l.gate_up(dops::decode_rms_norm(x, l.post_attn_norm, l.post_attn_eps));
      x = x + l.down(dops::decode_silu_mul(gate_up));
    }
    return x;
  }

 private:
  int64_t H_, Hkv_, D_;
  double scale_;
  std::vector<Layer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local())  // builds of other checkouts may load too
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("add", &LayerStack::add, "append a layer: its four quantized linears and two norms")
      .def("__len__", &LayerStack::size)
      .def("run", &LayerStack::run, "one decode or verify step of layers [begin, end)", pybind11::arg("x"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
           pybind11::arg("q_lens"), pybind11::arg("kv_lens"), pybind11::arg("kv"), pybind11::arg("begin"),
           pybind11::arg("end"), pybind11::arg("tree_mask") = pybind11::none());
}
