"""The openai client against the server for each new --tool-call-parser (qwen3_coder, mistral, pythonic,
deepseek_v3), each with its model's own chat template: tool_choice auto (the tiny random model is made
to "say" the model's reply with guided_choice), required and named, streamed and not, and the calls sent
back in the next turn with the tools' results."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from test_server import MODEL, ServerThread, engine_args
from test_tool_calls import collect_stream
from tool_parser_cases import (
    CALLS,
    MAX_MODEL_LEN,
    NEW_PARSERS,
    QUESTION,
    REPLIES,
    TEMPLATE_FILES,
    TEMPLATES,
    TIME,
    TOOLS,
    WEATHER,
    build_tool_model,
    calls_of,
)

from pagedllm.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-tool-model"))
    build_tool_model(path)
    return path


@pytest.fixture(scope="module", params=NEW_PARSERS)
def served(request, model_dir):
    name = request.param
    args = engine_args(model_dir, num_kv_blocks=400, max_model_len=MAX_MODEL_LEN)
    app = build_app(args, served_model_name=MODEL, chat_template=str(TEMPLATES / TEMPLATE_FILES[name]),
                    tool_call_parser=name, enable_auto_tool_choice=True)
    with ServerThread(app) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield name, client


def check_id(name: str, call_id: str) -> None:
    if name == "mistral":  # Mistral's templates take back only such ids
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id), call_id
    else:
        assert call_id


def test_auto_reads_the_models_format(served):
    name, client = served
    reply, content = REPLIES[name]
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=400, temperature=0,
                  extra_body={"guided_choice": [reply]})  # makes the random model say the reply
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert calls_of(choice.message.tool_calls) == CALLS
    for call in choice.message.tool_calls:
        check_id(name, call.id)
    streamed_content, calls, finish = collect_stream(client.chat.completions.create(**kwargs, stream=True))
    assert streamed_content == (content or "") and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    for call in calls:
        check_id(name, call["id"])
    # The calls and the tools' results go back in the next turn, rendered by the model's template.
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump(exclude_none=True)
                                                               for c in choice.message.tool_calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": i})}
          for i, c in enumerate(choice.message.tool_calls)),
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40,
                                            temperature=0, extra_body={"guided_choice": ["It is sunny."]})
    assert answer.choices[0].message.content == "It is sunny." and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "stop"


def test_required_and_named_whatever_the_format(served):
    name, client = served
    base = dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=0)
    choice = client.chat.completions.create(**base, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_id(name, call.id)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    content, calls, finish = collect_stream(client.chat.completions.create(
        **base, tool_choice="required", parallel_tool_calls=False, stream=True))
    assert not content and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = client.chat.completions.create(**base, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_time"
    check_id(name, choice.message.tool_calls[0].id)
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), TIME["function"]["parameters"])
    content, calls, finish = collect_stream(client.chat.completions.create(**base, tool_choice=named, stream=True))
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments and finish == "tool_calls"
    assert WEATHER in TOOLS
