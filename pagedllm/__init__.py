"""pagedllm: LLM inference and serving on a paged KV cache (PagedAttention)."""

from pagedllm.config import EngineArgs
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import CompletionOutput, RequestOutput

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # LLM and LLMEngine pull in torch; importing pagedllm.core or SamplingParams must not.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
