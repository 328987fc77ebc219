// DecoderStack::forward: DecoderLayer.forward's loop (pyserve/worker/models/decoder.py) over the
// C++ kernels, as the CPU kernels backend (pyserve/worker/backends/cpu/backend.py) calls them.
#include "decoder_stack.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "arg_checks.h"
#include "dispatch.h"
#include "layer_ops.h"
#include "moe.h"
#include "prefill_attention.h"

namespace pyserve_kernels {
namespace {

void check_linear(const StackLinear& linear, int n, int k, const char* name) {
  bool fits = linear.n() == n;
  auto check_segment = [&](const PackedWeights& w) {
    check(w.data != nullptr && w.scales != nullptr,
          [&] { return std::string(name) + ": no weights"; });
    fits = fits && w.n > 0 && w.k == k;
  };
  check_segment(linear.weights);
  for (const auto& segment : linear.more) check_segment(segment.weights);
  check(fits, [&] {
    std::string inputs = std::to_string(linear.weights.k);
    for (const auto& segment : linear.more) inputs += "/" + std::to_string(segment.weights.k);
    return std::string(name) + ": " + std::to_string(linear.n()) + "x" + inputs +
           " weights, expected " + std::to_string(n) + "x" + std::to_string(k);
  });
}

// The per-forward scratch of one calling thread (the worker's forward runs on one thread).
struct Buffers {
  std::vector<float> normed, qkv, attn, o, gate_up, act, q_decode, out_decode;
  // a mixture's: the route, the rows grouped by expert and their projections, the shared gate
  std::vector<float> route_weights, row_weights, grouped, grouped_gate_up, grouped_act, grouped_out,
      shared_weights;
  std::vector<int64_t> route_experts, row_tokens, counts;
};

// `size(v, rows, width)`: v holding at least rows × width elements, its data
template <class T>
T* sized(std::vector<T>& v, int64_t rows, int64_t width) {
  if (static_cast<int64_t>(v.size()) < rows * width) v.resize(static_cast<size_t>(rows * width));
  return v.data();
}

void matmul(const StackLinear& linear, const float* x, int rows, float* out) {
  const PackedWeights& w = linear.weights;
  const int n = linear.n();
  quantized_matmul(x, w.k, rows, linear.activation_bits, w, linear.bias, out, n);
  int done = w.n;
  for (const auto& segment : linear.more) {
    quantized_matmul(x, w.k, rows, linear.activation_bits, segment.weights, segment.bias,
                     out + done, n);
    done += segment.weights.n;
  }
}

void rms_norm_rows(const float* x, int rows, int hidden, const float* weight, float eps,
                   float* residual, float* out) {
  RmsNormArgs args{DType::kFloat32, x, hidden, rows, hidden, weight, eps, out, hidden};
  args.residual = residual;
  args.residual_stride = residual != nullptr ? hidden : 0;
  rms_norm(args);
}

// RMSNorm of `width` columns of rows `stride` apart, in place (the norm reads a row before it
// writes it)
void rms_norm_columns(float* x, int64_t stride, int rows, int width, const float* weight,
                      float eps) {
  rms_norm({DType::kFloat32, x, stride, rows, width, weight, eps, x, stride});
}

void check_moe(const StackMoE& m, int hidden, const std::string& name) {
  check(m.num_experts > 0 && m.top_k >= 1 && m.top_k <= m.num_experts, [&] {
    return name + ": top-" + std::to_string(m.top_k) + " of " + std::to_string(m.num_experts) +
           " experts";
  });
  check(static_cast<int>(m.gate_up.size()) == m.num_experts &&
            static_cast<int>(m.down.size()) == m.num_experts,
        [&] {
          return name + ": " + std::to_string(m.gate_up.size()) + " gate/up and " +
                 std::to_string(m.down.size()) + " down experts for a router of " +
                 std::to_string(m.num_experts);
        });
  const int width = m.width();
  for (int e = 0; e < m.num_experts; ++e) {
    const PackedWeights& gate_up = m.gate_up[static_cast<size_t>(e)];
    const PackedWeights& down = m.down[static_cast<size_t>(e)];
    check(gate_up.data != nullptr && gate_up.scales != nullptr && down.data != nullptr &&
              down.scales != nullptr,
          [&] { return name + ": expert " + std::to_string(e) + " has no weights"; });
    check(width > 0 && gate_up.n == 2 * width && gate_up.k == hidden && down.n == hidden &&
              down.k == width,
          [&] {
            return name + ": expert " + std::to_string(e) + "'s weights are " +
                   std::to_string(gate_up.n) + "x" + std::to_string(gate_up.k) + " and " +
                   std::to_string(down.n) + "x" + std::to_string(down.k) + ", expected 2·" +
                   std::to_string(width) + "x" + std::to_string(hidden) + " and " +
                   std::to_string(hidden) + "x" + std::to_string(width);
          });
  }
  check(m.activation_bits == 8 || m.activation_bits == 16, name + ": activation bits 8 or 16");
  if (m.shared_gate != nullptr) {
    const int shared = m.shared_width();
    check(shared > 0, name + ": a shared gate without a shared expert");
    check_linear(m.shared_gate_up, 2 * shared, hidden, (name + " shared gate_up").c_str());
    check_linear(m.shared_down, hidden, shared, (name + " shared down").c_str());
  }
}

// The model's gated activation over rows of [gate | up] (2 · width apart) into out (width apart)
void activate(const StackShape& s, const float* gate_up, int rows, int width, float* out) {
  silu_mul({DType::kFloat32, gate_up, 2 * static_cast<int64_t>(width), rows, width, out, width,
            s.activation, s.swiglu_alpha, s.swiglu_limit});
}

// rows[r] += bias[e] for the rows of each expert e in turn (counts[e] of them): each grouped
// row's own expert's bias, one float32 add an element, as torch's add of the gathered biases
void add_expert_bias(float* rows, int width, const float* bias, const int64_t* counts,
                     int num_experts) {
  int64_t r = 0;
  for (int e = 0; e < num_experts; ++e) {
    const float* b = bias + static_cast<int64_t>(e) * width;
    for (int64_t end = r + counts[e]; r < end; ++r) {
      float* row = rows + r * width;
      for (int j = 0; j < width; ++j) row[j] += b[j];
    }
  }
}

// A mixture's output for the rows `x` ([rows][hidden]) into out: SparseMoE.forward as the CPU
// kernels backend computes it (Backend.route_experts, ExpertKernels.run, the shared expert's
// QuantLinears), the same calls on the same values
void run_moe(const StackMoE& m, const float* x, int rows, const StackShape& s, Buffers& buf,
             float* out) {
  const int hidden = s.hidden;
  const int k = m.top_k, width = m.width();
  const int64_t choices = static_cast<int64_t>(rows) * k;
  float* weights = sized(buf.route_weights, rows, k);
  int64_t* experts = sized(buf.route_experts, rows, k);
  float* shared = m.shared_gate != nullptr ? sized(buf.shared_weights, rows, 1) : nullptr;
  MoeRouteArgs route{x, hidden,      rows,    hidden, m.router, m.num_experts,
                     k, m.normalize, weights, experts};
  route.shared_gate = m.shared_gate;
  route.shared_weight = shared;
  route.bias = m.router_bias;
  route.softmax_after_top_k = m.softmax_after_top_k;
  moe_route(route);
  int64_t* row_tokens = sized(buf.row_tokens, choices, 1);
  float* row_weights = sized(buf.row_weights, choices, 1);
  int64_t* counts = sized(buf.counts, m.num_experts, 1);
  moe_group(experts, weights, rows, k, m.num_experts, row_tokens, row_weights, counts);
  float* grouped = sized(buf.grouped, choices, hidden);
  for (int64_t r = 0; r < choices; ++r)
    std::copy(x + row_tokens[r] * hidden, x + (row_tokens[r] + 1) * hidden, grouped + r * hidden);
  float* gate_up = sized(buf.grouped_gate_up, choices, 2 * width);
  grouped_matmul(grouped, hidden, m.activation_bits, m.gate_up.data(), counts, m.num_experts,
                 gate_up, 2 * width);
  if (m.gate_up_bias != nullptr)
    add_expert_bias(gate_up, 2 * width, m.gate_up_bias, counts, m.num_experts);
  float* act = sized(buf.grouped_act, choices, width);
  activate(s, gate_up, static_cast<int>(choices), width, act);
  float* y = sized(buf.grouped_out, choices, hidden);
  grouped_matmul(act, width, m.activation_bits, m.down.data(), counts, m.num_experts, y, hidden);
  if (m.down_bias != nullptr) add_expert_bias(y, hidden, m.down_bias, counts, m.num_experts);
  moe_combine(y, hidden, row_tokens, row_weights, static_cast<int>(choices), hidden, out, hidden,
              rows);
  if (m.shared_gate == nullptr) return;
  // out += shared_expert(x) · gate: the product rounded, then the sum, as torch's two ops
  const int shared_width = m.shared_width();
  float* shared_gate_up = sized(buf.grouped_gate_up, rows, 2 * shared_width);
  matmul(m.shared_gate_up, x, rows, shared_gate_up);
  float* shared_act = sized(buf.grouped_act, rows, shared_width);
  activate(s, shared_gate_up, rows, shared_width, shared_act);
  float* shared_out = sized(buf.grouped_out, rows, hidden);
  matmul(m.shared_down, shared_act, rows, shared_out);
  for (int t = 0; t < rows; ++t) {
    const float gate = shared[t];
    const float* from = shared_out + static_cast<int64_t>(t) * hidden;
    float* to = out + static_cast<int64_t>(t) * hidden;
    for (int i = 0; i < hidden; ++i) {
      volatile float product = from[i] * gate;  // volatile: never contracted into an FMA
      to[i] += product;
    }
  }
}

}  // namespace

DecoderStack::DecoderStack(const StackShape& shape) : shape_(shape) {
  check(shape.hidden > 0 && shape.intermediate > 0 && shape.head_dim > 0 &&
            shape.num_kv_heads > 0 && shape.num_heads % shape.num_kv_heads == 0,
        "bad model shape");
  check(shape.num_blocks > 0 && shape.block_size > 0, "bad cache shape");
  check(std::isfinite(shape.eps) && shape.eps >= 0.0f, "eps must be finite and >= 0");
  check(shape.activation == GatedActivation::kSilu ||
            shape.activation == GatedActivation::kGeluTanh ||
            shape.activation == GatedActivation::kClampedSwiglu,
        "unknown gated activation");
  check(shape.activation != GatedActivation::kClampedSwiglu ||
            (std::isfinite(shape.swiglu_alpha) && std::isfinite(shape.swiglu_limit) &&
             shape.swiglu_limit > 0.0f),
        "the clamped SwiGLU's alpha and limit must be finite, the limit > 0");
  check(std::isfinite(shape.softcap) && shape.softcap >= 0.0f,
        "softcap must be finite and >= 0 (0: none)");
  if (shape_.rotary_dims.empty()) shape_.rotary_dims.push_back(shape.head_dim);
  for (size_t t = 0; t < shape_.rotary_dims.size(); ++t) {
    const int dim = shape_.rotary_dims[t];
    check(dim >= 2 && dim % 2 == 0 && dim <= shape.head_dim, [&] {
      return "rope table " + std::to_string(t) + ": rotary_dim " + std::to_string(dim) +
             " must be even, in [2, head_dim " + std::to_string(shape.head_dim) + "]";
    });
  }
}

void DecoderStack::add_layer(const StackLayer& layer) {
  const StackShape& s = shape_;
  const int q_size = s.num_heads * s.head_dim;
  const int qkv_size = q_size + 2 * s.num_kv_heads * s.head_dim;
  check(layer.input_norm != nullptr && layer.post_attention_norm != nullptr, "no norm weights");
  check(layer.k_cache != nullptr && layer.v_cache != nullptr, "no cache");
  check((s.cache_dtype == DType::kInt8) == (layer.k_scale != nullptr && layer.v_scale != nullptr),
        "an int8 cache comes with its K and V scales, and only an int8 cache");
  check((layer.q_norm == nullptr) == (layer.k_norm == nullptr),
        "a q_norm without a k_norm, or a k_norm without a q_norm: both or neither");
  check(layer.rope_table >= 0 && layer.rope_table < num_rope_tables(), [&] {
    return "rope table " + std::to_string(layer.rope_table) + " of " +
           std::to_string(num_rope_tables()) + ": out of range";
  });
  check(layer.window >= 0, "window must be >= 0 (0: none)");
  check(!layer.full_width_qk_norm || layer.q_norm != nullptr,
        "a full-width q/k norm without its weights");
  check_linear(layer.qkv, qkv_size, s.hidden, "qkv");
  check_linear(layer.o, s.hidden, q_size, "o");
  if (layer.is_moe()) {
    check_moe(layer.moe, s.hidden, "moe");
  } else {
    check_linear(layer.gate_up, 2 * s.intermediate, s.hidden, "gate_up");
    check_linear(layer.down, s.hidden, s.intermediate, "down");
  }
  layers_.push_back(layer);
}

void DecoderStack::forward(const StackBatch& b) const {
  const StackShape& s = shape_;
  const int rows = b.rows, hidden = s.hidden, dim = s.head_dim;
  const int q_size = s.num_heads * dim;
  const int qkv_size = q_size + 2 * s.num_kv_heads * dim;
  check(rows > 0 && b.hidden != nullptr && b.residual != nullptr && b.cos != nullptr &&
            b.sin != nullptr && b.slots != nullptr,
        "empty batch or null address");
  check(b.num_rope_tables == num_rope_tables(), [&] {
    return std::to_string(b.num_rope_tables) + " rope tables, the stack has " +
           std::to_string(num_rope_tables());
  });
  for (int t = 0; t < b.num_rope_tables; ++t)
    check(b.cos[t] != nullptr && b.sin[t] != nullptr, "a rope table's null address");
  check(b.num_spans >= 0 && b.num_decodes >= 0 && b.num_decodes <= rows, "bad batch counts");
  for (int d = 0; d < b.num_decodes; ++d)
    check(b.decode_rows[d] >= 0 && b.decode_rows[d] < rows, "a decode row is outside the batch");
  // decodes that are the whole batch, in order, read q and write their output in place
  bool in_place = b.num_decodes == rows;
  for (int d = 0; in_place && d < rows; ++d) in_place = b.decode_rows[d] == d;

  thread_local Buffers buf;
  const auto size = [rows](std::vector<float>& v, int width) {
    v.resize(static_cast<size_t>(rows) * width);
    return v.data();
  };
  float* normed = size(buf.normed, hidden);
  float* qkv = size(buf.qkv, qkv_size);
  float* attn = size(buf.attn, q_size);
  float* o = size(buf.o, hidden);
  // the dense MLP's buffers only where a layer has one (a mixture's are its own)
  const bool dense = std::any_of(layers_.begin(), layers_.end(),
                                 [](const StackLayer& layer) { return !layer.is_moe(); });
  float* gate_up = dense ? size(buf.gate_up, 2 * s.intermediate) : nullptr;
  float* act = dense ? size(buf.act, s.intermediate) : nullptr;
  float* q_decode = nullptr;
  float* out_decode = nullptr;
  if (!in_place && b.num_decodes > 0) {
    buf.q_decode.resize(static_cast<size_t>(b.num_decodes) * q_size);
    buf.out_decode.resize(buf.q_decode.size());
    q_decode = buf.q_decode.data();
    out_decode = buf.out_decode.data();
  }

  // the attention calls' arguments but for the layer's caches; decodes read q from the qkv rows
  // in place when they are the whole batch, else from the gathered block
  // clang-format off
  PrefillAttentionArgs prefill{qkv, qkv_size, DType::kFloat32, rows, s.num_heads, nullptr, nullptr,
      s.cache_dtype, s.num_kv_heads, s.num_blocks, s.block_size, dim, b.spans, b.num_spans,
      b.span_tables, 8, b.span_table_stride, b.scale, attn, q_size, 0, s.softcap};
  DecodeAttentionArgs decode{in_place ? qkv : q_decode, in_place ? qkv_size : q_size,
      DType::kFloat32, b.num_decodes, s.num_heads, nullptr, nullptr, s.cache_dtype, s.num_kv_heads,
      s.num_blocks, s.block_size, dim, b.decode_tables, 8, b.decode_table_stride, b.context_lens, 8,
      b.scale, in_place ? attn : out_decode, q_size, 0, 0, s.softcap, nullptr, b.decode_positions};
  // and rope + KV write's but for the layer's table, norms and caches
  RopeKvArgs rope{qkv, qkv_size, rows, s.num_heads, s.num_kv_heads, dim, nullptr, nullptr, b.slots,
      nullptr, nullptr, s.cache_dtype, s.num_blocks, s.block_size};
  rope.norm_eps = s.eps;
  // clang-format on
  for (size_t l = 0; l < layers_.size(); ++l) {
    const StackLayer& layer = layers_[l];
    if (l == 0) {  // the embeddings start the residual stream
      std::copy(b.hidden, b.hidden + static_cast<size_t>(rows) * hidden, b.residual);
      rms_norm_rows(b.hidden, rows, hidden, layer.input_norm, s.eps, nullptr, normed);
    } else {  // residual += the previous MLP output, then the norm
      rms_norm_rows(b.hidden, rows, hidden, layer.input_norm, s.eps, b.residual, normed);
    }
    matmul(layer.qkv, normed, rows, qkv);
    if (layer.full_width_qk_norm) {  // q's heads normalized together, then k's
      rms_norm_columns(qkv, qkv_size, rows, q_size, layer.q_norm, s.eps);
      rms_norm_columns(qkv + q_size, qkv_size, rows, s.num_kv_heads * dim, layer.k_norm, s.eps);
    }
    const int rotary_dim = s.rotary_dims[layer.rope_table];
    rope.cos = b.cos[layer.rope_table];
    rope.sin = b.sin[layer.rope_table];
    rope.rotary_dim = rotary_dim == dim ? 0 : rotary_dim;
    rope.q_norm = layer.full_width_qk_norm ? nullptr : layer.q_norm;
    rope.k_norm = layer.full_width_qk_norm ? nullptr : layer.k_norm;
    rope.k_cache = layer.k_cache;
    rope.v_cache = layer.v_cache;
    rope.k_scale = layer.k_scale;
    rope.v_scale = layer.v_scale;
    rope_write_kv(rope);
    if (b.num_spans > 0) {
      prefill.k_cache = layer.k_cache;
      prefill.v_cache = layer.v_cache;
      prefill.k_scale = layer.k_scale;
      prefill.v_scale = layer.v_scale;
      prefill.window = layer.window;
      prefill.sinks = layer.sinks;
      paged_prefill_attention(prefill);
    }
    if (b.num_decodes > 0) {
      if (!in_place)  // gather the decode rows' q, scatter their output back below
        for (int d = 0; d < b.num_decodes; ++d)
          std::memcpy(q_decode + static_cast<size_t>(d) * q_size, qkv + b.decode_rows[d] * qkv_size,
                      sizeof(float) * q_size);
      decode.k_cache = layer.k_cache;
      decode.v_cache = layer.v_cache;
      decode.k_scale = layer.k_scale;
      decode.v_scale = layer.v_scale;
      decode.window = layer.window;
      decode.sinks = layer.sinks;
      paged_decode_attention(decode);
      if (!in_place)
        for (int d = 0; d < b.num_decodes; ++d)
          std::memcpy(attn + b.decode_rows[d] * q_size,
                      out_decode + static_cast<size_t>(d) * q_size, sizeof(float) * q_size);
    }
    matmul(layer.o, attn, rows, o);
    // residual += the attention's output (with a sandwich, normalized first), then the norm
    float* mlp_in = normed;
    if (layer.attn_out_norm != nullptr) {
      rms_norm_rows(o, rows, hidden, layer.attn_out_norm, s.eps, nullptr, normed);
      rms_norm_rows(normed, rows, hidden, layer.post_attention_norm, s.eps, b.residual, o);
      mlp_in = o;
    } else {
      rms_norm_rows(o, rows, hidden, layer.post_attention_norm, s.eps, b.residual, normed);
    }
    // the MLP's output into a free buffer where a norm follows (o, or normed where o is the
    // MLP's input: a mixture reads its input after it has written output), else into hidden
    float* mlp_out = layer.mlp_out_norm == nullptr ? b.hidden : mlp_in == o ? normed : o;
    if (layer.is_moe()) {
      run_moe(layer.moe, mlp_in, rows, s, buf, mlp_out);
    } else {
      matmul(layer.gate_up, mlp_in, rows, gate_up);
      activate(s, gate_up, rows, s.intermediate, act);
      matmul(layer.down, act, rows, mlp_out);
    }
    if (layer.mlp_out_norm != nullptr)
      rms_norm_rows(mlp_out, rows, hidden, layer.mlp_out_norm, s.eps, nullptr, b.hidden);
  }
}

}  // namespace pyserve_kernels
