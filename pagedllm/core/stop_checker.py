"""Decide whether a sequence is done (vLLM's stop semantics), in two halves.

``check_stop`` (``Scheduler.update``, after each appended token; no text needed), the first match wins:

- before ``min_tokens`` generated tokens no stop token can stop the sequence;
- EOS (unless ``ignore_eos``) -> stopped;
- a token of ``stop_token_ids`` -> stopped, ``stop_reason`` = the id;
- ``max_model_len``: the sequence fills the model's context -> length capped;
- ``max_tokens`` generated -> length capped.

``check_stop_text`` (the engine's output processor, after the detokenizer appended the token's text):

- a sequence stopped by a stop token loses that token's text (kept with ``include_stop_str_in_output``);
- otherwise, from ``min_tokens`` generated tokens on, a stop string in the text -> stopped,
  ``stop_reason`` = the string, also when the same token capped the length; the text is cut before
  it (or right after it with ``include_stop_str_in_output``).

Stop tokens stay in ``output_token_ids``; only the text loses them (with the default
``skip_special_tokens`` a special EOS has no text anyway).
"""

from __future__ import annotations

from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, params: SamplingParams, eos_token_id: int | None, max_model_len: int | None) -> None:
    """Set ``seq.status`` (and ``seq.stop_reason``) if the token just appended ends the sequence."""
    output_len = seq.get_output_len()
    if output_len >= params.min_tokens:
        last_token_id = seq.get_last_token_id()
        is_eos = eos_token_id is not None and not params.ignore_eos and last_token_id == eos_token_id
        if is_eos or last_token_id in (params.stop_token_ids or ()):
            seq.status = SequenceStatus.FINISHED_STOPPED
            if not is_eos:
                seq.stop_reason = last_token_id
            return
    if max_model_len is not None and seq.get_len() >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        return
    if params.max_tokens is not None and output_len >= params.max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED


def check_stop_text(
    seq: Sequence, params: SamplingParams, new_text_len: int, output_len: int, stopped_by_token: bool
) -> bool:
    """The text half, for the token at output position ``output_len - 1`` whose text (``new_text_len``
    characters) the detokenizer just appended to ``seq.output_text``. ``stopped_by_token``: that
    token ended the sequence in ``check_stop``. Returns whether a stop string ends the sequence there."""
    if stopped_by_token:
        if new_text_len and not params.include_stop_str_in_output:
            seq.output_text = seq.output_text[:-new_text_len]
        return False
    if output_len < params.min_tokens:
        return False
    stop_str = _find_stop_string(seq, params, new_text_len)
    if stop_str is None:
        return False
    seq.status = SequenceStatus.FINISHED_STOPPED
    seq.stop_reason = stop_str
    return True


def _find_stop_string(seq: Sequence, params: SamplingParams, new_text_len: int) -> str | None:
    """The stop string that occurs first in the text, truncating the text at it.

    Only the new text and ``len(stop) - 1`` characters before it are searched: anything earlier was
    searched on previous steps.
    """
    if not new_text_len or not params.stop_strings:
        return None
    text = seq.output_text
    best_index = -1
    best_stop: str | None = None
    for stop_str in params.stop_strings:
        start = max(len(text) - new_text_len - len(stop_str) + 1, 0)
        index = text.find(stop_str, start)
        # Earliest occurrence wins; at the same position, the longer stop string.
        if index != -1 and (
            best_index == -1 or index < best_index or (index == best_index and len(stop_str) > len(best_stop or ""))
        ):
            best_index, best_stop = index, stop_str
    if best_stop is None:
        return None
    end = best_index + len(best_stop) if params.include_stop_str_in_output else best_index
    seq.output_text = text[:end]
    return best_stop
