"""Reasoning parsers (qwen3, deepseek_r1, gpt_oss), the harmony splitter, the openai tool parser and the
gated grammar that starts after the reasoning: finished replies, and the same replies streamed piece by
piece (every split point), which must add up to what the finished parse gives."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.entrypoints.openai.harmony import parse_harmony
from pagedllm.entrypoints.openai.openai_tool_parser import OpenAIToolParser
from pagedllm.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    GptOssReasoningParser,
    Qwen3ReasoningParser,
    constraint_after_reasoning,
)
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured.gated import GatedMatcher


class CharTokenizer:
    """encode: one id per character (enough for reasoning_end_token_ids)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


TOK = CharTokenizer()
QWEN_PROMPT_THINKING = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
QWEN_PROMPT_OPEN = QWEN_PROMPT_THINKING + "<think>\n"
QWEN_PROMPT_NO_THINKING = QWEN_PROMPT_THINKING + "<think>\n\n</think>\n\n"


def streamed(parser, text: str, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = stream.delta(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def check_every_split(parser, text: str, reasoning: str | None, content: str | None) -> None:
    """The finished parse, then the text streamed char by char and cut in two at every point."""
    assert parser.extract(text) == (reasoning, content)
    expected = (reasoning or "", content or "")
    assert streamed(parser, text, list(text) + [""]) == expected
    for cut in range(len(text) + 1):
        assert streamed(parser, text, [text[:cut], text[cut:]]) == expected, cut


@pytest.mark.parametrize("prompt", [None, QWEN_PROMPT_THINKING])
def test_qwen3_reply_that_opens_think(prompt):
    parser = Qwen3ReasoningParser(TOK, prompt=prompt)
    check_every_split(parser, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis.")


def test_qwen3_prompt_opened_think():
    parser = Qwen3ReasoningParser(TOK, prompt=QWEN_PROMPT_OPEN)
    check_every_split(parser, "Let me see.</think>Paris.", "Let me see.", "Paris.")
    check_every_split(parser, "Still thinking <th", "Still thinking <th", None)  # never closed: all reasoning
    # Without the prompt, extract reads a closing tag with no opening one as the same thing.
    assert Qwen3ReasoningParser(TOK).extract("Let me see.</think>Paris.") == ("Let me see.", "Paris.")


def test_qwen3_without_reasoning():
    parser = Qwen3ReasoningParser(TOK, prompt=QWEN_PROMPT_THINKING)
    check_every_split(parser, "  Paris is the capital.", None, "  Paris is the capital.")
    check_every_split(parser, "<thinking is fine", None, "<thinking is fine")
    assert Qwen3ReasoningParser(TOK).extract("Paris.") == (None, "Paris.")
    off = Qwen3ReasoningParser(TOK, chat_template_kwargs={"enable_thinking": False}, prompt=QWEN_PROMPT_NO_THINKING)
    check_every_split(off, "<think>x</think>Paris.", None, "<think>x</think>Paris.")
    assert off.reasoning_end_token_ids() is None
    assert Qwen3ReasoningParser(TOK).reasoning_end_token_ids() == [ord(c) for c in "</think>"]
    assert Qwen3ReasoningParser(TOK, prompt=QWEN_PROMPT_NO_THINKING).prompt_opens_reasoning() is False


def test_deepseek_r1_everything_before_the_close_is_reasoning():
    parser = DeepSeekR1ReasoningParser(TOK)
    check_every_split(parser, "Hmm, 2+2.</think>\n\n4", "Hmm, 2+2.", "\n\n4")
    check_every_split(parser, "<think>Hmm.</think>4", "Hmm.", "4")
    check_every_split(parser, "Hmm, never closed", "Hmm, never closed", None)
    off = DeepSeekR1ReasoningParser(TOK, chat_template_kwargs={"enable_thinking": False})
    assert off.extract("4") == (None, "4")


HARMONY_REPLY = (
    "<|channel|>analysis<|message|>User asks weather. Use tool.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris","days":2}'
)
CALL_SEGMENT = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":2}<|call|>'
)


def test_harmony_messages():
    messages = parse_harmony(HARMONY_CALL + "<|call|>")
    assert [(m.channel, m.recipient, m.content_type, m.done, m.ended_by) for m in messages] == [
        ("analysis", None, None, True, "<|end|>"),
        ("commentary", "functions.get_weather", "json", True, "<|call|>"),
    ]
    assert messages[1].function_name == "get_weather" and messages[1].text == '{"city":"Paris","days":2}'
    # The recipient in the role part, the type without <|constrain|>; plain text reads as final.
    other = parse_harmony("<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>")
    assert (other[0].recipient, other[0].content_type) == ("functions.f", "json")
    assert [(m.channel, m.text) for m in parse_harmony("just text")] == [("final", "just text")]
    assert parse_harmony("<|channel|>analysis<|message|>cut<|start|>assistant<|chan")[0].text == "cut"


def test_gpt_oss_reasoning_and_content():
    parser = GptOssReasoningParser(TOK)
    assert parser.needs_special_tokens
    check_every_split(parser, HARMONY_REPLY, "User asks weather. Use tool.", "It is sunny in Paris.")
    check_every_split(parser, HARMONY_REPLY + "<|return|>", "User asks weather. Use tool.", "It is sunny in Paris.")
    # A call stays in the content as harmony text, for the openai tool parser.
    check_every_split(parser, HARMONY_CALL, "Need the weather.", CALL_SEGMENT)
    check_every_split(parser, "<|channel|>analysis<|message|>only thinking", "only thinking", None)
    assert parser.reasoning_end_token_ids() == [ord(c) for c in "<|channel|>final<|message|>"]


def test_openai_tool_parser_reads_calls_from_both_texts():
    parser = TOOL_PARSERS["openai"]()
    assert isinstance(parser, OpenAIToolParser)
    _, content = GptOssReasoningParser(TOK).extract(HARMONY_CALL)
    for text in (content, HARMONY_CALL, HARMONY_CALL + "<|call|>"):
        body, calls = parser.parse(text)
        assert body is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 2})
        ]
    assert parser.parse("Sunny.") == ("Sunny.", [])
    preamble = "I'll check.<|channel|>commentary to=functions.f<|message|>{}<|call|>"
    body, calls = parser.parse(preamble)
    assert body == "I'll check." and calls[0].name == "f" and calls[0].arguments == "{}"
    # Streaming: content up to the first marker; a call's arguments grow as a prefix of the final ones.
    assert parser.content_end("I'll check.<|chan") == len("I'll check.")
    assert parser.content_end("I'll check.<|channel|>commentary") == len("I'll check.")
    view = parser.stream_view(CALL_SEGMENT[:-20])
    assert view.content_end == 0 and view.calls[0].name == "get_weather"
    assert '{"city":"Paris","days":2}'.startswith(view.calls[0].arguments)
    assert parser.complete_calls(CALL_SEGMENT[:-8]) == [] and len(parser.complete_calls(CALL_SEGMENT)) == 1


def test_registry():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "gpt_oss"}


class ListMatcher:
    """A stand-in for xgrammar's matcher: accepts exactly ``sentence``, then terminates."""

    def __init__(self, sentence: list[int]) -> None:
        self.sentence, self.position = sentence, 0

    def accept_token(self, token: int) -> bool:
        if self.position < len(self.sentence) and self.sentence[self.position] == token:
            self.position += 1
            return True
        return False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].zero_()
        if self.position < len(self.sentence):
            token = self.sentence[self.position]
            bitmask[index, token // 32] = 1 << (token % 32)

    def rollback(self, num_tokens: int) -> None:
        self.position -= num_tokens

    def is_terminated(self) -> bool:
        return self.position == len(self.sentence)

    def fork(self) -> ListMatcher:
        child = ListMatcher(self.sentence)
        child.position = self.position
        return child


def test_gated_matcher_starts_after_the_sequence_and_rolls_back_across_it():
    gate = GatedMatcher(ListMatcher([7, 8]), [3, 4])
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    for token in [1, 3, 9, 3]:  # a partial start sequence does not open the gate
        gate.fill_next_token_bitmask(bitmask, 0)
        assert bitmask[0, 0].item() == -1
        assert gate.accept_token(token)
    assert gate.accept_token(4) and gate.started and not gate.is_terminated()
    gate.fill_next_token_bitmask(bitmask, 0)
    assert bitmask[0, 0].item() == 1 << 7
    assert not gate.accept_token(9)  # the grammar applies now
    child = gate.fork()
    assert gate.accept_token(7) and gate.accept_token(8) and gate.is_terminated()
    assert not child.is_terminated() and child.accept_token(7)  # the fork has its own state
    gate.rollback(3)  # 8, 7 and the 4 that opened the gate
    assert not gate.started and gate.free_token_ids == [1, 3, 9, 3]
    assert gate.accept_token(4) and gate.accept_token(7)
    with pytest.raises(ValueError):
        gate.rollback(10)


def test_gated_matcher_with_an_optional_opening():
    """The first token opens the free part (then the start sequence starts the grammar) or is the grammar's."""
    gate = GatedMatcher(ListMatcher([7, 40]), [3], optional_open_token_id=33)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    gate.fill_next_token_bitmask(bitmask, 0)
    assert bitmask[0].tolist() == [1 << 7, 1 << 1]  # the grammar's first token, or the opening (33 = 32 + 1)
    assert gate.accept_token(7) and gate.started and gate.free_token_ids == []  # answered at once
    gate.fill_next_token_bitmask(bitmask, 0)
    assert bitmask[0].tolist() == [0, 1 << 8]
    gate.rollback(1)  # undecided again
    assert gate.undecided and not gate.accept_token(9)  # neither the opening nor the grammar's
    assert gate.undecided and gate.accept_token(33) and not gate.started  # the free part opened
    gate.fill_next_token_bitmask(bitmask, 0)
    assert bitmask[0].tolist() == [-1, -1]
    assert gate.accept_token(7) and gate.accept_token(3) and gate.started and gate.accept_token(7)
    child = gate.fork()
    gate.rollback(3)
    assert gate.free_token_ids == [33] and not gate.started and not gate.undecided
    gate.rollback(1)
    assert gate.undecided
    assert child.started and child.accept_token(40) and child.is_terminated()


def test_constraint_after_reasoning_per_parser():
    spec = StructuredOutputsParams(choice=["a", "b"])
    think, end = [ord(c) for c in "<think>"], [ord(c) for c in "</think>"]
    opened = constraint_after_reasoning(spec, Qwen3ReasoningParser(TOK, prompt=QWEN_PROMPT_OPEN))
    assert (opened.start_after_token_ids, opened.optional_open_token_id) == (end, None)
    assert Qwen3ReasoningParser(TOK, prompt=QWEN_PROMPT_THINKING).reasoning_open_token_ids() == think
    # A one-token opening makes the reasoning optional; a longer one cannot, so reasoning is required.
    one_token = Qwen3ReasoningParser(TOK, prompt=QWEN_PROMPT_THINKING)
    one_token.reasoning_open_token_ids = lambda: [5]
    assert constraint_after_reasoning(spec, one_token).optional_open_token_id == 5
    assert constraint_after_reasoning(
        spec, Qwen3ReasoningParser(TOK, prompt=QWEN_PROMPT_THINKING)
    ) == StructuredOutputsParams(choice=["a", "b"], start_after_token_ids=end)
    off = Qwen3ReasoningParser(TOK, chat_template_kwargs={"enable_thinking": False})
    assert constraint_after_reasoning(spec, off) is spec
    assert constraint_after_reasoning(None, DeepSeekR1ReasoningParser(TOK)) is None
    assert constraint_after_reasoning(spec, DeepSeekR1ReasoningParser(TOK)).start_after_token_ids == end
    with pytest.raises(ValueError, match="needs start_after_token_ids"):
        StructuredOutputsParams(choice=["a"], optional_open_token_id=5)
