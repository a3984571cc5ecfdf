"""Prompt normalisation and request validation, done before anything is scheduled."""

from __future__ import annotations

from typing import Any

from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def parse_prompt(prompt: PromptType, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """Return (prompt text or None, token ids) for the forms vLLM accepts; raise ValueError otherwise."""
    text: str | None = None
    if isinstance(prompt, dict):
        if "prompt" in prompt and prompt["prompt"] is not None:
            check_text(prompt["prompt"], "prompt")
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
        check_text(prompt, "prompt")
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


# A priority is a sort key: the int64 range (what a priority is elsewhere, Ray's messages and vLLM's
# clients among them) is far more than any scheme of levels needs.
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1


def check_priority(priority: Any) -> None:
    """Refuse a priority that is no integer (a bool is none) or lies outside the int64 range."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}.", "priority")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequestError(
            f"priority must be an integer in [-2**63, 2**63 - 1], got {str(priority)[:40]}.", "priority"
        )


def unencodable_char(text: str) -> int | None:
    """Index of the first character UTF-8 cannot encode (a lone UTF-16 surrogate), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_text(text: Any, what: str) -> None:
    """Refuse a string no tokenizer can take (lone surrogates, e.g. from a JSON "\\ud800" escape)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a string, got {type(text).__name__}.", what)
    index = unencodable_char(text)
    if index is not None:
        raise InvalidRequestError(
            f"{what} holds an unpaired UTF-16 surrogate (U+{ord(text[index]):04X}) at character {index}, which is "
            "not valid Unicode text; send valid UTF-8, or pair the surrogate.", what
        )


def check_request(
    token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    pool_blocks: int,
    block_size: int,
    max_num_seqs: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Refuse what can never run, with the numbers and what to change in the message.

    ``pool_blocks``: the most blocks one request can ever hold (the whole pool, or for contiguous
    allocation the largest run the buddy allocator has).
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}.")
    params.verify()
    if max_num_seqs is not None and params.best_of > max_num_seqs:
        name = "best_of" if params.best_of != params.n else "n"
        raise InvalidRequestError(
            f"{name} must be at most {max_num_seqs} (the engine's max_num_seqs), got {params.best_of}.", name
        )
    if vocab_size is not None:
        bad = [t for t in params.stop_token_ids or () if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids: token id {bad[0]} is out of the vocabulary range [0, {vocab_size}).",
                "stop_token_ids",
            )
        bad = [t for t in params.logit_bias or () if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias: token id {bad[0]} is out of the vocabulary range [0, {vocab_size}).", "logit_bias"
            )
    prompt_len = len(token_ids)
    if prompt_len > max_model_len:
        raise InvalidRequestError(
            f"The prompt is {prompt_len} tokens long, longer than the model's context of "
            f"{max_model_len} tokens (max_model_len); shorten the prompt.", "prompt"
        )
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"The prompt is {prompt_len} tokens long and fills the whole context of {max_model_len} "
            "tokens: no room to generate.", "prompt"
        )
    pool_tokens = pool_blocks * block_size
    pool = f"the whole KV pool holds {pool_tokens} tokens ({pool_blocks} blocks of {block_size})"
    if prompt_len + 1 > pool_tokens:
        raise InvalidRequestError(
            f"The prompt needs {prompt_len + 1} KV slots but {pool}; "
            "raise kv_cache_memory / num_kv_blocks or shorten the prompt.", "prompt"
        )
    # With EOS ignored and max_tokens given, every sequence runs to its full length, all of a
    # request's sequences at once (they are gang-scheduled): refuse what could only end cut short.
    if params.ignore_eos and params.max_tokens is not None:
        total_len = prompt_len + params.max_tokens
        needed = blocks_needed(prompt_len, total_len, params.best_of, block_size)
        if needed > pool_blocks:
            fits = max_tokens_that_fit(prompt_len, params.best_of, pool_blocks, block_size)
            sequences = f"{params.best_of} sequences of " if params.best_of > 1 else ""
            hint = f"lower max_tokens to at most {fits}, " if fits >= 1 else ""
            raise InvalidRequestError(
                f"The prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) with ignore_eos needs "
                f"{sequences}{total_len} tokens, {needed} KV blocks, but {pool}; {hint}shorten the prompt, or "
                "give the engine a larger KV pool (kv_cache_memory / num_kv_blocks).", "max_tokens"
            )


def blocks_needed(prompt_len: int, total_len: int, num_seqs: int, block_size: int) -> int:
    """KV blocks a request holds when its ``num_seqs`` sequences all reach ``total_len`` tokens.

    The prompt's full blocks are shared; each sequence owns its blocks from the prompt's last
    partial block on (a write into a shared block copies it).
    """
    shared = prompt_len // block_size
    own = -(-total_len // block_size) - shared
    return shared + num_seqs * own


def max_tokens_that_fit(prompt_len: int, num_seqs: int, pool_blocks: int, block_size: int) -> int:
    """The largest max_tokens whose request fits ``pool_blocks`` (0 if none does)."""
    shared = prompt_len // block_size
    own_blocks = (pool_blocks - shared) // num_seqs
    return max((shared + own_blocks) * block_size - prompt_len, 0)
