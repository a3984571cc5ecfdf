// The attention kernels' optional sink logits (GPT-OSS): one float32 logit per query head that joins
// each query's softmax as a score with no value. An empty tensor means none.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pagedllm {

// The sinks' data for `num_heads` query heads, or nullptr for an empty tensor.
inline const float* sink_logits(const at::Tensor& sinks, int64_t num_heads) {
  if (sinks.numel() == 0) return nullptr;
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.size(0) == num_heads &&
                  sinks.is_contiguous(),
              "sinks must be a contiguous float32 [", num_heads, "] tensor (one logit per query head), got ",
              sinks.scalar_type(), " ", sinks.sizes());
  return sinks.data_ptr<float>();
}

}  // namespace pagedllm
