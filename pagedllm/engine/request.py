"""One request as the engines take it: what ``add_request`` is given, as one value.

The server's handlers hand it to their front (``EngineClient.add``: one engine, or replicas, each of
which receives it over Ray whole); ``LLMEngine.add_request`` and ``LLM.generate`` build it for
``LLMEngine.make_seq_group``, which checks it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
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

    def with_arrival_time(self) -> EngineRequest:
        """This request with its arrival time set: now, when it has none."""
        return self if self.arrival_time is not None else replace(self, arrival_time=time.time())
