"""LLM: the offline API (vLLM's names), a thin loop around LLMEngine."""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm

from pagedllm.config import EngineArgs, check_setting_names
from pagedllm.engine.inputs import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.request import EngineRequest
from pagedllm.entrypoints.chat_utils import render_chat
from pagedllm.pooling_outputs import EmbeddingRequestOutput, PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import RequestOutput


class LLM:
    """Generate text for many prompts at once with a paged KV cache and continuous batching.

    model: None (the embedded SmolLM2-135M-Instruct), a Hugging Face folder, a GGUF file, or a hub id
    "ORG/NAME" ("ORG/NAME:Q4_K_M" picks a GGUF repo's file) fetched into the hub cache (HF_HOME, or
    download_dir) at ``revision``; HF_TOKEN and HF_HUB_OFFLINE apply. gguf_file: a GGUF repo's file by name.
    kv_cache_memory: bytes (or "2GiB") for the KV pool; num_kv_blocks sets the block count instead.
    kv_cache_dtype: "auto" (the model dtype), "fp8" / "fp8_e4m3", "fp8_e5m2", "int8" or "int4":
    the KV cache in 8 or 4 bits, so the same memory holds ~1.94x / ~3.2x the tokens of bfloat16.
    tensor_parallel_size: split the model over this many processes (ranks); they start here, or
    come from torchrun (see pagedllm/executor/multiproc.py). Stop them with ``llm.llm_engine.shutdown()``
    (they also stop when this process exits).

    Every keyword is a field of EngineArgs (pagedllm/config.py, with its help and default; the same
    settings as the command line's flags); an unknown one is a TypeError naming the closest.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        # Every keyword is an EngineArgs field, so a setting added there needs no edit here.
        check_setting_names(kwargs, "LLM()")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An LLM over settings already gathered (the command line builds EngineArgs)."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine.from_engine_args(engine_args)
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the prompts' order. Bad input raises before any work.

        ``priority``: one integer per prompt, lower scheduled first and preempted last (default all 0).
        """
        prompt_list = _as_prompt_list(prompts)
        if priority is None:
            priority = [0] * len(prompt_list)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompt_list):
            raise ValueError(f"priority must be a list of one integer per prompt ({len(prompt_list)}).")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, (list, tuple)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"Got {len(params_list)} sampling params for {len(prompt_list)} prompts; give one or one each."
                )
        else:
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}."
            )
        engine = self.llm_engine
        # Validate every prompt before queueing any, so a bad one leaves the engine untouched.
        groups = [
            engine.make_seq_group(EngineRequest(engine.next_request_id(), prompt, params, priority=rank))
            for prompt, params, rank in zip(prompt_list, params_list, priority)
        ]
        for group in groups:
            engine.enqueue(group)
        return self._run_engine([g.request_id for g in groups], use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {"prompt_token_ids": ids, "prompt": text}
            for text, ids in (self.render_chat(c, chat_template, add_generation_prompt) for c in conversations)
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the prompts' order (an engine with runner="pooling" or task="embed").

        The prompt's final hidden states, pooled as the engine's pooler_config says (LAST by default),
        truncated to ``pooling_params.dimensions`` for a Matryoshka model, L2-normalized unless
        ``pooling_params.normalize`` is False. Bad input raises before any work; a request the engine
        refuses later raises a ValueError with its message.
        """
        return [EmbeddingRequestOutput.from_base(output) for output in self.encode(prompts, pooling_params, use_tqdm)]

    def encode(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """The engine's pooling outputs (``outputs.data``, a float32 tensor) per prompt, in order."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        if isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params] * len(prompt_list)
        elif isinstance(pooling_params, (list, tuple)) and len(pooling_params) == len(prompt_list):
            params_list = list(pooling_params)
        else:
            raise ValueError(
                f"pooling_params must be a PoolingParams or a list of one per prompt ({len(prompt_list)})."
            )
        engine = self.llm_engine
        groups = [engine.make_seq_group(EngineRequest(engine.next_request_id(), prompt, params))
                  for prompt, params in zip(prompt_list, params_list)]
        for group in groups:
            engine.enqueue(group)
        return self._run_engine([g.request_id for g in groups], use_tqdm)

    def render_chat(
        self, conversation: list[dict[str, str]], chat_template: str | None = None, add_generation_prompt: bool = True
    ) -> tuple[str, list[int]]:
        return render_chat(self.get_tokenizer(), conversation, chat_template, add_generation_prompt)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if isinstance(output, RequestOutput):  # a pooling request generates nothing
                            generated += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {generated / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            # Leave the engine clean for the next call: drop whatever this call queued.
            engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        if not prompts:
            raise ValueError("No prompts given.")
        return list(prompts)
    raise ValueError(f"prompts must be a string, a list of token ids, a dict, or a list of those; got {type(prompts)}.")
