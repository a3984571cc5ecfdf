"""POST /v1/embeddings: inputs (text, token ids, or lists of them) -> one embedding each.

Served by an engine running the pooling runner (``--runner pooling`` or ``--task embed``); each input is
one pooling request, batched by the scheduler with whatever else is running. ``dimensions`` truncates a
Matryoshka model's embeddings (others refuse it, as vLLM does); ``encoding_format: base64`` sends each
vector as the base64 of its little-endian float32 bytes (the openai client's default).
"""

from __future__ import annotations

import base64
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_base import ServingContext, bad_request, set_log_info
from pagedllm.entrypoints.openai.streaming import final_outputs
from pagedllm.pooling_params import PoolingParams

EMBED_TASK = "embed"
GENERATE_TASK = "generate"


def supported_tasks(ctx: ServingContext) -> tuple[str, ...]:
    """What the served engine does: ("generate",) or ("embed",), from its runner."""
    engine = getattr(ctx.async_engine, "engine", None)
    return tuple(getattr(engine, "supported_tasks", (GENERATE_TASK,)))


def require_generation(ctx: ServingContext) -> None:
    """A 400 for a generation endpoint on a pooling-runner server (vLLM: the endpoint is not available)."""
    if GENERATE_TASK not in supported_tasks(ctx):
        raise bad_request(
            f"The model `{ctx.model_name}` serves embeddings only (it runs the pooling runner): use /v1/embeddings, "
            "or start the server with --runner generate to generate text."
        )


def input_list(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's inputs, one entry each; empty ones refused (OpenAI refuses them too)."""
    if isinstance(value, str):
        inputs: list[Any] = [value]
    elif value and all(isinstance(item, int) for item in value):
        inputs = [list(value)]
    else:
        inputs = list(value)
    if not inputs:
        raise bad_request("input must not be empty: give a string, a list of strings or token ids.", "input")
    for index, item in enumerate(inputs):
        if len(item) == 0:
            raise bad_request(f"input {index} is empty; every input needs at least one character or token.", "input")
    return inputs


class OpenAIServingEmbedding:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _encode(self, inputs: list[str | list[int]], add_special_tokens: bool) -> list[tuple[str | None, list[int]]]:
        """On the tokenizer thread: text inputs tokenized (the tokenizer appends what its model pools, e.g.
        Qwen3-Embedding's <|endoftext|>); token ids pass as given."""
        encoded: list[tuple[str | None, list[int]]] = []
        for index, item in enumerate(inputs):
            if isinstance(item, str):
                try:
                    token_ids = list(self.ctx.tokenizer.encode(item, add_special_tokens=add_special_tokens))
                except Exception as exc:  # the tokenizer's own error text means nothing to a client
                    raise bad_request(f"input {index} could not be tokenized; send plain UTF-8 text.", "input") from exc
                encoded.append((item, token_ids))
            else:
                encoded.append((None, list(item)))
        return encoded

    def _truncated(self, token_ids: list[int], truncate: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last k tokens (-1: the last max_model_len)."""
        if truncate is None:
            return token_ids
        keep = self.ctx.max_model_len if truncate == -1 else truncate
        return token_ids[-keep:]

    def _check_length(self, num_tokens: int) -> None:
        max_model_len = self.ctx.max_model_len
        if num_tokens > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested {num_tokens} "
                "tokens in the input for embedding generation. Please reduce the length of the input "
                "(or set truncate_prompt_tokens).", "input"
            )

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_model(request.model)
        ctx.async_engine.check_alive()
        if EMBED_TASK not in supported_tasks(ctx):
            raise bad_request(
                f"The model `{ctx.model_name}` does not serve embeddings: it runs the generate runner. Start the "
                "server with --runner pooling (vLLM's older --task embed) to pool its hidden states."
            )
        truncate = request.truncate_prompt_tokens
        if truncate is not None and truncate != -1 and not 1 <= truncate <= ctx.max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens must be -1 or between 1 and max_model_len={ctx.max_model_len}, "
                f"got {truncate}.",
                "truncate_prompt_tokens",
            )
        inputs = input_list(request.input)
        if len(inputs) > ctx.max_prompts_per_request:
            raise bad_request(
                f"input holds {len(inputs)} inputs; this server takes at most {ctx.max_prompts_per_request} per "
                "request (--max-prompts-per-request). Split them over several requests.", "input"
            )
        try:
            params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
            # Here, not in the engine: the engine knows the model by its path, clients by its served name.
            if ctx.hf_config is not None:
                params.verify(ctx.hf_config, ctx.model_name)
        except ValueError as exc:
            raise bad_request(str(exc), "dimensions") from exc
        encoded = await ctx.run_in_tokenizer_thread(self._encode, inputs, request.add_special_tokens)
        encoded = [(text, self._truncated(ids, truncate)) for text, ids in encoded]
        for _, token_ids in encoded:
            self._check_length(len(token_ids))
        request_id = random_id("embd")
        request_ids = [f"{request_id}-{i}" for i in range(len(encoded))]
        prompts: list[Any] = [
            {"prompt_token_ids": ids, "prompt": text} if text is not None else ids for text, ids in encoded
        ]
        set_log_info(raw_request, id=request_id, **ctx.identity(request))
        await ctx.add_requests(request_ids, prompts, params, prompt_param="input", priority=request.priority)
        streams = [ctx.async_engine.stream_outputs(rid) for rid in request_ids]
        finals = await final_outputs(ctx, raw_request, request_ids, streams)
        if finals is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        data = []
        for index, output in enumerate(finals):
            vector = output.outputs.data.float().numpy()
            embedding: list[float] | str = (
                base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
                if request.encoding_format == "base64" else vector.tolist()
            )
            data.append(EmbeddingResponseData(index=index, embedding=embedding))
        num_tokens = sum(len(output.prompt_token_ids) for output in finals)
        set_log_info(raw_request, prompt_tokens=num_tokens)
        response = EmbeddingResponse(
            id=request_id, model=request.model or ctx.model_name, data=data,
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())
