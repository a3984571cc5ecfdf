"""Prompt normalisation and request validation, done before anything is scheduled."""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def parse_prompt(prompt: PromptType, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """Return (prompt text or None, token ids) for the forms vLLM accepts; raise ValueError otherwise."""
    text: str | None = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            token_ids = prompt["prompt_token_ids"]
            text = prompt.get("prompt")
        elif "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}.")
            token_ids = tokenizer.encode(text)
        else:
            raise ValueError("A dict prompt needs a 'prompt' (text) or 'prompt_token_ids' (list of ints) key.")
    elif isinstance(prompt, str):
        text = prompt
        token_ids = tokenizer.encode(prompt) if prompt else []
    elif isinstance(prompt, (list, tuple)):
        token_ids = prompt
    else:
        raise ValueError(
            f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )
    if not isinstance(token_ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise ValueError("prompt_token_ids must be a list of integers.")
    token_ids = list(token_ids)
    if not token_ids:
        raise ValueError("The prompt is empty: give at least one token (or a non-empty string).")
    bad = [t for t in token_ids if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"Token id {bad[0]} is out of the vocabulary range [0, {vocab_size}).")
    return text, token_ids


def check_request(token_ids: list[int], params: SamplingParams, max_model_len: int, pool_tokens: int) -> None:
    """Refuse what can never run, with both numbers in the message."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}.")
    params.verify()
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"The prompt is {len(token_ids)} tokens long, longer than the model's context of "
            f"{max_model_len} tokens (max_model_len); shorten the prompt."
        )
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"The prompt is {len(token_ids)} tokens long and fills the whole context of {max_model_len} "
            "tokens: no room to generate."
        )
    if len(token_ids) + 1 > pool_tokens:
        raise ValueError(
            f"The prompt needs {len(token_ids) + 1} KV slots but the whole KV pool holds {pool_tokens}; "
            "raise kv_cache_memory / num_kv_blocks or shorten the prompt."
        )
