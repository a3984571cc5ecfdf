"""What a pooling request returns (vLLM's shapes): the engine's PoolingRequestOutput carries the pooled
tensor; LLM.embed and the server turn it into an EmbeddingRequestOutput, whose ``outputs.embedding``
is a list of floats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.sequence import RequestMetrics


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor [hidden or dimensions], float32 on the CPU


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # None until the prompt is done (or when the request ended with an error).
    outputs: PoolingOutput | None
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    failed: bool = False  # error is set and the engine failed on this request (a server error)
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        if output.error is not None or output.outputs is None:
            raise ValueError(output.error or f"request {output.request_id} has no embedding yet")
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)
