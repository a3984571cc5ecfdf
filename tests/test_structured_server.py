"""Structured outputs over HTTP with the official openai client: response_format, vLLM's guided_*
fields and structured_outputs object, streaming and not; bad constraints are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from test_server import MODEL, ServerThread, assert_error, build_tiny_model, engine_args, serving, wait_idle

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-structured"))
    build_tiny_model(path)
    with serving(build_app(engine_args(path), served_model_name=MODEL)) as running:
        yield running


def test_default_model_json_schema_answers_validate_streamed_and_not():
    """16 prompts with the embedded default model, each asked streaming and not, all in one batch."""
    # Float activations: the two copies of a prompt are cut into different chunks (they arrive at
    # different times), and int8 rounding of activations can turn such summation-order differences
    # into another greedy token; this test is about streaming and grammars, not that.
    app = build_app(EngineArgs(num_kv_blocks=256, device="cpu", num_threads=2, int8_activations=False),
                    served_model_name="default")
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    prompts = [f"Invent person number {i}. Reply with JSON: a name and an age." for i in range(16)]
    with ServerThread(app) as running:
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=600)

        async def whole(prompt: str) -> tuple[str, str]:
            reply = await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0,
                response_format=response_format)
            return reply.choices[0].message.content, reply.choices[0].finish_reason

        async def streamed(prompt: str) -> tuple[str, str]:
            parts, finish = [], None
            async for chunk in await client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0,
                    response_format=response_format, stream=True):
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            return "".join(parts), finish

        async def main():
            return await asyncio.gather(*[whole(p) for p in prompts], *[streamed(p) for p in prompts])

        results = asyncio.run(main())
        engine = app.state.async_engine.engine
        assert engine.get_stats()["grammar_cache_misses"] == 1  # one schema, compiled once
        assert engine.scheduler.block_manager.all_free()
    for text, finish in results:
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), PERSON)
    assert [t for t, _ in results[:16]] == [t for t, _ in results[16:]]  # streamed text == whole text


def test_regex_and_choice_constrain_every_sample(client, http):
    reply = client.completions.create(model=MODEL, prompt="Number:", n=4, max_tokens=16, temperature=1.2, seed=5,
                                      extra_body={"guided_regex": "[0-9]{2,3}(cm|km)"})
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert re.fullmatch("[0-9]{2,3}(cm|km)", choice.text), choice.text
    choices = ["alpha", "beta gamma", "delta"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], n=4,
                                           max_tokens=16, temperature=1.2, seed=5,
                                           extra_body={"structured_outputs": {"choice": choices}})
    for choice in reply.choices:
        assert choice.message.content in choices
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], n=4,
                                            max_tokens=16, temperature=1.2, seed=6, stream=True,
                                            extra_body={"guided_choice": choices})
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert len(texts) == 4 and all(text in choices for text in texts.values())
    wait_idle_free(http)


def test_json_object_and_grammar(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                           max_tokens=200, temperature=0, response_format={"type": "json_object"})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # a random model may ramble inside the object until max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=10, temperature=1.0, seed=1,
                                      extra_body={"guided_grammar": 'root ::= "<" [0-9] [0-9]? ">"'})
    assert re.fullmatch("<[0-9]{1,2}>", reply.choices[0].text)


@pytest.mark.parametrize("body, param, contains", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", "Type should be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json", "minimum greater"),
    ({"guided_regex": "(ab"}, "guided_regex", "regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "EBNF"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", ""),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
])
def test_bad_constraints_are_400_naming_the_field(http, body, param, contains):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        assert_error(http.post(path, json={**base, "max_tokens": 4, **body}), 400, param=param, contains=contains)
    wait_idle_free(http)


def test_huge_schema_and_structured_next_to_free_requests(client, http):
    huge = {"type": "object", "properties": {f"k{i}": {"type": "boolean"} for i in range(300)}, "required": ["k0"]}

    async def main():
        aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="none", max_retries=0, timeout=120)
        constrained = [aclient.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=12, temperature=0,
                                                  extra_body={"guided_regex": "[a-z]{3,8}"}) for i in range(4)]
        free = [aclient.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True}) for i in range(4)]
        big = aclient.completions.create(model=MODEL, prompt="big", max_tokens=12, temperature=0,
                                         extra_body={"guided_json": huge})
        return await asyncio.gather(*constrained, *free, big)

    results = asyncio.run(main())
    for reply in results[:4]:
        assert re.fullmatch("[a-z]{3,8}", reply.choices[0].text)
    for reply in results[4:8]:
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
    assert results[8].choices[0].text.startswith("{")
    wait_idle_free(http)


def wait_idle_free(http: httpx.Client) -> None:
    wait_idle(http)
