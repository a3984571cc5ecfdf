"""Stop checker: EOS, stop tokens, stop strings (spanning tokens, truncation), min/max tokens, model length.

The two halves run where the engine runs them, one token at a time: ``check_stop`` (the scheduler's
update, no text) and then ``check_stop_text`` (the output processor, after detokenizing)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.stop_checker import check_stop, check_stop_text
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceStatus

EOS = 2
MAX_MODEL_LEN = 1000


def check_both_halves(
    seq: Sequence, params: SamplingParams, new_text_len: int, eos_token_id: int | None, max_model_len: int | None
) -> None:
    """The token just appended (its text, ``new_text_len`` characters, already in ``seq.output_text``)
    checked as the engine checks it: the token half in the scheduler, then the text half."""
    check_stop(seq, params, eos_token_id, max_model_len)
    stopped_by_token = seq.status == SequenceStatus.FINISHED_STOPPED
    check_stop_text(seq, params, new_text_len, seq.get_output_len(), stopped_by_token)


def feed(
    params: SamplingParams,
    steps: list[tuple[int, str]],
    prompt: list[int] | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    eos_token_id: int | None = EOS,
) -> tuple[Sequence, int]:
    """Append (token id, its new text) pairs until the sequence finishes; return it and the steps taken."""
    seq = Sequence(0, prompt or [10, 11], block_size=16)
    seq.status = SequenceStatus.RUNNING
    for taken, (token_id, text) in enumerate(steps, start=1):
        seq.append_token(token_id, 0.0)
        seq.output_text += text
        check_both_halves(seq, params, len(text), eos_token_id, max_model_len)
        if seq.is_finished():
            return seq, taken
    return seq, len(steps)


def words(*texts: str) -> list[tuple[int, str]]:
    return [(100 + i, text) for i, text in enumerate(texts)]


def test_running_sequence_stays_running() -> None:
    seq, taken = feed(SamplingParams(max_tokens=10), words("a", "b", "c"))
    assert seq.status == SequenceStatus.RUNNING and taken == 3
    assert seq.stop_reason is None


def test_eos_stops_and_its_text_is_removed() -> None:
    seq, taken = feed(SamplingParams(), words("Hi", " there") + [(EOS, "</s>")] + words("never"))
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.status.finish_reason == "stop"
    assert taken == 3 and seq.output_text == "Hi there"
    assert seq.output_token_ids[-1] == EOS and seq.stop_reason is None


def test_eos_with_include_stop_str_in_output_keeps_text() -> None:
    seq, _ = feed(SamplingParams(include_stop_str_in_output=True), words("Hi") + [(EOS, "</s>")])
    assert seq.output_text == "Hi</s>"


def test_ignore_eos_continues_to_max_tokens() -> None:
    seq, taken = feed(SamplingParams(ignore_eos=True, max_tokens=4), [(EOS, "")] * 10)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and taken == 4
    assert seq.status.finish_reason == "length"


def test_no_eos_token_configured() -> None:
    seq, taken = feed(SamplingParams(max_tokens=3), [(EOS, "x")] * 5, eos_token_id=None)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and taken == 3


def test_stop_token_ids() -> None:
    seq, taken = feed(SamplingParams(stop_token_ids=[7, 8]), words("a", "b") + [(8, "<|stop|>")] + words("c"))
    assert seq.status == SequenceStatus.FINISHED_STOPPED and taken == 3
    assert seq.stop_reason == 8 and seq.output_text == "ab"
    assert seq.output_token_ids[-1] == 8


def test_min_tokens_defers_eos_stop_tokens_and_stop_strings() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=[7], stop=["x"])
    seq, taken = feed(params, [(EOS, ""), (7, "x"), (100, "y"), (EOS, "")])
    assert taken == 4 and seq.status == SequenceStatus.FINISHED_STOPPED  # the first EOS past min_tokens
    assert seq.output_text == "xy"  # the early "x" could not stop it and is not searched again
    seq, taken = feed(params, [(100, "x"), (101, "a"), (102, "x")])
    assert taken == 3 and seq.stop_reason == "x" and seq.output_text == "xa"
    seq, taken = feed(SamplingParams(min_tokens=2), [(EOS, ""), (EOS, "")])
    assert taken == 2 and seq.status == SequenceStatus.FINISHED_STOPPED


def test_max_model_len_caps_even_before_min_tokens() -> None:
    params = SamplingParams(min_tokens=10, max_tokens=20)
    seq, taken = feed(params, words(*"abcdefghij"), prompt=[1, 2, 3], max_model_len=6)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and taken == 3


def test_max_tokens_none_runs_to_max_model_len() -> None:
    seq, taken = feed(SamplingParams(max_tokens=None), words(*("w" * 50)), prompt=[1] * 10, max_model_len=30)
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and taken == 20


def test_eos_beats_length_cap_on_the_same_token() -> None:
    seq, _ = feed(SamplingParams(max_tokens=2), words("a") + [(EOS, "")])
    assert seq.status == SequenceStatus.FINISHED_STOPPED


def test_stop_string_spanning_tokens_is_truncated() -> None:
    seq, taken = feed(SamplingParams(stop=["o W"]), words("Hel", "lo", " Wo", "rld"))
    assert taken == 3 and seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.stop_reason == "o W" and seq.output_text == "Hell"


def test_stop_string_included_when_asked() -> None:
    seq, _ = feed(SamplingParams(stop=["o W"], include_stop_str_in_output=True), words("Hel", "lo", " Wo", "rld"))
    assert seq.output_text == "Hello W"
    seq, _ = feed(SamplingParams(stop=["END"], include_stop_str_in_output=True), words("ab", "EN", "D"))
    assert seq.output_text == "abEND"


def test_earliest_stop_string_wins() -> None:
    seq, _ = feed(SamplingParams(stop=["cd", "b"]), words("a", "bcd"))
    assert seq.stop_reason == "b" and seq.output_text == "a"
    seq, _ = feed(SamplingParams(stop=["b", "bc"]), words("a", "bcd"))
    assert seq.stop_reason == "bc" and seq.output_text == "a"  # same position: the longer one


def test_stop_string_not_searched_in_old_text_again() -> None:
    # Text that was already present before the stop string could match is not re-searched: a step
    # that adds no text (held-back multi-byte piece) never stops on a string.
    params = SamplingParams(stop=["zz"])
    seq = Sequence(0, [1], block_size=16)
    seq.append_token(5, 0.0)
    seq.output_text = "zz"  # e.g. set by a caller without a matching new_text_len
    check_both_halves(seq, params, 0, EOS, MAX_MODEL_LEN)
    assert seq.status == SequenceStatus.WAITING


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc世🎉 ", min_size=1, max_size=40),
    cuts=st.lists(st.integers(1, 40), max_size=20),
    stop_start=st.integers(0, 39),
    stop_len=st.integers(1, 4),
    include=st.booleans(),
)
def test_stop_string_found_at_first_occurrence_whatever_the_split(
    text: str, cuts: list[int], stop_start: int, stop_len: int, include: bool
) -> None:
    stop = text[stop_start : stop_start + stop_len] or text[:1]
    bounds = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include, max_tokens=100)
    seq, taken = feed(params, words(*pieces))
    first = text.find(stop)
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == stop
    assert seq.output_text == text[: first + (len(stop) if include else 0)]
    # It stopped on the piece that completed the first occurrence.
    assert sum(len(piece) for piece in pieces[:taken]) >= first + len(stop)
    assert sum(len(piece) for piece in pieces[: taken - 1]) < first + len(stop)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab世", max_size=12),
    stops=st.lists(st.text(alphabet="ab世c", min_size=1, max_size=8), max_size=4),
)
def test_stream_holds_back_exactly_the_longest_stop_prefix_ending_the_text(text: str, stops: list[str]) -> None:
    """stop_holdback (the server's streaming) withholds the longest proper prefix of a stop string that
    ends the text, found by first-character search instead of trying every prefix length."""
    from pagedllm.entrypoints.openai.serving_base import stop_holdback

    expected = max(
        (n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])),
        default=0,
    )
    assert stop_holdback(text, stops) == expected
