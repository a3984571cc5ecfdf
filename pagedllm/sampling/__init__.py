"""Sampling: logits processors and the sampler (beam search joins later)."""

from pagedllm.sampling.sampler import Sampler, SamplerOutput, SamplingRow

__all__ = ["Sampler", "SamplerOutput", "SamplingRow"]
