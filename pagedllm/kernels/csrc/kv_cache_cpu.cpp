// This step's keys and values into their slots of the paged KV cache, both in one call.
//
// torch's index_copy_ does the same scatter, but as two dispatches per layer whose fixed cost
// (~6 us each here) is larger than the copy itself at decode sizes (a few hundred bytes per token).
// A token's heads are one contiguous run in the step's tensors (rows of the fused qkv output) and in
// the cache, so each token is two memcpy calls whatever the dtype.
//
// A quantized cache (kv_formats.h) takes each (token, KV head) row quantized with its scales
// instead (rotated, then quantized), the bytes kv_quant.quantize_rows would write; a key offset
// (float32 [kv_heads, head_dim], see attention/key_offset.py) is subtracted from each key row first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_formats.h"

namespace {

void check_states(const at::Tensor& states, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(states.device().is_cpu() && cache.device().is_cpu(), name, " and its cache must be CPU tensors");
  TORCH_CHECK(states.dim() == 3, name, " must be [tokens, kv_heads, head_dim], got ", states.sizes());
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), name,
              " cache must be a contiguous [blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(states.size(1) == cache.size(2), name, " ", states.sizes(), " does not match its cache ", cache.sizes());
  TORCH_CHECK(states.scalar_type() != cache.scalar_type() || states.size(2) == cache.size(3), name, " ",
              states.sizes(), " does not match its cache ", cache.sizes());
}

// Every (token, KV head) row of `states` quantized into its slot of a `Format` cache.
template <typename scalar_t, typename Format>
void quantize_into(const at::Tensor& states, at::Tensor& cache, const int64_t* slot, int64_t tokens,
                   const float* offset) {
  const int64_t heads = states.size(1), head_dim = states.size(2);
  const int64_t row = Format::row_elems(head_dim);
  const auto* src = states.data_ptr<scalar_t>();
  auto* dst = reinterpret_cast<typename Format::storage_t*>(cache.data_ptr());
  const int64_t stride = states.stride(0);
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> x(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* in = src + t * stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) x[d] = static_cast<float>(in[d]);
        if (offset != nullptr) {
          const float* off = offset + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) x[d] -= off[d];
        }
        if constexpr (Format::kQuantized) pagedllm::kv::hadamard(x.data(), head_dim, pagedllm::kv::write_shift(head_dim));
        Format::quantize(x.data(), head_dim, dst + (slot[t] * heads + h) * row);
      }
    }
  });
}

void write_quantized(const at::Tensor& states, at::Tensor& cache, const int64_t* slot, int64_t tokens,
                     const float* offset, const char* name) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, states.scalar_type(), "write_kv_cache", [&] {
    pagedllm::kv::dispatch_format<scalar_t>(cache, states.size(2), name, [&](auto format) {
      quantize_into<scalar_t, decltype(format)>(states, cache, slot, tokens, offset);
    });
  });
}

// Rows of the fused qkv output already have each token's heads side by side; anything else is
// copied into that layout first.
at::Tensor heads_contiguous(const at::Tensor& states) {
  return states.stride(2) == 1 && states.stride(1) == states.size(2) ? states : states.contiguous();
}

}  // namespace

void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache,
                    at::Tensor slot_mapping, c10::optional<at::Tensor> key_offset) {
  check_states(key, k_cache, "key");
  check_states(value, v_cache, "value");
  key = heads_contiguous(key);
  value = heads_contiguous(value);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "the key and value caches must have one shape");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 vector");
  const int64_t tokens = key.size(0);
  TORCH_CHECK(value.size(0) == tokens && slot_mapping.size(0) == tokens, "key, value and slot_mapping must have ",
              "one entry per token");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is outside the cache's ", slots, " slots");
  }
  const bool offset = key_offset.has_value() && key_offset->defined();
  if (key.scalar_type() != k_cache.scalar_type()) {
    if (offset) {
      TORCH_CHECK(key_offset->scalar_type() == at::kFloat && key_offset->is_contiguous() &&
                      key_offset->dim() == 2 && key_offset->size(0) == key.size(1) &&
                      key_offset->size(1) == key.size(2),
                  "key_offset must be a contiguous float32 [kv_heads, head_dim] = [", key.size(1), ", ",
                  key.size(2), "] tensor, got ", key_offset->sizes());
    }
    write_quantized(key, k_cache, slot, tokens, offset ? key_offset->data_ptr<float>() : nullptr, "key");
    write_quantized(value, v_cache, slot, tokens, nullptr, "value");
    return;
  }
  TORCH_CHECK(!offset, "a key offset applies to a quantized KV cache only");
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  // A prompt's rows are worth two threads only in the thousands.
  at::parallel_for(0, tokens, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slot[t] * row_bytes, kp + t * k_stride, row_bytes);
      std::memcpy(vc + slot[t] * row_bytes, vp + t * v_stride, row_bytes);
    }
  });
}
