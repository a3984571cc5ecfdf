"""pagedllm: LLM inference and serving on a paged KV cache (PagedAttention)."""

from pagedllm.kernels.isa import cap_torch_to_forced_level

cap_torch_to_forced_level()  # before anything imports torch

from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.pooling_params import PoolingParams  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.sequence import CompletionOutput, RequestOutput  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM", "LLMEngine", "EngineArgs", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
    "__version__",
]


def __getattr__(name: str):
    # LLM and LLMEngine pull in torch; importing pagedllm.core or SamplingParams must not.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
