"""Incremental detokenization: token ids to text, one token at a time, in O(1) tokens per step.

The algorithm is vLLM's (after Hugging Face TGI). A sequence keeps its tokens as strings
(``seq.tokens``) and two offsets into them: text up to ``read_offset`` has been emitted; the
window ``[prefix_offset, read_offset)`` is a few tokens of context. Each step decodes the window
with and without the tokens after ``read_offset`` and emits the difference. The context is what
makes the difference right: decoders strip a leading space, merge byte-fallback pieces and so on
depending on the neighbours, and the same thing happens to both strings.

A decode ending in U+FFFD means the last tokens stop inside a multi-byte character (byte-level
BPE and byte-fallback tokenizers split emoji and CJK characters into several tokens): nothing is
emitted and the offsets stay, so the character comes out whole once its last byte arrives.
"""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence

# Tokens of context before the first generated token (vLLM's value).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


def detokenize_incrementally(tokenizer: Any, seq: Sequence, params: SamplingParams, position: int = -1) -> str:
    """Decode ``seq``'s generated token at ``position`` (the last one by default); append the new text
    to ``seq.output_text`` and return it.

    Call once per generated token, in order (a step that appended several calls once for each). The
    first call reads the tail of the prompt as context (the prompt's text is never part of
    ``output_text``). Returns "" while the text so far ends inside a multi-byte character, and for
    skipped special tokens; always "" (and no work) when the request asked for token ids only
    (``params.detokenize`` False).
    """
    if not params.detokenize:
        return ""
    skip_special_tokens = params.skip_special_tokens
    if position < 0:
        position += seq.get_output_len()
    new_token_id = seq.output_token_ids[position]
    if seq.tokens is None:  # the first call: everything before the new token is context
        seq.tokens, seq.prefix_offset, seq.read_offset = _convert_prompt_ids_to_tokens(
            tokenizer, seq.prompt_token_ids + seq.output_token_ids[:position], skip_special_tokens
        )
    tokens = seq.tokens
    assert tokens is not None
    tokens.extend(_convert_id_to_tokens(tokenizer, new_token_id, skip_special_tokens))

    prefix_offset, read_offset = seq.prefix_offset, seq.read_offset
    prefix_text = _tokens_to_string(
        tokenizer, tokens[prefix_offset:read_offset], skip_special_tokens, params.spaces_between_special_tokens
    )
    new_text = _tokens_to_string(
        tokenizer, tokens[prefix_offset:], skip_special_tokens, params.spaces_between_special_tokens
    )
    if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
        # An unfinished multi-byte character at the end (byte-level / byte-fallback pieces), or
        # nothing new: wait for more tokens. U+FFFD in the middle is a real invalid sequence.
        return ""
    new_text = new_text[len(prefix_text) :]
    seq.prefix_offset = read_offset
    seq.read_offset = len(tokens)
    seq.output_text += new_text
    return new_text


def _convert_prompt_ids_to_tokens(
    tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool
) -> tuple[list[str], int, int]:
    # Only the prompt's tail matters as context; a couple more tokens in case some are special.
    tail = prompt_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET - 2 :]
    tokens: list[str] = []
    for token_id in tail:
        tokens.extend(_convert_id_to_tokens(tokenizer, token_id, skip_special_tokens))
    read_offset = len(tokens)
    prefix_offset = max(read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
    return tokens, prefix_offset, read_offset


def _convert_id_to_tokens(tokenizer: Any, token_id: int, skip_special_tokens: bool) -> list[str]:
    """The token string of one id as a list: empty when skipped, [""] for an id outside the vocabulary."""
    vocab_len, special_ids = _tokenizer_info(tokenizer)
    if not 0 <= token_id < vocab_len:
        return [""]
    if skip_special_tokens and token_id in special_ids:
        return []
    converted = tokenizer.convert_ids_to_tokens([token_id])
    if isinstance(converted, str):
        converted = [converted]
    return [token if token is not None else "" for token in converted]


def _tokens_to_string(
    tokenizer: Any, tokens: list[str], skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> str:
    if not tokens:
        return ""
    if getattr(tokenizer, "is_fast", False) or not tokenizer.get_added_vocab():
        return tokenizer.convert_tokens_to_string(tokens)
    return _convert_tokens_to_string_with_added_encoders(
        tokenizer, tokens, skip_special_tokens, spaces_between_special_tokens
    )


def _convert_tokens_to_string_with_added_encoders(
    tokenizer: Any, tokens: list[str], skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> str:
    """Slow tokenizers with added tokens: decode runs of ordinary tokens, keep added ones verbatim
    (Hugging Face's own slow ``decode`` does the same, which is where the spaces come from)."""
    added_vocab = tokenizer.get_added_vocab()
    special_tokens = set(tokenizer.all_special_tokens)
    sub_texts: list[str] = []
    current: list[str] = []
    for token in tokens:
        if skip_special_tokens and token in special_tokens:
            continue
        if token in added_vocab:
            if current:
                sub_texts.append(tokenizer.convert_tokens_to_string(current))
                current = []
            sub_texts.append(token)
        else:
            current.append(token)
    if current:
        sub_texts.append(tokenizer.convert_tokens_to_string(current))
    return (" " if spaces_between_special_tokens else "").join(sub_texts)


_INFO_CACHE: dict[int, tuple[Any, int, frozenset[int]]] = {}


def _tokenizer_info(tokenizer: Any) -> tuple[int, frozenset[int]]:
    """(vocabulary size with added tokens, ids that skip_special_tokens drops), computed once per tokenizer.

    The special ids are the declared special tokens plus every added token flagged special: that is
    the set a fast tokenizer's own ``decode(skip_special_tokens=True)`` drops (``convert_ids_to_tokens``
    alone only knows the first kind, e.g. not SmolLM2's ``<repo_name>``).
    """
    cached = _INFO_CACHE.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        special_ids = set(tokenizer.all_special_ids)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        special_ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
        # Holding the tokenizer keeps its id from being reused by another object.
        cached = (tokenizer, len(tokenizer), frozenset(special_ids))
        _INFO_CACHE[id(tokenizer)] = cached
    return cached[1], cached[2]
