"""Server-Sent Events for both generation endpoints: per-choice deltas, stop-string holdback, usage.

The completion and chat handlers differ only in the chunks they build; this module turns the
engine's successive RequestOutputs into per-choice deltas (new text that can no longer turn into
a stop string, new tokens), counts usage, writes the final usage chunk and the ``[DONE]``, and
reports an error inside the stream once the status line is sent.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from pagedllm.entrypoints.openai.protocol import StreamOptions, UsageInfo
from pagedllm.entrypoints.openai.serving_base import (
    ServingContext,
    merge_streams,
    run_until_disconnect,
    set_log_info,
    sse,
    stop_holdback,
)
from pagedllm.sequence import CompletionOutput, RequestOutput


@dataclass
class ChoiceDelta:
    """What one choice gained since its last chunk."""

    index: int  # the choice's index in the response
    output: RequestOutput
    completion: CompletionOutput
    text: str  # new text, stop-string prefixes held back until they resolve
    first_token: int  # completion.token_ids[first_token:] are new
    is_first: bool  # the choice's first delta
    finished: bool

    @property
    def new_token_ids(self) -> list[int]:
        return self.completion.token_ids[self.first_token :]


@dataclass
class _ChoiceState:
    sent_chars: int = 0
    sent_tokens: int = 0
    finished: bool = False


class DeltaTracker:
    """Turns each RequestOutput of the streams into the deltas of its choices."""

    def __init__(self, choices_per_stream: int, stop_strings: list[str], count_generated: bool = True) -> None:
        self.choices_per_stream = choices_per_stream
        self.stop_strings = stop_strings
        # False when the generated tokens are left out of the response (completions' max_tokens 0).
        self.count_generated = count_generated
        self._states: dict[int, _ChoiceState] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._generated_tokens: dict[int, int] = {}

    def deltas(self, stream_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        self._prompt_tokens[stream_index] = len(output.prompt_token_ids)
        found = []
        for completion in output.outputs:
            index = stream_index * self.choices_per_stream + completion.index
            state = self._states.setdefault(index, _ChoiceState())
            if state.finished:
                continue
            self._generated_tokens[index] = len(completion.token_ids)
            done = completion.finish_reason is not None
            text = completion.text
            end = len(text) if done else len(text) - stop_holdback(text, self.stop_strings)
            end = max(end, state.sent_chars)
            found.append(ChoiceDelta(index, output, completion, text[state.sent_chars : end], state.sent_tokens,
                                     is_first=state.sent_tokens == 0 and state.sent_chars == 0, finished=done))
            state.sent_chars = end
            state.sent_tokens = len(completion.token_ids)
            state.finished = done
        return found

    def usage(self) -> UsageInfo:
        prompt = sum(self._prompt_tokens.values())
        generated = sum(self._generated_tokens.values()) if self.count_generated else 0
        return UsageInfo(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


async def event_stream(
    ctx: ServingContext,
    raw_request: Request,
    streams: list[AsyncIterator[RequestOutput]],
    tracker: DeltaTracker,
    chunk: Callable[[list[dict[str, Any]]], dict[str, Any]],
    choice_chunks: Callable[[ChoiceDelta], list[dict[str, Any]]],
    stream_options: StreamOptions | None,
    opening: list[dict[str, Any]] | None = None,
) -> AsyncGenerator[str, None]:
    """The SSE body: ``opening`` choices first, then one chunk per choice dict ``choice_chunks`` makes of
    each delta (none: nothing to send yet), the usage chunk when asked for, and ``[DONE]``.

    ``chunk(choices)`` wraps choice dicts into the endpoint's chunk object. With
    ``stream_options.include_usage`` every chunk has a ``usage`` key, null but in the last chunk,
    or the usage so far in each with ``continuous_usage_stats`` too (vLLM's).
    """
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and bool(stream_options and stream_options.continuous_usage_stats)

    def with_usage(body: dict[str, Any], usage: dict[str, int] | None = None) -> str:
        if include_usage:
            body["usage"] = usage if usage is not None or not continuous else tracker.usage().model_dump()
        return sse(body)

    try:
        if opening:
            yield with_usage(chunk(opening))
        async for stream_index, output in merge_streams(streams):
            for delta in tracker.deltas(stream_index, output):
                for choice in choice_chunks(delta):
                    yield with_usage(chunk([choice]))
        usage = tracker.usage()
        set_log_info(raw_request, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        if include_usage:
            yield with_usage(chunk([]), usage.model_dump())
    except GeneratorExit:
        set_log_info(raw_request, disconnected=True)
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
        error = ctx.engine_error(exc)
        set_log_info(raw_request, error=error.message[:200], error_status=error.status_code)
        yield sse(error.body())
    yield sse("[DONE]")


async def final_outputs(
    ctx: ServingContext, raw_request: Request, request_ids: list[str], streams: list[AsyncIterator[RequestOutput]]
) -> list[RequestOutput] | None:
    """The last output of each stream (a non-streaming response); None when the client went away."""
    # The client sees nothing before the end, so an engine front that can rerun a request on
    # another replica (serving/replica_frontend.py) may do so however far it had got.
    ctx.async_engine.buffer_outputs(request_ids)

    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, output in merge_streams(streams):
                finals[index] = output
        finally:
            ctx.abort_unfinished(request_ids)
        return finals  # type: ignore[return-value]

    try:
        return await run_until_disconnect(raw_request, collect(), lambda: ctx.abort_unfinished(request_ids))
    except Exception as exc:
        raise ctx.engine_error(exc) from exc
