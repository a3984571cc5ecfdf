// A step through a stack of decoder layers in one call, each layer run as its program describes it.
//
// The Python layers run ~25 Python-level operations per layer around their kernels (module calls,
// views, splits, dispatch checks): on the default model's 30 layers that was 4-5 ms of a 37 ms
// bfloat16 decode step, and as much of a short prompt's step. This loop calls the same kernels
// with the same arguments in the same order, so its results are bit for bit the Python layers'
// (models/layer_program.py reads each layer's program off the built model and says which ops have
// no kernel here; tests compare the two paths).
//
// Per layer, kLayerCodes codes in `layer_codes`: block wiring, norm kind, q/k norm, q/k norm kind,
// rope table (-1: no rope), MLP kind, activation, sliding window (0: none), then for a mixture of
// experts its number of experts, the experts per token, the routing and the shared expert's
// intermediate size (0: none; all four 0 for an MLP); kLayerScalars in `layer_scalars`: the residual
// multiplier (0: none), the attention soft cap (0: none) and a clamped SwiGLU's limit and alpha;
// kLayerTensors tensors in `layer_tensors`: the weight and bias of the input, post-attention,
// pre-feedforward and post-feedforward norms, of the q norm and of the k norm (an empty tensor: not
// there), then k_cache, v_cache, the key offset a quantized cache subtracts (empty: none) and the
// attention's float32 sink logits, one per query head (empty: none).
// Per layer, 4 linear layers in order (qkv, o, up, down: a gated MLP's gate_up and down, a plain
// one's fc and proj), each described in `linear_specs` as its number of row segments, then per
// segment (kind, format, rows); each segment takes 2 tensors of `linear_tensors`, its weight and its
// bias (an empty tensor: no bias). A layer's output is its segments' outputs side by side. A gate/up
// layer that is one gated panel segment applies act(gate) * up in its epilogue; otherwise the
// activation runs after it. A mixture of experts has, after qkv and o, its router, then (when it has
// one) the shared expert's gate, gate/up and down, then each expert's gate/up and down: the experts
// run here as SparseMoE.forward runs them, each chosen expert once over all its tokens of the step,
// so that a decode step's experts cost no Python call. `ropes` holds (cos, sin) per rope table.
// Attention follows the step's plan (PagedAttention.cpu_plan), the same for every layer: parts of
// the batch, each rows [begin, end) through one kernel (0 decode, 1 chunked, 2 AMX prompt) with its
// own block_tables, query_start_loc and context_lens (3 tensors per part in `part_tensors`).
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kLayerCodes = 12;
constexpr int64_t kLayerScalars = 4;
constexpr int64_t kLayerTensors = 16;
constexpr int64_t kPartTensors = 3;
using namespace stack_codes;

c10::optional<at::Tensor> bias_or_none(const at::Tensor& t) {
  if (t.numel() == 0) return c10::nullopt;
  return t;
}

struct Part {
  int64_t kernel, begin, end;
  const at::Tensor* tensors;  // block_tables, query_start_loc, context_lens
};

struct Segment {
  int64_t kind, format, rows;
  const at::Tensor* tensors;  // weight, bias
};

struct Linear {
  std::vector<Segment> segments;
  int64_t in_features;
  bool gated() const { return segments.size() == 1 && segments[0].kind == kGatedPanel; }
};

// Row counts at which the quantized kernels change method (quant_linear's small_m, int8_linear's
// amx_min_rows; small_m < 0 and amx_min_rows 0: one method at every row count).
struct RowThresholds {
  int64_t small_m, int8_amx;
};

at::Tensor segment_product(const Segment& s, const at::Tensor& x, int64_t k, const RowThresholds& rows) {
  const at::Tensor& weight = s.tensors[0];
  auto bias = bias_or_none(s.tensors[1]);
  switch (s.kind) {
    case kPanel: return dense_linear(x, weight, bias, s.rows, k, false);
    case kGatedPanel: return dense_linear(x, weight, bias, s.rows, k, true);
    case kFloatRows: return at::linear(x, weight.to(x.scalar_type()), bias);
    default: break;
  }
  // The quantized kernels take and give float32 activations.
  const bool is_float = x.scalar_type() == at::kFloat;
  auto x32 = is_float ? x : x.to(at::kFloat);
  auto y = s.kind == kInt8Tiled ? int8_linear(x32, weight, s.format, s.rows, k, bias, rows.int8_amx)
                                : quant_linear(x32, weight, s.format, k, bias, rows.small_m);
  return is_float ? y : y.to(x.scalar_type());
}

at::Tensor project(const Linear& linear, const at::Tensor& x, const RowThresholds& rows) {
  if (linear.segments.size() == 1) return segment_product(linear.segments[0], x, linear.in_features, rows);
  std::vector<at::Tensor> outputs;
  for (const Segment& s : linear.segments) outputs.push_back(segment_product(s, x, linear.in_features, rows));
  return at::cat(outputs, -1);
}

// GPT-OSS's expert activation over [T, 2I] (gate, then up), as ClampedSwiGLU.forward computes it:
// the gate clamped from above, the up projection on both sides, (up + 1) * gate * sigmoid(alpha * gate).
at::Tensor clamped_swiglu(const at::Tensor& x, double limit, double alpha) {
  const int64_t half = x.size(-1) / 2;
  auto gate = at::clamp(x.narrow(-1, 0, half), c10::nullopt, limit);
  auto up = at::clamp(x.narrow(-1, half, half), -limit, limit);
  return at::add(up, 1) * (gate * at::sigmoid(at::mul(gate, alpha)));
}

// The activation of a gated MLP and its clamped SwiGLU's limit and alpha.
struct GatedActivation {
  int64_t code;
  double limit, alpha;
};

at::Tensor activate_and_mul(const GatedActivation& act, const at::Tensor& gate_up) {
  switch (act.code) {
    case kGelu: return gelu_and_mul(gate_up);
    case kGeluTanh: return gelu_tanh_and_mul(gate_up);
    case kClampedSwiglu: return clamped_swiglu(gate_up, act.limit, act.alpha);
    default: return silu_and_mul(gate_up);
  }
}

// A plain MLP's activation, as torch computes it (F.gelu, F.silu, F.relu).
at::Tensor activate(int64_t activation, const at::Tensor& x) {
  switch (activation) {
    case kGelu: return at::gelu(x, "none");
    case kGeluTanh: return at::gelu(x, "tanh");
    case kRelu: return at::relu(x);
    default: return at::silu(x);
  }
}

struct Norm {
  int64_t kind;
  const at::Tensor* tensors;  // weight, bias (empty: none)
};

// norm(x), as the Python norm modules compute it (layers/norms_and_activations.py).
at::Tensor apply_norm(const Norm& n, const at::Tensor& x, double eps) {
  if (n.kind == kLayerNorm) return at::layer_norm(x, {x.size(-1)}, n.tensors[0], bias_or_none(n.tensors[1]), eps, true);
  return rms_norm(x, n.tensors[0], eps, n.kind == kGemmaRms);
}

// norm(x, residual): residual += x, then x = norm(residual); fused in one kernel for the RMS norms,
// an add and a LayerNorm otherwise (as LayerNorm.forward does). Returns the new x.
at::Tensor add_norm(const Norm& n, const at::Tensor& x, at::Tensor& residual, double eps) {
  if (n.kind == kLayerNorm) {
    residual = x + residual;
    return apply_norm(n, residual, eps);
  }
  fused_add_rms_norm(x, residual, n.tensors[0], eps, n.kind == kGemmaRms);
  return x;
}

// HeadLayerNorm: a bias-free LayerNorm over each head of [T, heads, head_dim] in float32, times a
// weight per head.
at::Tensor head_layer_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto out = at::layer_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, c10::nullopt, eps, true) *
             weight.to(at::kFloat);
  return out.to(x.scalar_type());
}

// down(act(gate(x)) * up(x)) (GatedMLP.forward), the activation in a gated panel's epilogue where
// the gate/up weight is one.
at::Tensor gated_mlp(const Linear& gate_up, const Linear& down, const at::Tensor& x, const GatedActivation& act,
                     const RowThresholds& rows) {
  auto h = project(gate_up, x, rows);
  if (!gate_up.gated()) h = activate_and_mul(act, h);
  return project(down, h, rows);
}

// A layer's mixture of experts: its sizes and routing (codes 8-11 of the layer).
struct Moe {
  int64_t experts, top_k, routing, shared_size;
  // Its linear layers after qkv and o: the router, the shared expert's gate, gate/up and down, then
  // each expert's gate/up and down.
  int64_t first_expert() const { return shared_size > 0 ? 6 : 3; }
};

// SparseMoE.forward over x [T, H] (`linear`: the layer's linear layers from qkv on): the router's
// choices, then each chosen expert once over all its tokens of the step, in expert order and each
// expert's tokens in order, its outputs weighted and added into the tokens' rows; then the shared
// expert scaled by the sigmoid of its gate. The same tensor operations in the same order as the
// Python module, so the same bits.
at::Tensor mixture_of_experts(const Linear* linear, const Moe& moe, const at::Tensor& x, const GatedActivation& act,
                              const RowThresholds& rows) {
  auto logits = project(linear[2], x, rows).to(at::kFloat);
  at::Tensor weights, chosen;
  if (moe.routing == kTopkSoftmax) {
    auto top = at::topk(logits, moe.top_k, -1);
    weights = at::softmax(std::get<0>(top), -1);
    chosen = std::get<1>(top);
  } else {
    auto top = at::topk(at::softmax(logits, -1), moe.top_k, -1);
    weights = std::get<0>(top);
    chosen = std::get<1>(top);
    if (moe.routing == kSoftmaxTopkNormalized) weights.div_(weights.sum(-1, true));
  }
  chosen = chosen.contiguous();
  weights = weights.contiguous();
  const int64_t* expert_of = chosen.data_ptr<int64_t>();
  const float* weight_of = weights.data_ptr<float>();
  std::vector<std::vector<int64_t>> tokens(moe.experts);
  std::vector<std::vector<float>> token_weights(moe.experts);
  for (int64_t i = 0; i < chosen.numel(); ++i) {
    tokens[expert_of[i]].push_back(i / moe.top_k);
    token_weights[expert_of[i]].push_back(weight_of[i]);
  }
  auto out = at::zeros_like(x);
  const Linear* experts = linear + moe.first_expert();
  for (int64_t e = 0; e < moe.experts; ++e) {
    const int64_t count = static_cast<int64_t>(tokens[e].size());
    if (count == 0) continue;
    auto index = at::from_blob(tokens[e].data(), {count}, at::kLong);
    auto scale = at::from_blob(token_weights[e].data(), {count, 1}, at::kFloat);
    auto y = gated_mlp(experts[2 * e], experts[2 * e + 1], x.index_select(0, index), act, rows) * scale;
    out.index_add_(0, index, y.to(out.scalar_type()));
  }
  if (moe.shared_size > 0) {
    out.add_(at::sigmoid(project(linear[3], x, rows)) * gated_mlp(linear[4], linear[5], x, act, rows));
  }
  return out;
}

// The linear layers of `specs` / `tensors`, checked against the shapes they must have.
std::vector<Linear> read_linears(const std::vector<int64_t>& specs, const std::vector<at::Tensor>& tensors,
                                 const std::vector<int64_t>& in_features, const std::vector<int64_t>& out_features) {
  std::vector<Linear> linears;
  size_t at = 0, tensor_at = 0;
  for (size_t i = 0; i < in_features.size(); ++i) {
    TORCH_CHECK(at < specs.size(), "linear_specs ends before linear layer ", i);
    const int64_t count = specs[at++];
    TORCH_CHECK(count >= 1 && at + 3 * count <= specs.size() && tensor_at + 2 * count <= tensors.size(),
                "linear layer ", i, ": ", count, " segments do not fit linear_specs / linear_tensors");
    Linear linear{{}, in_features[i]};
    int64_t rows = 0;
    for (int64_t s = 0; s < count; ++s) {
      const Segment segment{specs[at], specs[at + 1], specs[at + 2], tensors.data() + tensor_at};
      TORCH_CHECK(segment.kind >= kPanel && segment.kind <= kFloatRows, "linear layer ", i, ": unknown kind ",
                  segment.kind);
      linear.segments.push_back(segment);
      rows += segment.rows;
      at += 3;
      tensor_at += 2;
    }
    TORCH_CHECK(rows == out_features[i], "linear layer ", i, " has ", rows, " output rows, expected ", out_features[i]);
    linears.push_back(std::move(linear));
  }
  TORCH_CHECK(at == specs.size() && tensor_at == tensors.size(), "linear_specs / linear_tensors longer than ",
              in_features.size(), " linear layers");
  return linears;
}

at::Tensor attend(const Part& part, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, double scale, int64_t window, double soft_cap,
                     const at::Tensor& sinks) {
  const at::Tensor* t = part.tensors;
  switch (part.kernel) {
    case kDecode: return paged_decode_attention(query, k_cache, v_cache, t[0], t[2], scale, window, soft_cap, sinks);
    case kAmx: return prompt_attention_amx(query, k_cache, v_cache, t[0], t[1], t[2], scale, sinks);
    default:
      return paged_chunked_attention(query, k_cache, v_cache, t[0], t[1], t[2], scale, window, soft_cap, sinks);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> run_layer_stack(
    at::Tensor hidden, std::vector<at::Tensor> layer_tensors, std::vector<int64_t> layer_codes,
    std::vector<double> layer_scalars, std::vector<int64_t> linear_specs, std::vector<at::Tensor> linear_tensors,
    std::vector<at::Tensor> ropes, at::Tensor slot_mapping, std::vector<int64_t> part_kernels,
    std::vector<int64_t> part_rows, std::vector<at::Tensor> part_tensors, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate_size, int64_t small_m, int64_t int8_amx_min_rows, double eps,
    double scale) {
  const RowThresholds thresholds{small_m, int8_amx_min_rows};
  const int64_t num_layers = static_cast<int64_t>(layer_codes.size()) / kLayerCodes;
  const int64_t num_parts = static_cast<int64_t>(part_kernels.size());
  const int64_t num_ropes = static_cast<int64_t>(ropes.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(layer_codes.size()) == num_layers * kLayerCodes &&
                  static_cast<int64_t>(layer_scalars.size()) == num_layers * kLayerScalars &&
                  static_cast<int64_t>(layer_tensors.size()) == num_layers * kLayerTensors,
              "expected ", kLayerCodes, " codes, ", kLayerScalars, " scalars and ", kLayerTensors,
              " tensors per layer, got ", layer_codes.size(), ", ", layer_scalars.size(), " and ", layer_tensors.size());
  TORCH_CHECK(ropes.size() % 2 == 0, "ropes holds (cos, sin) pairs");
  TORCH_CHECK(num_parts >= 1 && static_cast<int64_t>(part_rows.size()) == 2 * num_parts &&
                  static_cast<int64_t>(part_tensors.size()) == kPartTensors * num_parts,
              "each attention part needs a kernel, its rows [begin, end) and ", kPartTensors, " tensors");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [tokens, hidden_size], got ", hidden.sizes());
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  std::vector<int64_t> in_features, out_features, first_linear;
  for (int64_t i = 0; i < num_layers; ++i) {
    const int64_t* c = layer_codes.data() + i * kLayerCodes;
    TORCH_CHECK(c[0] >= kPreNorm && c[0] <= kParallelShared, "layer ", i, ": unknown block wiring ", c[0]);
    TORCH_CHECK(c[2] >= kNoQkNorm && c[2] <= kQkHeads, "layer ", i, ": unknown q/k norm ", c[2]);
    TORCH_CHECK(c[4] >= -1 && c[4] < num_ropes, "layer ", i, ": rope table ", c[4], " of ", num_ropes);
    TORCH_CHECK(c[5] >= kGatedMlp && c[5] <= kMoe, "layer ", i, ": unknown MLP kind ", c[5]);
    first_linear.push_back(static_cast<int64_t>(in_features.size()));
    in_features.insert(in_features.end(), {hidden_size, q_size});
    out_features.insert(out_features.end(), {q_size + 2 * kv_size, hidden_size});
    if (c[5] != kMoe) {
      const int64_t up = c[5] == kGatedMlp ? 2 * intermediate_size : intermediate_size;
      in_features.insert(in_features.end(), {hidden_size, intermediate_size});
      out_features.insert(out_features.end(), {up, hidden_size});
      continue;
    }
    const Moe moe{c[8], c[9], c[10], c[11]};
    TORCH_CHECK(moe.experts >= 1 && moe.top_k >= 1 && moe.top_k <= moe.experts && moe.shared_size >= 0 &&
                    moe.routing >= kTopkSoftmax && moe.routing <= kSoftmaxTopkNormalized,
                "layer ", i, ": a mixture of ", moe.experts, " experts, ", moe.top_k, " per token, routing ",
                moe.routing, ", shared size ", moe.shared_size);
    in_features.push_back(hidden_size);  // the router
    out_features.push_back(moe.experts);
    if (moe.shared_size > 0) {  // its gate, gate/up and down
      in_features.insert(in_features.end(), {hidden_size, hidden_size, moe.shared_size});
      out_features.insert(out_features.end(), {1, 2 * moe.shared_size, hidden_size});
    }
    for (int64_t e = 0; e < moe.experts; ++e) {
      in_features.insert(in_features.end(), {hidden_size, intermediate_size});
      out_features.insert(out_features.end(), {2 * intermediate_size, hidden_size});
    }
  }
  const std::vector<Linear> linears = read_linears(linear_specs, linear_tensors, in_features, out_features);
  std::vector<Part> parts;
  for (int64_t p = 0; p < num_parts; ++p) {
    const int64_t begin = part_rows[2 * p], end = part_rows[2 * p + 1];
    TORCH_CHECK(0 <= begin && begin <= end && end <= tokens, "attention part rows [", begin, ", ", end,
                ") outside the step's ", tokens, " tokens");
    parts.push_back({part_kernels[p], begin, end, part_tensors.data() + kPartTensors * p});
  }
  const bool whole = num_parts == 1 && parts[0].begin == 0 && parts[0].end == tokens;
  at::Tensor residual;
  for (int64_t i = 0; i < num_layers; ++i) {
    const int64_t* c = layer_codes.data() + i * kLayerCodes;
    const int64_t block = c[0], norm_kind = c[1], qk_norm = c[2], qk_kind = c[3], rope = c[4], mlp = c[5];
    const int64_t activation = c[6], window = c[7];
    const Moe moe{c[8], c[9], c[10], c[11]};
    const double* scalars = layer_scalars.data() + i * kLayerScalars;
    const double residual_scale = scalars[0], soft_cap = scalars[1];
    const GatedActivation gated_activation{activation, scalars[2], scalars[3]};
    const at::Tensor* t = layer_tensors.data() + i * kLayerTensors;
    const Norm input_norm{norm_kind, t}, post_attn_norm{norm_kind, t + 2}, pre_ff_norm{norm_kind, t + 4},
        post_ff_norm{norm_kind, t + 6}, q_norm{qk_kind, t + 8}, k_norm{qk_kind, t + 10};
    const at::Tensor &k_cache = t[12], &v_cache = t[13], &sinks = t[15];
    const Linear* linear = linears.data() + first_linear[i];  // qkv, o, then the MLP's (see Moe)

    // Attention over `x` (DecoderAttention.forward): qkv, q/k norms, rope, cache write, attention, o.
    auto attention = [&](const at::Tensor& x) {
      auto qkv = project(linear[0], x, thresholds);
      at::Tensor query, key;
      if (qk_norm == kNoQkNorm) {
        // q and k rotated in one go: they are adjacent in the fused output.
        if (rope >= 0)
          rotary_embedding_inplace(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim}),
                                   ropes[2 * rope], ropes[2 * rope + 1]);
        query = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
        key = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
      } else {
        query = qkv.narrow(1, 0, q_size);
        key = qkv.narrow(1, q_size, kv_size);
        if (qk_norm == kQkProjection) {
          query = apply_norm(q_norm, query, eps);
          key = apply_norm(k_norm, key, eps);
        }
        query = query.reshape({tokens, num_heads, head_dim});
        key = key.reshape({tokens, num_kv_heads, head_dim});
        if (qk_norm == kQkHead) {
          query = apply_norm(q_norm, query, eps);
          key = apply_norm(k_norm, key, eps);
        } else if (qk_norm == kQkHeads) {
          query = head_layer_norm(query, q_norm.tensors[0], eps);
          key = head_layer_norm(key, k_norm.tensors[0], eps);
        }
        if (rope >= 0) {
          rotary_embedding_inplace(query, ropes[2 * rope], ropes[2 * rope + 1]);
          rotary_embedding_inplace(key, ropes[2 * rope], ropes[2 * rope + 1]);
        }
      }
      auto value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
      write_kv_cache(key, value, k_cache, v_cache, slot_mapping,
                     t[14].numel() ? c10::optional<at::Tensor>(t[14]) : c10::nullopt);
      at::Tensor attended;
      if (whole) {
        attended = attend(parts[0], query, k_cache, v_cache, scale, window, soft_cap, sinks);
      } else {
        attended = at::empty({tokens, num_heads, head_dim}, query.options());
        for (const Part& part : parts) {
          attended.narrow(0, part.begin, part.end - part.begin)
              .copy_(attend(part, query.narrow(0, part.begin, part.end - part.begin), k_cache, v_cache, scale,
                            window, soft_cap, sinks));
        }
      }
      return project(linear[1], attended.reshape({tokens, q_size}), thresholds);
    };
    // The feed-forward block over `x` (GatedMLP / PlainMLP / SparseMoE.forward).
    auto feed_forward = [&](const at::Tensor& x) {
      if (mlp == kMoe) return mixture_of_experts(linear, moe, x, gated_activation, thresholds);
      if (mlp == kGatedMlp) return gated_mlp(linear[2], linear[3], x, gated_activation, thresholds);
      return project(linear[3], activate(activation, project(linear[2], x, thresholds)), thresholds);
    };

    // The wiring of DecoderLayer.forward.
    if (block == kPostNorm) {  // x + norm(attn(x)), then x + norm(mlp(x)); no residual carried
      hidden = hidden + apply_norm(post_attn_norm, attention(hidden), eps);
      hidden = hidden + apply_norm(post_ff_norm, feed_forward(hidden), eps);
      continue;
    }
    if (block == kParallel || block == kParallelShared) {  // x + attn(ln(x)) + mlp(ln(x) or ln2(x))
      auto normed = apply_norm(input_norm, hidden, eps);
      auto h = attention(normed);
      auto out = feed_forward(block == kParallelShared ? normed : apply_norm(post_attn_norm, hidden, eps));
      out.add_(h);
      out.add_(hidden);
      hidden = out;
      continue;
    }
    if (!residual.defined()) {
      residual = hidden;
      hidden = apply_norm(input_norm, hidden, eps);
    } else {
      hidden = add_norm(input_norm, hidden, residual, eps);
    }
    auto h = attention(hidden);
    if (block == kSandwich) {
      h = add_norm(pre_ff_norm, apply_norm(post_attn_norm, h, eps), residual, eps);
      hidden = apply_norm(post_ff_norm, feed_forward(h), eps);
      continue;
    }
    // Granite: residual + block(x) * scale. As Python's `h *= scale` computes it: the scale as a double
    // tensor (mul_.Tensor), not mul_.Scalar, which rounds it to the tensor's dtype first.
    at::Tensor scale_tensor;
    if (residual_scale != 0.0) {
      scale_tensor = at::scalar_tensor(residual_scale, at::TensorOptions().dtype(at::kDouble));
      h.mul_(scale_tensor);
    }
    h = add_norm(post_attn_norm, h, residual, eps);
    hidden = feed_forward(h);
    if (residual_scale != 0.0) hidden.mul_(scale_tensor);
  }
  return {hidden, residual};
}
