"""One request as the engine fronts take it: what ``add_request`` is given, as one value.

``EngineClient.add_request`` (the server's fronts), ``LLMEngine.add_request`` and ``LLM.generate``
build it; ``LLMEngine.make_seq_group`` checks it and a replica receives it over Ray whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    # Text, token ids, or {"prompt": ..., "prompt_token_ids": ...} (engine/inputs.py's PromptType).
    prompt: Any
    # SamplingParams, or PoolingParams for a pooling-runner engine (an embedding).
    params: SamplingParams | PoolingParams
    arrival_time: float | None = None  # time.time() seconds; None: when the engine takes it
    # Lower is scheduled first and preempted last (default 0 for all: first come first served).
    priority: int = 0
    # Routes requests among data-parallel replicas (the router keeps a key on one replica); one
    # engine caches prefixes by their content alone and ignores it.
    cache_key: str | None = None
