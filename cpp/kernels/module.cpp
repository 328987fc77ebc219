// The pybind11 module `pyserve._kernels`: quantized matmul kernels for the CPU worker.
//
// Tensors cross as raw addresses plus sizes (no torch headers in the build); the Python wrapper
// pyserve/worker/quant.py checks dtypes, shapes and contiguity before calling. The matmul
// releases the GIL.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "arg_checks.h"
#include "attention.h"
#include "decoder_stack.h"
#include "dispatch.h"
#include "ggml_repack.h"
#include "layer_ops.h"
#include "moe.h"
#include "prefill_attention.h"
#include "thread_pool.h"

namespace py = pybind11;
namespace pk = pyserve_kernels;

namespace {

template <class T>
T* address(uintptr_t value) {
  return reinterpret_cast<T*>(value);
}

void matmul(uintptr_t x, int64_t x_stride, int rows, int activation_bits, uintptr_t weights,
            uintptr_t scales, int n, int k, int bits, int group, uintptr_t bias, uintptr_t out,
            int64_t out_stride, bool super_scales, bool mxfp4) {
  const pk::PackedWeights w{address<const uint8_t>(weights),
                            address<const uint16_t>(scales),
                            n,
                            k,
                            bits,
                            group,
                            super_scales,
                            mxfp4};
  py::gil_scoped_release released;
  pk::quantized_matmul(address<const float>(x), x_stride, rows, activation_bits, w,
                       address<const float>(bias), address<float>(out), out_stride);
}

// One projection of every expert of a mixture (gate/up, or down), packed at load: a step's
// grouped matmul passes only the rows each expert takes.
class ExpertSet {
 public:
  void add(uintptr_t weights, uintptr_t scales, int n, int k, int bits, int group,
           bool super_scales, bool mxfp4) {
    weights_.push_back({address<const uint8_t>(weights), address<const uint16_t>(scales), n, k,
                        bits, group, super_scales, mxfp4});
  }
  int size() const { return static_cast<int>(weights_.size()); }
  const std::vector<pk::PackedWeights>& weights() const { return weights_; }
  void matmul(uintptr_t x, int64_t x_stride, int activation_bits, uintptr_t counts, uintptr_t out,
              int64_t out_stride) const {
    py::gil_scoped_release released;
    pk::grouped_matmul(address<const float>(x), x_stride, activation_bits, weights_.data(),
                       address<const int64_t>(counts), size(), address<float>(out), out_stride);
  }

 private:
  std::vector<pk::PackedWeights> weights_;
};

void moe_group(uintptr_t experts, uintptr_t weights, int tokens, int top_k, int num_experts,
               uintptr_t row_token, uintptr_t row_weight, uintptr_t counts) {
  pk::moe_group(address<const int64_t>(experts), address<const float>(weights), tokens, top_k,
                num_experts, address<int64_t>(row_token), address<float>(row_weight),
                address<int64_t>(counts));
}

void moe_route(uintptr_t x, int64_t x_stride, int tokens, int hidden, uintptr_t router,
               int num_experts, int top_k, bool normalize, uintptr_t weights, uintptr_t experts,
               uintptr_t shared_gate, uintptr_t shared_weight, uintptr_t bias,
               bool softmax_after_top_k) {
  pk::MoeRouteArgs args{address<const float>(x),
                        x_stride,
                        tokens,
                        hidden,
                        address<const float>(router),
                        num_experts,
                        top_k,
                        normalize,
                        address<float>(weights),
                        address<int64_t>(experts)};
  args.shared_gate = address<const float>(shared_gate);
  args.shared_weight = address<float>(shared_weight);
  args.bias = address<const float>(bias);
  args.softmax_after_top_k = softmax_after_top_k;
  py::gil_scoped_release released;
  pk::moe_route(args);
}

void moe_combine(uintptr_t y, int64_t y_stride, uintptr_t row_token, uintptr_t row_weight, int rows,
                 int hidden, uintptr_t out, int64_t out_stride, int tokens) {
  pk::moe_combine(address<const float>(y), y_stride, address<const int64_t>(row_token),
                  address<const float>(row_weight), rows, hidden, address<float>(out), out_stride,
                  tokens);
}

void quantize_activations(uintptr_t x, int64_t x_stride, int rows, int k, int group, int bits,
                          int weight_bits, uintptr_t q, uintptr_t scale, uintptr_t sum) {
  py::gil_scoped_release released;
  pk::quantize_activations(address<const float>(x), x_stride, rows, k, group, bits, weight_bits,
                           address<void>(q), address<float>(scale), address<int32_t>(sum));
}

void paged_decode_attention(uintptr_t q, int64_t q_token_stride, int q_dtype, int num_queries,
                            int num_heads, uintptr_t k_cache, uintptr_t v_cache, int cache_dtype,
                            int num_kv_heads, int num_blocks, int block_size, int head_dim,
                            uintptr_t block_tables, int table_index_bytes, int64_t table_stride,
                            uintptr_t context_lens, int context_index_bytes, float scale,
                            uintptr_t out, int64_t out_token_stride, int partition_tokens,
                            int window, float softcap, uintptr_t sinks, uintptr_t positions,
                            uintptr_t k_scale, uintptr_t v_scale) {
  const pk::DecodeAttentionArgs args{address<const void>(q),
                                     q_token_stride,
                                     static_cast<pk::DType>(q_dtype),
                                     num_queries,
                                     num_heads,
                                     address<const void>(k_cache),
                                     address<const void>(v_cache),
                                     static_cast<pk::DType>(cache_dtype),
                                     num_kv_heads,
                                     num_blocks,
                                     block_size,
                                     head_dim,
                                     address<const void>(block_tables),
                                     table_index_bytes,
                                     table_stride,
                                     address<const void>(context_lens),
                                     context_index_bytes,
                                     scale,
                                     address<void>(out),
                                     out_token_stride,
                                     partition_tokens,
                                     window,
                                     softcap,
                                     address<const float>(sinks),
                                     address<const void>(positions),
                                     address<const uint16_t>(k_scale),
                                     address<const uint16_t>(v_scale)};
  py::gil_scoped_release released;
  pk::paged_decode_attention(args);
}

void paged_prefill_attention(uintptr_t q, int64_t q_token_stride, int q_dtype, int num_rows,
                             int num_heads, uintptr_t k_cache, uintptr_t v_cache, int cache_dtype,
                             int num_kv_heads, int num_blocks, int block_size, int head_dim,
                             uintptr_t spans, int num_spans, uintptr_t block_tables,
                             int table_index_bytes, int64_t table_stride, float scale,
                             uintptr_t out, int64_t out_token_stride, int window, float softcap,
                             uintptr_t sinks, uintptr_t k_scale, uintptr_t v_scale) {
  const pk::PrefillAttentionArgs args{address<const void>(q),
                                      q_token_stride,
                                      static_cast<pk::DType>(q_dtype),
                                      num_rows,
                                      num_heads,
                                      address<const void>(k_cache),
                                      address<const void>(v_cache),
                                      static_cast<pk::DType>(cache_dtype),
                                      num_kv_heads,
                                      num_blocks,
                                      block_size,
                                      head_dim,
                                      address<const int64_t>(spans),
                                      num_spans,
                                      address<const void>(block_tables),
                                      table_index_bytes,
                                      table_stride,
                                      scale,
                                      address<void>(out),
                                      out_token_stride,
                                      window,
                                      softcap,
                                      address<const float>(sinks),
                                      address<const uint16_t>(k_scale),
                                      address<const uint16_t>(v_scale)};
  py::gil_scoped_release released;
  pk::paged_prefill_attention(args);
}

// The attention loops' soft-cap of the current ISA over n float32 values in place; returns the
// largest (for tests of its tanh).
float attention_softcap(uintptr_t values, int n, float cap) {
  pk::check(n >= 1 && cap > 0.0f, "n must be >= 1 and cap > 0");
  return pk::attention_softcap(address<float>(values), n, cap);
}

void rms_norm(int dtype, uintptr_t x, int64_t x_stride, int rows, int hidden, uintptr_t weight,
              float eps, uintptr_t out, int64_t out_stride, uintptr_t residual,
              int64_t residual_stride) {
  const pk::RmsNormArgs args{static_cast<pk::DType>(dtype),
                             address<const void>(x),
                             x_stride,
                             rows,
                             hidden,
                             address<const void>(weight),
                             eps,
                             address<void>(out),
                             out_stride,
                             address<void>(residual),
                             residual_stride};
  py::gil_scoped_release released;
  pk::rms_norm(args);
}

// act(gate) · up over rows of [gate | up]
void gated_activation(pk::GatedActivation activation, int dtype, uintptr_t input,
                      int64_t input_stride, int rows, int width, uintptr_t out, int64_t out_stride,
                      float alpha = 0.0f, float limit = 0.0f) {
  const pk::SiluMulArgs args{static_cast<pk::DType>(dtype),
                             address<const void>(input),
                             input_stride,
                             rows,
                             width,
                             address<void>(out),
                             out_stride,
                             activation,
                             alpha,
                             limit};
  py::gil_scoped_release released;
  pk::silu_mul(args);
}

void silu_mul(int dtype, uintptr_t input, int64_t input_stride, int rows, int width, uintptr_t out,
              int64_t out_stride) {
  gated_activation(pk::GatedActivation::kSilu, dtype, input, input_stride, rows, width, out,
                   out_stride);
}

void gelu_tanh_mul(int dtype, uintptr_t input, int64_t input_stride, int rows, int width,
                   uintptr_t out, int64_t out_stride) {
  gated_activation(pk::GatedActivation::kGeluTanh, dtype, input, input_stride, rows, width, out,
                   out_stride);
}

void clamped_swiglu_mul(int dtype, uintptr_t input, int64_t input_stride, int rows, int width,
                        uintptr_t out, int64_t out_stride, float alpha, float limit) {
  gated_activation(pk::GatedActivation::kClampedSwiglu, dtype, input, input_stride, rows, width,
                   out, out_stride, alpha, limit);
}

void rope_write_kv(uintptr_t qkv, int64_t qkv_stride, int rows, int num_heads, int num_kv_heads,
                   int head_dim, uintptr_t cos, uintptr_t sin, uintptr_t slots, uintptr_t k_cache,
                   uintptr_t v_cache, int cache_dtype, int num_blocks, int block_size,
                   int rotary_dim, uintptr_t q_norm, uintptr_t k_norm, float eps, uintptr_t k_scale,
                   uintptr_t v_scale) {
  const pk::RopeKvArgs args{address<float>(qkv),
                            qkv_stride,
                            rows,
                            num_heads,
                            num_kv_heads,
                            head_dim,
                            address<const float>(cos),
                            address<const float>(sin),
                            address<const int64_t>(slots),
                            address<void>(k_cache),
                            address<void>(v_cache),
                            static_cast<pk::DType>(cache_dtype),
                            num_blocks,
                            block_size,
                            rotary_dim,
                            address<const float>(q_norm),
                            address<const float>(k_norm),
                            eps,
                            address<uint16_t>(k_scale),
                            address<uint16_t>(v_scale)};
  py::gil_scoped_release released;
  pk::rope_write_kv(args);
}

py::list supported_isas() {
  py::list names;
  const std::string before = pk::current_isa();
  for (const char* name : {"avx512_vnni", "avx2", "scalar"}) {
    try {
      pk::set_isa(name);
      names.append(name);
    } catch (const std::invalid_argument&) {
    }
  }
  pk::set_isa(before);
  return names;
}

pk::StackLinear stack_linear_fields(const py::tuple& t) {
  // (weights, scales, n, k, bits, group, bias, activation_bits[, super_scales[, mxfp4]]):
  // QuantLinear's
  pk::check(t.size() >= 8 && t.size() <= 10, [&] {
    return "a linear layer: expected 8 to 10 fields, got " + std::to_string(t.size());
  });
  return {{address<const uint8_t>(t[0].cast<uintptr_t>()),
           address<const uint16_t>(t[1].cast<uintptr_t>()), t[2].cast<int>(), t[3].cast<int>(),
           t[4].cast<int>(), t[5].cast<int>(), t.size() >= 9 && t[8].cast<bool>(),
           t.size() == 10 && t[9].cast<bool>()},
          address<const float>(t[6].cast<uintptr_t>()),
          t[7].cast<int>()};
}

// One tuple of fields, or a list of them: a fused projection's row segments, in order
pk::StackLinear stack_linear(const py::object& linear) {
  if (py::isinstance<py::tuple>(linear)) return stack_linear_fields(linear.cast<py::tuple>());
  const auto segments = linear.cast<py::list>();
  pk::check(!segments.empty(), "a linear layer: no segments");
  pk::StackLinear first = stack_linear_fields(segments[0].cast<py::tuple>());
  for (size_t i = 1; i < segments.size(); ++i) {
    const pk::StackLinear next = stack_linear_fields(segments[i].cast<py::tuple>());
    pk::check(next.activation_bits == first.activation_bits,
              "a linear layer's segments must share activation bits");
    first.more.push_back({next.weights, next.bias});
  }
  return first;
}

// A layer's mixture of experts for the stack: the router's address, the experts' projections
// (the ExpertSets the layer loop's grouped matmuls run) and the shared expert, if any
pk::StackMoE make_stack_moe(uintptr_t router, int num_experts, int top_k, bool normalize,
                            const ExpertSet& gate_up, const ExpertSet& down, int activation_bits,
                            uintptr_t shared_gate, const py::object& shared_gate_up,
                            const py::object& shared_down, uintptr_t router_bias,
                            bool softmax_after_top_k, uintptr_t gate_up_bias, uintptr_t down_bias) {
  pk::StackMoE moe;
  moe.router = address<const float>(router);
  pk::check(moe.router != nullptr, "a mixture without a router");
  moe.num_experts = num_experts;
  moe.top_k = top_k;
  moe.normalize = normalize;
  moe.activation_bits = activation_bits;
  moe.router_bias = address<const float>(router_bias);
  moe.softmax_after_top_k = softmax_after_top_k;
  moe.gate_up_bias = address<const float>(gate_up_bias);
  moe.down_bias = address<const float>(down_bias);
  moe.gate_up = gate_up.weights();
  moe.down = down.weights();
  moe.shared_gate = address<const float>(shared_gate);
  pk::check((moe.shared_gate == nullptr) == shared_gate_up.is_none() &&
                shared_gate_up.is_none() == shared_down.is_none(),
            "a shared expert needs its gate and both projections");
  if (moe.shared_gate != nullptr) {
    moe.shared_gate_up = stack_linear(shared_gate_up);
    moe.shared_down = stack_linear(shared_down);
  }
  return moe;
}

pk::GatedActivation gated_activation_named(const std::string& name) {
  if (name == "silu") return pk::GatedActivation::kSilu;
  if (name == "gelu_tanh") return pk::GatedActivation::kGeluTanh;
  if (name == "clamped_swiglu") return pk::GatedActivation::kClampedSwiglu;
  throw std::invalid_argument("activation " + name + ": silu, gelu_tanh or clamped_swiglu");
}

pk::DecoderStack make_stack(int hidden, int num_heads, int num_kv_heads, int head_dim,
                            int intermediate, float eps, int cache_dtype, int num_blocks,
                            int block_size, const std::string& activation, float softcap,
                            const py::sequence& rotary_dims, float swiglu_alpha,
                            float swiglu_limit) {
  pk::StackShape shape{hidden,
                       num_heads,
                       num_kv_heads,
                       head_dim,
                       intermediate,
                       eps,
                       static_cast<pk::DType>(cache_dtype),
                       num_blocks,
                       block_size,
                       gated_activation_named(activation),
                       swiglu_alpha,
                       swiglu_limit,
                       softcap,
                       {}};
  for (auto dim : rotary_dims) shape.rotary_dims.push_back(dim.cast<int>());
  return pk::DecoderStack(shape);
}

void stack_add_layer(pk::DecoderStack& stack, uintptr_t input_norm, uintptr_t post_attention_norm,
                     const py::object& qkv, const py::object& o, const py::object& gate_up,
                     const py::object& down, uintptr_t k_cache, uintptr_t v_cache, uintptr_t q_norm,
                     uintptr_t k_norm, uintptr_t attn_out_norm, uintptr_t mlp_out_norm,
                     int rope_table, int window, bool full_width_qk_norm, const py::object& moe,
                     uintptr_t sinks, uintptr_t k_scale, uintptr_t v_scale) {
  // a mixture's layer has no dense gate_up and down (None)
  pk::check(moe.is_none() != (gate_up.is_none() && down.is_none()),
            "a layer's MLP: gate_up and down, or a mixture of experts (moe), not both");
  pk::StackLayer layer{address<const float>(input_norm),
                       address<const float>(post_attention_norm),
                       stack_linear(qkv),
                       stack_linear(o),
                       gate_up.is_none() ? pk::StackLinear{} : stack_linear(gate_up),
                       down.is_none() ? pk::StackLinear{} : stack_linear(down),
                       address<void>(k_cache),
                       address<void>(v_cache)};
  layer.full_width_qk_norm = full_width_qk_norm;
  if (!moe.is_none()) layer.moe = moe.cast<pk::StackMoE>();
  layer.q_norm = address<const float>(q_norm);
  layer.k_norm = address<const float>(k_norm);
  layer.attn_out_norm = address<const float>(attn_out_norm);
  layer.mlp_out_norm = address<const float>(mlp_out_norm);
  layer.rope_table = rope_table;
  layer.window = window;
  layer.sinks = address<const float>(sinks);
  layer.k_scale = address<uint16_t>(k_scale);
  layer.v_scale = address<uint16_t>(v_scale);
  stack.add_layer(layer);
}

// A sequence of float32 addresses (one per rope table) as pointers
void table_addresses(const py::sequence& values, std::vector<const float*>& out) {
  out.clear();
  for (auto value : values) out.push_back(address<const float>(value.cast<uintptr_t>()));
}

void stack_forward(const pk::DecoderStack& stack, int rows, uintptr_t hidden, uintptr_t residual,
                   const py::sequence& cos, const py::sequence& sin, uintptr_t slots,
                   uintptr_t spans, int num_spans, uintptr_t span_tables, int64_t span_table_stride,
                   int num_decodes, uintptr_t decode_rows, uintptr_t decode_tables,
                   int64_t decode_table_stride, uintptr_t context_lens, float scale,
                   uintptr_t decode_positions) {
  thread_local std::vector<const float*> cos_tables, sin_tables;
  table_addresses(cos, cos_tables);
  table_addresses(sin, sin_tables);
  pk::check(cos_tables.size() == sin_tables.size(), "as many sin tables as cos tables");
  const pk::StackBatch batch{rows,
                             address<float>(hidden),
                             address<float>(residual),
                             cos_tables.data(),
                             sin_tables.data(),
                             static_cast<int>(cos_tables.size()),
                             address<const int64_t>(slots),
                             address<const int64_t>(spans),
                             num_spans,
                             address<const int64_t>(span_tables),
                             span_table_stride,
                             num_decodes,
                             address<const int64_t>(decode_rows),
                             address<const int64_t>(decode_tables),
                             decode_table_stride,
                             address<const int64_t>(context_lens),
                             scale,
                             address<const int64_t>(decode_positions)};
  py::gil_scoped_release released;
  stack.forward(batch);
}

void repack_ggml(const std::string& type, uintptr_t blocks, int64_t row_bytes, int rows, int k,
                 int bits, uintptr_t data, uintptr_t scales, bool super_scales) {
  const pk::GgmlType parsed = pk::ggml_type_named(type);
  py::gil_scoped_release released;
  pk::repack_ggml(parsed, address<const uint8_t>(blocks), row_bytes, rows, k, bits,
                  address<uint8_t>(data), address<uint16_t>(scales), super_scales);
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "Quantized small-batch matmul kernels for the CPU worker (cpp/kernels/README.md)";
  m.attr("TILE_ROWS") = pk::kTileRows;
  m.attr("MAX_GROUP") = pk::kMaxGroup;
  m.def("matmul", &matmul, py::arg("x"), py::arg("x_stride"), py::arg("rows"),
        py::arg("activation_bits"), py::arg("weights"), py::arg("scales"), py::arg("n"),
        py::arg("k"), py::arg("bits"), py::arg("group"), py::arg("bias"), py::arg("out"),
        py::arg("out_stride"), py::arg("super_scales") = false, py::arg("mxfp4") = false,
        "out[rows, n] = x[rows, k] @ W.T (+ bias); float32 addresses, bias 0 for none; "
        "super_scales: the scales in Q4_K's super-block form; mxfp4: 4-bit MXFP4 codes with "
        "an exponent byte per group (qgemm.h)");
  m.def("quantize_activations", &quantize_activations, py::arg("x"), py::arg("x_stride"),
        py::arg("rows"), py::arg("k"), py::arg("group"), py::arg("bits"), py::arg("weight_bits"),
        py::arg("q"), py::arg("scale"), py::arg("sum"),
        "the per-group integer activations and power-of-two scales matmul computes with for "
        "weight_bits weights");
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("q_token_stride"),
        py::arg("q_dtype"), py::arg("num_queries"), py::arg("num_heads"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("cache_dtype"), py::arg("num_kv_heads"), py::arg("num_blocks"),
        py::arg("block_size"), py::arg("head_dim"), py::arg("block_tables"),
        py::arg("table_index_bytes"), py::arg("table_stride"), py::arg("context_lens"),
        py::arg("context_index_bytes"), py::arg("scale"), py::arg("out"),
        py::arg("out_token_stride"), py::arg("partition_tokens"), py::arg("window") = 0,
        py::arg("softcap") = 0.0f, py::arg("sinks") = 0, py::arg("positions") = 0,
        py::arg("k_scale") = 0, py::arg("v_scale") = 0,
        "decode attention over the paged KV cache, read in place (dtype codes: 0 float32, "
        "1 bfloat16, 2 float16, 3 int8 with k_scale and v_scale: the addresses of float16 "
        "scales, one per 32 values, K's [kv_heads, blocks, groups, block_size] and V's "
        "[kv_heads, blocks, block_size, groups], groups = ceil(head_dim / 32)); "
        "partition_tokens 0 chooses the split itself; "
        "window > 0: the "
        "last `window` positions only; softcap > 0: scores -> softcap * tanh(score / softcap); "
        "sinks: the address of a float32 logit per head, one more softmax column (0: none); "
        "positions: each query's own position, where its window ends, as wide as context_lens "
        "(0: context - 1)");
  m.def("paged_prefill_attention", &paged_prefill_attention, py::arg("q"),
        py::arg("q_token_stride"), py::arg("q_dtype"), py::arg("num_rows"), py::arg("num_heads"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_dtype"), py::arg("num_kv_heads"),
        py::arg("num_blocks"), py::arg("block_size"), py::arg("head_dim"), py::arg("spans"),
        py::arg("num_spans"), py::arg("block_tables"), py::arg("table_index_bytes"),
        py::arg("table_stride"), py::arg("scale"), py::arg("out"), py::arg("out_token_stride"),
        py::arg("window") = 0, py::arg("softcap") = 0.0f, py::arg("sinks") = 0,
        py::arg("k_scale") = 0, py::arg("v_scale") = 0,
        "causal attention of prompt chunks (spans: int64 [num_spans, 3] of first row, rows, "
        "cached tokens before them) over the paged KV cache, read in place; window, softcap, "
        "sinks and an int8 cache's scales as paged_decode_attention's");
  // int8_q8_0: an int8 cache in q8_0's grouping (float16 scales per 32 values); a build that
  // names another int8 feature reads another layout, and the backend will not use it for int8
  m.attr("ATTENTION_FEATURES") = py::make_tuple("window", "softcap", "sinks", "int8_q8_0");
  m.def("attention_softcap", &attention_softcap, py::arg("values"), py::arg("n"), py::arg("cap"),
        "values[i] = cap * tanh(values[i] / cap) in place over n float32 values, with the "
        "current ISA's attention loops; returns the largest");
  m.def("attention_partition_tokens", &pk::auto_partition_tokens, py::arg("total_context_tokens"),
        py::arg("num_kv_heads"), py::arg("threads"),
        "the context tokens per work item that partition_tokens=0 picks");
  m.def("rms_norm", &rms_norm, py::arg("dtype"), py::arg("x"), py::arg("x_stride"), py::arg("rows"),
        py::arg("hidden"), py::arg("weight"), py::arg("eps"), py::arg("out"), py::arg("out_stride"),
        py::arg("residual") = 0, py::arg("residual_stride") = 0,
        "out = weight * x * rsqrt(mean(x^2) + eps), row by row; with a residual (address, 0 for "
        "none) x + residual first, stored back into the residual");
  m.def("silu_mul", &silu_mul, py::arg("dtype"), py::arg("input"), py::arg("input_stride"),
        py::arg("rows"), py::arg("width"), py::arg("out"), py::arg("out_stride"),
        "out = silu(input[:, :width]) * input[:, width:]");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, py::arg("dtype"), py::arg("input"),
        py::arg("input_stride"), py::arg("rows"), py::arg("width"), py::arg("out"),
        py::arg("out_stride"),
        "out = gelu_tanh(input[:, :width]) * input[:, width:], gelu_tanh as "
        "torch.nn.functional.gelu(approximate='tanh')");
  m.def("clamped_swiglu_mul", &clamped_swiglu_mul, py::arg("dtype"), py::arg("input"),
        py::arg("input_stride"), py::arg("rows"), py::arg("width"), py::arg("out"),
        py::arg("out_stride"), py::arg("alpha"), py::arg("limit"),
        "gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit), out = "
        "(u + 1) * g * sigmoid(g * alpha), gate and up the two halves of each input row, as "
        "transformers' GptOssExperts computes it (bfloat16: every op rounded as torch's)");
  m.attr("GATED_ACTIVATIONS") = py::make_tuple("gelu_tanh", "clamped_swiglu");
  m.def("rope_write_kv", &rope_write_kv, py::arg("qkv"), py::arg("qkv_stride"), py::arg("rows"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("cos"),
        py::arg("sin"), py::arg("slots"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("cache_dtype"), py::arg("num_blocks"), py::arg("block_size"),
        py::arg("rotary_dim") = 0, py::arg("q_norm") = 0, py::arg("k_norm") = 0,
        py::arg("eps") = 1e-6f, py::arg("k_scale") = 0, py::arg("v_scale") = 0,
        "RoPE on the q and k heads of float32 qkv rows (q in place), k and v stored at the rows' "
        "cache slots (an int8 cache: each head quantized in groups of 32, their float16 scales "
        "written at k_scale / v_scale, laid out as paged_decode_attention's); rotary_dim > 0 "
        "rotates each head's "
        "first rotary_dim dims only (cos and sin "
        "[rows, rotary_dim]); q_norm / k_norm (addresses of float32 [head_dim] weights, 0 for "
        "none) RMS-normalize each q / k head with eps first");
  m.attr("ROPE_FEATURES") = py::make_tuple("qk_norm", "partial", "int8_q8_0");
  m.def("moe_group", &moe_group, py::arg("experts"), py::arg("weights"), py::arg("tokens"),
        py::arg("top_k"), py::arg("num_experts"), py::arg("row_token"), py::arg("row_weight"),
        py::arg("counts"),
        "routing choices (int64 / float32 [tokens, top_k]) grouped by expert, stably: each "
        "row's token and weight, each expert's row count");
  m.def("moe_route", &moe_route, py::arg("x"), py::arg("x_stride"), py::arg("tokens"),
        py::arg("hidden"), py::arg("router"), py::arg("num_experts"), py::arg("top_k"),
        py::arg("normalize"), py::arg("weights"), py::arg("experts"), py::arg("shared_gate") = 0,
        py::arg("shared_weight") = 0, py::arg("bias") = 0, py::arg("softmax_after_top_k") = false,
        "a mixture's router in float32: softmax(x · routerᵀ [+ bias]) over every expert, the "
        "top_k in torch.topk's order (float32 weights, int64 expert ids [tokens, top_k]; "
        "normalize: rescaled to sum to 1); shared_gate (0: none): shared_weight[t] = sigmoid(x_t "
        "· gate); bias: float32 [num_experts] (0: none); softmax_after_top_k: the top_k logits "
        "first, then a softmax over those k (normalize unused)");
  m.def("moe_combine", &moe_combine, py::arg("y"), py::arg("y_stride"), py::arg("row_token"),
        py::arg("row_weight"), py::arg("rows"), py::arg("hidden"), py::arg("out"),
        py::arg("out_stride"), py::arg("tokens"),
        "out[token] = the sum of its grouped rows' weight · y, in row order (float32)");
  py::class_<ExpertSet>(m, "ExpertSet",
                        "one projection of every expert of a mixture, for grouped matmuls")
      .def(py::init<>())
      .def("add", &ExpertSet::add, py::arg("weights"), py::arg("scales"), py::arg("n"),
           py::arg("k"), py::arg("bits"), py::arg("group"), py::arg("super_scales"),
           py::arg("mxfp4") = false,
           "the next expert's packed weights (their memory must outlive the set)")
      .def("__len__", &ExpertSet::size)
      .def("matmul", &ExpertSet::matmul, py::arg("x"), py::arg("x_stride"),
           py::arg("activation_bits"), py::arg("counts"), py::arg("out"), py::arg("out_stride"),
           "rows grouped by expert (counts: int64 [experts]) times their expert's weights, "
           "each row as matmul computes it");
  py::class_<pk::StackMoE>(m, "StackMoE", "a decoder stack layer's mixture of experts")
      .def(py::init(&make_stack_moe), py::arg("router"), py::arg("num_experts"), py::arg("top_k"),
           py::arg("normalize"), py::arg("gate_up"), py::arg("down"), py::arg("activation_bits"),
           py::arg("shared_gate") = 0, py::arg("shared_gate_up") = py::none(),
           py::arg("shared_down") = py::none(), py::arg("router_bias") = 0,
           py::arg("softmax_after_top_k") = false, py::arg("gate_up_bias") = 0,
           py::arg("down_bias") = 0,
           "router: float32 [num_experts, hidden]; gate_up, down: the experts' ExpertSets (their "
           "weights must outlive the stack); shared_gate (float32 [hidden], 0: none) with "
           "shared_gate_up and shared_down, linears as add_layer takes them; router_bias "
           "(float32 [num_experts]) and softmax_after_top_k as moe_route takes them; "
           "gate_up_bias, down_bias (float32 [num_experts, 2 * width] and [num_experts, hidden], "
           "0: none): each grouped row's expert's, added after its matmul");
  py::class_<pk::DecoderStack>(m, "DecoderStack",
                               "a decoder-only model's layers run back to back in C++")
      .def(py::init(&make_stack), py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("cache_dtype"),
           py::arg("num_blocks"), py::arg("block_size"), py::arg("activation") = "silu",
           py::arg("softcap") = 0.0f, py::arg("rotary_dims") = py::tuple(),
           py::arg("swiglu_alpha") = 0.0f, py::arg("swiglu_limit") = 0.0f,
           "eps: every norm's; activation: silu, gelu_tanh or clamped_swiglu (with swiglu_alpha "
           "and swiglu_limit); softcap > 0: attention scores -> softcap * tanh(score / softcap); "
           "rotary_dims: each rope table's rotated dims (even, <= head_dim), empty: one table of "
           "head_dim")
      .def("add_layer", &stack_add_layer, py::arg("input_norm"), py::arg("post_attention_norm"),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("q_norm") = 0, py::arg("k_norm") = 0,
           py::arg("attn_out_norm") = 0, py::arg("mlp_out_norm") = 0, py::arg("rope_table") = 0,
           py::arg("window") = 0, py::arg("full_width_qk_norm") = false,
           py::arg("moe") = py::none(), py::arg("sinks") = 0, py::arg("k_scale") = 0,
           py::arg("v_scale") = 0,
           "norm weights and cache addresses; each linear a tuple (weights, scales, n, k, bits, "
           "group, bias, activation_bits[, super_scales[, mxfp4]]), or a list of such tuples: a "
           "fused projection's row "
           "segments at their own precisions, in order; q_norm and k_norm (both or neither, 0 for "
           "none): "
           "float32 [head_dim] per-head norms before RoPE; attn_out_norm, mlp_out_norm (0 for "
           "none): float32 [hidden] norms of the o and down projections' outputs; rope_table: "
           "the index of the forward's cos/sin this layer rotates with; window > 0: attends to "
           "the last `window` positions; full_width_qk_norm: q_norm and k_norm (float32 "
           "[num_heads * head_dim], [num_kv_heads * head_dim]) normalize all heads at once; moe: "
           "a StackMoE in place of gate_up and down (None then); sinks: float32 [num_heads], each "
           "head's sink logit in both attention calls (0: none)")
      .def_property_readonly("num_layers", &pk::DecoderStack::num_layers)
      .def_property_readonly("num_rope_tables", &pk::DecoderStack::num_rope_tables)
      .def("forward", &stack_forward, py::arg("rows"), py::arg("hidden"), py::arg("residual"),
           py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("spans"), py::arg("num_spans"),
           py::arg("span_tables"), py::arg("span_table_stride"), py::arg("num_decodes"),
           py::arg("decode_rows"), py::arg("decode_tables"), py::arg("decode_table_stride"),
           py::arg("context_lens"), py::arg("scale"), py::arg("decode_positions") = 0,
           "every layer over one batch: hidden (the embeddings) becomes the last MLP output, "
           "residual the stream it adds to; cos and sin: sequences of addresses, one per rope "
           "table (float32 [rows, rotary_dim]); int64 metadata, float32 rows");
  m.def("repack_ggml", &repack_ggml, py::arg("type"), py::arg("blocks"), py::arg("row_bytes"),
        py::arg("rows"), py::arg("k"), py::arg("bits"), py::arg("data"), py::arg("scales"),
        py::arg("super_scales") = false,
        "GGML blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/MXFP4) straight into the matmul's "
        "tiles; super_scales (Q4_K into 4 bits): its scales in super-block form, every weight "
        "exact; MXFP4 into 4 bits: its codes and exponents as they are (qgemm.h)");
  py::dict packed_types;  // name -> the largest u its groups hold (15 fits 4-bit tiles)
  for (const char* name :
       {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}) {
    packed_types[name] = pk::ggml_type_largest_u(pk::ggml_type_named(name));
  }
  m.attr("GGML_PACKED_TYPES") = packed_types;
  m.def("isa", &pk::current_isa, "the instruction set in use");
  m.def("set_isa", &pk::set_isa, py::arg("name"), "avx512_vnni, avx2 or scalar");
  m.def("supported_isas", &supported_isas, "the instruction sets this CPU can run, best first");
  m.def("amx", &pk::amx_enabled, "whether int8 activations on many rows run on AMX tiles");
  m.def("set_amx", &pk::set_amx, py::arg("on"), "AMX on (ValueError where it cannot run) or off");
  m.def("amx_status", &pk::amx_status, "why AMX cannot run here; empty where it can");
  m.def("num_threads", [] { return pk::ThreadPool::instance().size(); }, "threads a matmul uses");
  m.def("set_num_threads", [](int n) { pk::ThreadPool::instance().resize(n); }, py::arg("n"));
  m.def(
      "spin_us", [] { return pk::ThreadPool::instance().spin_us(); },
      "how long idle workers poll for the next matmul before they sleep");
  m.def(
      "set_spin_us", [](int us) { pk::ThreadPool::instance().set_spin_us(us < 0 ? 0 : us); },
      py::arg("us"));
}
