"""--reasoning-parser on /v1/chat/completions, through the openai client: reasoning_content apart from the
content (streamed and not), tool calls read from the content only, enable_thinking and reasoning_effort
reaching the chat template (Qwen3's and GPT-OSS's own, in tests/chat_templates/), structured outputs
that start after the reasoning, and GPT-OSS's harmony replies with the openai tool parser.

The model is a tiny random Llama; its replies are scripted: the sampler's choice is replaced, token
by token, with the tokens of a given text (after which the model samples on its own).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_server import assert_error, engine_args, serving, wait_idle

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.sampling.sampler import Sampler

TEMPLATES = Path(__file__).parent / "chat_templates"
MODEL = "tiny-reasoner"
HARMONY_SPECIALS = [
    "<|endoftext|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]
CORPUS = [
    "The user asks about the weather in Paris. I should call the tool. It is sunny in Paris today.",
    "analysis commentary final assistant user system developer functions get_weather city json",
    "Hello there! How can I help you? Let me think about it. Reasoning: low medium high",
    '{"city": "Paris", "days": 2} {"city":"Oslo"} 0123456789 abcdefghijklmnopqrstuvwxyz',
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def build_model(path: str, specials: list[str], eos: str, added: list[str], template: str) -> None:
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, bos_token=specials[0], unk_token=specials[0], pad_token=specials[0]
    )
    # Qwen3's <think> and </think> are added tokens that are not special: they stay in decoded text.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)


class Script:
    """The reply the next requests get: these token ids, then whatever the model samples."""

    def __init__(self) -> None:
        self.token_ids: list[int] | None = None


@pytest.fixture(scope="module")
def script():
    state = Script()
    original = Sampler._sample_batch

    def scripted(self, logits, rows, generator, return_full_logprobs):
        output = original(self, logits, rows, generator, return_full_logprobs)
        for i, row in enumerate(rows):
            position = len(row.output_token_ids)
            if state.token_ids is not None and position < len(state.token_ids):
                output.token_ids[i] = state.token_ids[position]
        return output

    mp = pytest.MonkeyPatch()
    mp.setattr(Sampler, "_sample_batch", scripted)
    yield state
    mp.undo()


def reply(running, state: Script, text: str, end: str | None = None) -> None:
    """Script the next replies: ``text`` then ``end`` (the EOS when None)."""
    tokenizer = running.engine.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    state.token_ids = ids + [tokenizer.convert_tokens_to_ids(end) if end else tokenizer.eos_token_id]


def record_prompts(running) -> list[str]:
    """The prompts the chat handler renders from now on (a spy on its render)."""
    chat = running.app.state.serving_chat
    prompts: list[str] = []
    render = chat.render

    def spy(request, tools=None):
        text, ids = render(request, tools)
        prompts.append(text)
        return text, ids

    chat.render = spy
    return prompts


def streamed(client, **kwargs) -> tuple[str, str, dict, str | None]:
    """(reasoning, content, tool calls by index, finish_reason) of a streamed choice 0."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


# ---------------------------------------------------------------------------------------------- qwen3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, script):
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    build_model(
        path,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|im_end|>",
        ["<think>", "</think>"],
        (TEMPLATES / "qwen3.jinja").read_text(),
    )
    app = build_app(
        engine_args(path, num_kv_blocks=256),
        served_model_name=MODEL,
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    with serving(app) as running:
        yield running


THOUGHT = "<think>\nThe user asks about the weather.\n</think>\n\n"


def test_qwen3_reasoning_content_apart_from_content(qwen3, script):
    reply(qwen3, script, THOUGHT + "It is sunny in Paris.")
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=80)
    message = qwen3.client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "\nThe user asks about the weather.\n"
    assert message.reasoning == message.reasoning_content  # vLLM's newer name
    assert message.content == "\n\nIt is sunny in Paris."
    reasoning, content, calls, finish = streamed(qwen3.client, **kwargs)
    assert (reasoning, content, calls, finish) == (message.reasoning_content, message.content, {}, "stop")
    wait_idle(qwen3.http)


def test_qwen3_enable_thinking_off_is_all_content(qwen3, script):
    prompts = record_prompts(qwen3)
    reply(qwen3, script, "<think>not reasoning</think>Hi.")
    kwargs = dict(
        model=MODEL, messages=QUESTION, max_tokens=40, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    message = qwen3.client.chat.completions.create(**kwargs).choices[0].message
    assert prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the template saw it
    assert message.reasoning_content is None and message.content == "<think>not reasoning</think>Hi."
    assert streamed(qwen3.client, **kwargs)[:2] == ("", "<think>not reasoning</think>Hi.")
    # A reply that does not open <think> (the template did not either) is content.
    reply(qwen3, script, "Just an answer.")
    message = qwen3.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=40).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "Just an answer.")


def test_qwen3_tool_calls_come_from_the_content_only(qwen3, script):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="auto", max_tokens=120)
    reply(qwen3, script, "<think>I should call the tool.</think>\n\n" + call)
    choice = qwen3.client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "I should call the tool."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    reasoning, content, calls, finish = streamed(qwen3.client, **kwargs)
    assert reasoning == "I should call the tool." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    # A call written inside the reasoning is not made.
    reply(qwen3, script, "<think>Maybe " + call + "?</think>Sunny.")
    choice = qwen3.client.chat.completions.create(**kwargs).choices[0]
    assert not choice.message.tool_calls and choice.message.content == "Sunny." and choice.finish_reason == "stop"
    assert call in choice.message.reasoning_content


def test_qwen3_structured_output_starts_after_the_reasoning(qwen3, script):
    choices = ["Paris", "Oslo"]
    tokenizer = qwen3.engine.tokenizer
    script.token_ids = tokenizer.encode("<think>Which city? Any.</think>", add_special_tokens=False)  # then free
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=60, temperature=0.0, extra_body={"guided_choice": choices})
    message = qwen3.client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "Which city? Any." and message.content in choices
    reasoning, content, _, finish = streamed(qwen3.client, **kwargs)
    assert (reasoning, content, finish) == (message.reasoning_content, message.content, "stop")
    # The template did not open <think> and the reply does not either: constrained from its first token on
    # (one scripted token, "Paris", and the grammar writes the rest of its sentence).
    sentences = ["Paris is sunny", "Oslo is rainy"]
    script.token_ids = tokenizer.encode("Paris is sunny", add_special_tokens=False)[:1]
    message = qwen3.client.chat.completions.create(**dict(kwargs, extra_body={"guided_choice": sentences}))
    assert (message.choices[0].message.reasoning_content, message.choices[0].message.content) == (
        None,
        "Paris is sunny",
    )
    # A reasoning that never ends leaves the whole reply free: no constraint was applied to it.
    reply(qwen3, script, "<think>Hmm, Lyon or Rome or")
    message = qwen3.client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "Hmm, Lyon or Rome or" and message.content is None
    wait_idle(qwen3.http)


def test_reasoning_request_errors(qwen3):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
    response = qwen3.http.post("/v1/chat/completions", json={**body, "reasoning_effort": "extreme"})
    assert_error(response, 400, "reasoning_effort", "low")
    response = qwen3.http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": "no"}})
    assert_error(response, 400, "chat_template_kwargs", "enable_thinking")


def test_unknown_reasoning_parser_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        build_app(engine_args(str(tmp_path)), reasoning_parser="nope")


# -------------------------------------------------------------------------------------------- gpt_oss


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, script):
    path = str(tmp_path_factory.mktemp("tiny-gpt-oss"))
    build_model(path, HARMONY_SPECIALS, "<|return|>", [], (TEMPLATES / "gpt_oss.jinja").read_text())
    app = build_app(
        engine_args(path, num_kv_blocks=256),
        served_model_name=MODEL,
        reasoning_parser="gpt_oss",
        tool_call_parser="openai",
        enable_auto_tool_choice=True,
    )
    with serving(app) as running:
        yield running


HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>The user asks about the weather.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>I should call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris"}'
)


def test_gpt_oss_analysis_is_reasoning_final_is_content(gpt_oss, script):
    prompts = record_prompts(gpt_oss)
    reply(gpt_oss, script, HARMONY_ANSWER)
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=80, reasoning_effort="low")
    choice = gpt_oss.client.chat.completions.create(**kwargs).choices[0]
    assert "Reasoning: low" in prompts[-1] and prompts[-1].endswith("<|start|>assistant")
    assert choice.message.reasoning_content == "The user asks about the weather."
    assert choice.message.content == "It is sunny in Paris." and choice.finish_reason == "stop"
    assert streamed(gpt_oss.client, **kwargs) == (
        "The user asks about the weather.",
        "It is sunny in Paris.",
        {},
        "stop",
    )
    gpt_oss.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80)
    assert "Reasoning: medium" in prompts[-1]  # the template's default
    wait_idle(gpt_oss.http)


def test_gpt_oss_tool_calls_with_the_openai_parser(gpt_oss, script):
    kwargs = dict(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="auto", max_tokens=120)
    reply(gpt_oss, script, HARMONY_CALL, end="<|call|>")
    choice = gpt_oss.client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "I should call the tool."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    reasoning, content, calls, finish = streamed(gpt_oss.client, **kwargs)
    assert (reasoning, content, finish) == ("I should call the tool.", "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]

    # The round trip: the call, its result and the reasoning go back through GPT-OSS's template.
    prompts = record_prompts(gpt_oss)
    call = choice.message.tool_calls[0]
    history = QUESTION + [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    reply(gpt_oss, script, HARMONY_ANSWER)
    message = (
        gpt_oss.client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=80)
        .choices[0]
        .message
    )
    assert message.content == "It is sunny in Paris."
    assert (
        "<|start|>assistant<|channel|>analysis<|message|>I should call the tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    ) in prompts[-1]
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"' in prompts[-1]
    wait_idle(gpt_oss.http)
