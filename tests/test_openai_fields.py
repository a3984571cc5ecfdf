"""Every field of OpenAI's request schemas is implemented or refused with a 400 naming it; unknown
fields are ignored with a logged warning. Also: logit_bias, prompt_logprobs (against transformers),
echo + logprobs + max_tokens 0, priority scheduling, and the server flags --chat-template,
--response-role, --root-path and --tokenizer."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import pytest
import torch
from conftest import assert_no_leaks
from test_server import (
    MODEL,
    ServerThread,
    assert_error,
    build_tiny_model,
    engine_args,
    free_port,
    serving,
    wait_idle,
)

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core import Scheduler
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.http_limits import server_config
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

MESSAGES = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# OpenAI's request fields (the API reference's CreateCompletionRequest / CreateChatCompletionRequest):
# (field, a value, expected status); a 400 must name the field (or the field named instead of a status).
COMPLETION_FIELDS = [
    ("model", MODEL, 200), ("prompt", "Hi", 200), ("best_of", 2, 200), ("echo", True, 200),
    ("frequency_penalty", 0.5, 200), ("logit_bias", {"5": 3.0}, 200), ("logprobs", 2, 200), ("max_tokens", 3, 200),
    ("n", 2, 200), ("presence_penalty", 0.5, 200), ("seed", 7, 200), ("stop", ["x"], 200), ("stream", False, 200),
    ("stream_options", {"include_usage": True}, 400),  # only with stream: OpenAI refuses it otherwise, see below
    ("suffix", "tail", 400), ("temperature", 0.5, 200), ("top_p", 0.9, 200), ("user", "u-1", 200),
]
CHAT_FIELDS = [
    ("messages", MESSAGES, 200), ("model", MODEL, 200), ("audio", {"voice": "alloy", "format": "wav"}, 400),
    ("frequency_penalty", 0.5, 200), ("function_call", "auto", 400), ("functions", [{"name": "f"}], 400),
    ("logit_bias", {"5": 3.0}, 200), ("logprobs", True, 200), ("max_completion_tokens", 3, 200),
    ("max_tokens", 3, 200), ("metadata", {"k": "v"}, 400), ("modalities", ["text"], 200),
    ("modalities", ["text", "audio"], 400), ("n", 2, 200), ("parallel_tool_calls", False, 200),
    ("prediction", {"type": "content", "content": "x"}, 400), ("presence_penalty", 0.5, 200),
    ("prompt_cache_key", "k", 200), ("reasoning_effort", "low", 200), ("reasoning_effort", "extreme", 400),
    ("response_format", {"type": "json_object"}, 200), ("safety_identifier", "s-1", 200), ("seed", 7, 200),
    ("service_tier", "auto", 200), ("service_tier", "flex", 400), ("stop", "x", 200), ("store", False, 200),
    ("store", True, 400), ("stream", False, 200), ("stream_options", {"include_usage": True}, 400),
    ("temperature", 0.5, 200), ("tool_choice", "none", 200),
    ("tools", [TOOL], "tool_choice"),  # the default tool_choice, "auto", needs the server's flags
    ("top_logprobs", 2, 400),  # needs logprobs
    ("top_p", 0.9, 200), ("user", "u-1", 200), ("verbosity", "low", 400),
    ("web_search_options", {}, 400),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-fields"))
    build_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(build_app(engine_args(model_dir, num_kv_blocks=64), served_model_name=MODEL)) as running:
        yield running


def test_the_field_tables_cover_every_declared_openai_field():
    for table, model in ((COMPLETION_FIELDS, CompletionRequest), (CHAT_FIELDS, ChatCompletionRequest)):
        for name, _, _ in table:
            assert name in model.model_fields, name  # declared: never dropped as an unknown field


@pytest.mark.parametrize("path, name, value, status", [
    ("/v1/completions", *row) for row in COMPLETION_FIELDS] + [("/v1/chat/completions", *row) for row in CHAT_FIELDS])
def test_each_openai_field_is_implemented_or_refused(http, path, name, value, status):
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    body = {"model": MODEL, "max_tokens": 3, **base, name: value}
    if name == "stream_options" and status == 400:
        response = http.post(path, json=body)
        assert_error(response, 400, "stream_options", "stream")
        body["stream"] = True
        status = 200
    response = http.post(path, json=body)
    if isinstance(status, str):
        assert_error(response, 400, status)
    elif status == 400:
        assert_error(response, 400, name)
    else:
        assert response.status_code == 200, response.text
    wait_idle(http)


def test_unknown_fields_are_ignored_with_a_warning(http, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedllm.api"):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                      "frobnicate": 1, "extra_thing": "x"})
    assert response.status_code == 200
    assert any("ignoring unknown field(s): extra_thing, frobnicate" in r.getMessage() for r in caplog.records)


def test_chat_echo_and_continuous_usage(http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True, "ignore_eos": True}
    reply = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert reply["role"] == "assistant" and reply["content"].startswith("Well,")
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=stream_body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["content"] == "Well,"
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 3
    assert all(c["usage"] is not None for c in chunks)


def test_logit_bias_steers_the_choice(http, server):
    target = 42
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(target): 100}}
    tokens = http.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [server.engine.tokenizer.decode([target])] * 4
    assert_error(http.post("/v1/completions", json={**body, "logit_bias": {"99999": 1}}), 400, "logit_bias")
    assert_error(http.post("/v1/completions", json={**body, "logit_bias": {"5": 101}}), 400, "logit_bias")


def hf_prompt_logprobs(model_dir: str, token_ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, token_ids[i]].item() for i in range(1, len(token_ids))]


def test_prompt_logprobs_equal_transformers(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64, device="cpu", dtype="float32", num_threads=1)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, temperature=0)
    # Twice: the second request's prompt is in the prefix cache, which prompt logprobs must not use.
    for _ in range(2):
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        ids = output.prompt_token_ids
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(ids)
        expected = hf_prompt_logprobs(model_dir, ids)
        got = [entry[token] for entry, token in zip(output.prompt_logprobs[1:], ids[1:])]
        assert got == pytest.approx(expected, abs=1e-4)
        assert all(3 <= len(entry) <= 4 for entry in output.prompt_logprobs[1:])
    assert_no_leaks(llm)


def test_echo_logprobs_max_tokens_zero_scores_the_prompt(http, model_dir):
    prompt = "Once upon a time there was a small model"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    reply = http.post("/v1/completions", json=body).json()
    choice = reply["choices"][0]
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["tokens"]) == len(ids) and reply["usage"]["completion_tokens"] == 0
    assert logprobs["token_logprobs"][1:] == pytest.approx(hf_prompt_logprobs(model_dir, ids), abs=1e-4)
    # With one generated token (lm-eval's request): the prompt's logprobs, then the new token's.
    one = http.post("/v1/completions", json={**body, "max_tokens": 1}).json()["choices"][0]
    assert one["logprobs"]["token_logprobs"][:-1] == logprobs["token_logprobs"]
    assert len(one["logprobs"]["tokens"]) == len(ids) + 1 and one["text"].startswith(prompt)
    # Streamed: the same logprobs, the prompt's first.
    with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 1, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == one["logprobs"]["token_logprobs"]
    # vLLM's prompt_logprobs field.
    vllm = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                              "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    assert vllm[1][str(ids[1])]["logprob"] == pytest.approx(logprobs["token_logprobs"][1], abs=1e-5)
    assert_error(http.post("/v1/completions", json={**body, "echo": False}), 400, "max_tokens")


def test_priority_orders_admission_and_preemption():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, CacheConfig(block_size=4, enable_prefix_caching=False), 6, 0)
    groups = []
    for i, priority in enumerate([5, 0, 5, -1]):
        group = SequenceGroup(f"r{i}", [Sequence(i, [1, 2, 3, 4, 5, 6, 7, 8], 4)], SamplingParams(max_tokens=20),
                              arrival_time=100.0 + i, priority=priority)
        groups.append(group)
        scheduler.add_seq_group(group)
    assert [g.request_id for g in scheduler.waiting] == ["r3", "r1", "r0", "r2"]
    out = scheduler.schedule()  # 2 blocks each: the three most urgent fit
    assert [g.request_id for g in out.scheduled_seq_groups] == ["r3", "r1", "r0"]
    for group in out.scheduled_seq_groups:
        seq = group.seqs[0]
        seq.num_computed_tokens = seq.get_len()
        seq.append_token(9, 0.0)
    out = scheduler.schedule()  # every sequence needs a third block: the least urgent (r0) yields
    assert [g.request_id for g in out.scheduled_seq_groups] == ["r3", "r1"]
    assert groups[0].seqs[0].status == SequenceStatus.WAITING
    assert [g.request_id for g in scheduler.waiting] == ["r0", "r2"]


def test_priority_in_llm_and_server(model_dir, http):
    llm = LLM(model_dir, num_kv_blocks=64, device="cpu", dtype="float32", num_threads=1, max_num_seqs=1)
    outputs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[2, 1, 0])
    order = sorted(outputs, key=lambda o: o.metrics.first_scheduled_time)
    assert [o.prompt for o in order] == ["c", "b", "a"]
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                              "priority": -3}).status_code == 200
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "priority": "high"}), 400,
                 "priority")


def test_chat_template_response_role_root_path_and_tokenizer(model_dir, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[bot] {% endif %}")
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    model_copy = tmp_path / "model"
    shutil.copytree(model_dir, model_copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_copy / name).exists():
            shutil.move(model_copy / name, tokenizer_dir / name)
    args = engine_args(str(model_copy), num_kv_blocks=16, tokenizer=str(tokenizer_dir))
    app = build_app(args, served_model_name=MODEL, chat_template=str(template), response_role="bot",
                    trust_request_chat_template=True)
    # What run_server does with --root-path /llm.
    config = server_config(app, host="127.0.0.1", port=free_port(), log_level="warning", root_path="/llm")
    with ServerThread(app, config) as running, httpx.Client(base_url=running.url, timeout=60) as c:
        def rendered(**extra) -> str:
            ids = c.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, **extra}).json()["tokens"]
            return c.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]

        assert rendered() == "[user] Hello\n[bot] "
        assert rendered(chat_template="<{{ messages[0].content }}>", add_generation_prompt=False) == "<Hello>"
        reply = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).json()
        assert reply["choices"][0]["message"]["role"] == "bot"
        chunks = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                      "stream": True}).text
        assert '"role":"bot"' in chunks.replace(" ", "")
        # The proxy strips /llm: routes answer as before; links and docs carry the prefix.
        assert c.get("/v1/models").status_code == 200 and c.get("/health").status_code == 200
        assert c.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        build_app(args, chat_template="/no/such/file.jinja")
