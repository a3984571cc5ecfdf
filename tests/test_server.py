"""The OpenAI-compatible server, driven over HTTP by the official `openai` client and raw httpx.

One server per module (a tiny random Llama next to a small byte-level BPE tokenizer with a ChatML
template), started with uvicorn in a thread on a free loopback port. Tests that break a server
(engine failure, SIGTERM) start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

API_KEY = "sk-test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, this is a tiny test corpus for a tokenizer.",
    "Once upon a time there was a small model that served requests over HTTP.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tiny_model(path: str, extra_tokens: tuple[str, ...] = ()) -> None:
    """``extra_tokens``: added (not special) tokens, one id each (a format's markers, such as <tool_call>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_tokens(list(extra_tokens))
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=len(tokenizer), initializer_range=0.2, max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_args(model_dir: str, **overrides) -> EngineArgs:
    settings_ = dict(model=model_dir, num_kv_blocks=160, device="cpu", dtype="float32", max_num_seqs=64, num_threads=2)
    settings_.update(overrides)
    return EngineArgs(**settings_)


class ServerThread:
    """uvicorn serving an app in a background thread, on a free loopback port."""

    def __init__(self, app, config: uvicorn.Config | None = None) -> None:
        self.app = app
        if config is None:
            config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", access_log=False,
                                    timeout_graceful_shutdown=5)
        self.port = config.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@contextlib.contextmanager
def serving(app, api_key: str | None = None):
    """The app served in a thread, with an openai client and an httpx client pointed at it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with ServerThread(app) as running, httpx.Client(base_url=running.url, headers=headers, timeout=120) as http:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=120)
        yield SimpleNamespace(url=running.url, app=app, engine=app.state.async_engine.engine, client=client,
                              http=http)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    app = build_app(engine_args(model_dir), served_model_name=MODEL, api_key=API_KEY,
                    max_request_bytes=MAX_REQUEST_BYTES)
    with ServerThread(app) as running:
        yield SimpleNamespace(url=running.url, app=app, engine=app.state.async_engine.engine)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    pattern = rf"^pagedllm:{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    values = [float(v) for v in re.findall(pattern, text, re.MULTILINE)]
    assert values, f"no metric pagedllm:{name} in /metrics"
    return sum(values)


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> None:
    """Until /metrics shows nothing running or waiting and no KV block in use."""
    deadline = time.time() + timeout
    while True:
        running, waiting = metric(http, "num_requests_running"), metric(http, "num_requests_waiting")
        used = metric(http, "num_gpu_blocks_used")
        if running == waiting == used == 0:
            return
        assert time.time() < deadline, f"not idle: running={running} waiting={waiting} blocks_used={used}"
        time.sleep(0.05)


def assert_error(response: httpx.Response, status: int, param: str | None = "?", contains: str = "") -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param != "?":
        assert error["param"] == param, error
    assert contains in error["message"], error
    return error


GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


# ----------------------------------------------------------------------------- basic endpoints


def test_models_health_version(client, http, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    # Probes and scrapers need no key.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_tokenize_detokenize(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tokens["count"]
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens", "vocabulary")
    assert_error(http.post("/tokenize", json={}), 400)


# ----------------------------------------------------------------------------- completions


def stream_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str | None], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finish, "finish_reason sent twice"
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def test_completion_streamed_text_equals_non_streamed(client):
    kwargs = dict(prompt="Once upon a time", max_tokens=24, extra_body=NO_EOS, **GREEDY)
    full = client.completions.create(model=MODEL, **kwargs)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == MODEL and full.id.startswith("cmpl-")
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    texts, finish, _ = stream_completion(client, **kwargs)
    assert texts == {0: choice.text} and finish == {0: "length"}


def test_completion_n2_stream_indices_and_seed(client):
    kwargs = dict(prompt="Hello world", max_tokens=10, n=2, temperature=1.0, seed=1234, extra_body=NO_EOS)
    texts, finish, _ = stream_completion(client, **kwargs)
    assert set(texts) == {0, 1} and finish == {0: "length", 1: "length"}
    full = client.completions.create(model=MODEL, **kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage.completion_tokens == 20
    again = client.completions.create(model=MODEL, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in full.choices]  # same seed, same text
    assert {0: full.choices[0].text, 1: full.choices[1].text} == texts


def test_completion_logprobs(client):
    full = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6, logprobs=3,
                                     extra_body=NO_EOS, **GREEDY)
    logprobs = full.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == full.choices[0].text or "\ufffd" in full.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 4  # tokens with equal text share a key
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    _, _, chunks = stream_completion(client, prompt="The quick", max_tokens=6, logprobs=3, extra_body=NO_EOS,
                                     **GREEDY)
    streamed = [lp for c in chunks for ch in c.choices if ch.logprobs for lp in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(logprobs.token_logprobs, abs=1e-5)


def test_completion_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=30, extra_body=NO_EOS,
                                     **GREEDY).choices[0].text
    # A stop string taken from the middle of the greedy text: the output ends right before it.
    stop = next(base[i : i + 2] for i in range(3, len(base) - 2) if "\ufffd" not in base[i : i + 2])
    expected = base[: base.find(stop)]
    stopped = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=30, stop=[stop],
                                        extra_body=NO_EOS, **GREEDY)
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    texts, finish, _ = stream_completion(client, prompt="Hello world", max_tokens=30, stop=[stop],
                                         extra_body=NO_EOS, **GREEDY)
    assert texts == {0: expected} and finish == {0: "stop"}


def test_completion_include_usage_echo_and_prompt_forms(client, http):
    _, _, chunks = stream_completion(client, prompt="Hello", max_tokens=5, stream_options={"include_usage": True},
                                     extra_body=NO_EOS, **GREEDY)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
    echo = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True, **GREEDY)
    assert echo.choices[0].text.startswith("Hello")
    # A batch of prompts: text, token ids; choices indexed prompt * n + sample.
    ids = http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    batch = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, extra_body=NO_EOS, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == batch.choices[1].text
    assert batch.usage.prompt_tokens == 2 * len(ids)


# ----------------------------------------------------------------------------- chat


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                          extra_body=NO_EOS, **GREEDY)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=NO_EOS,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_logprobs_n_and_stop(client):
    messages = [{"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True,
                                          top_logprobs=2, extra_body=NO_EOS, **GREEDY)
    content = full.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2, seed=7,
                                                 temperature=1.0, stream=True, extra_body=NO_EOS))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, extra_body=NO_EOS,
                                          **GREEDY).choices[0].message.content
    stop = next(base[i : i + 2] for i in range(3, len(base) - 2) if "\ufffd" not in base[i : i + 2])
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stop=stop,
                                             extra_body=NO_EOS, **GREEDY)
    assert stopped.choices[0].message.content == base[: base.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------- load and disconnects


def test_32_concurrent_streams_then_idle(server, http):
    prompts = [f"Request number {i}: once upon a time" for i in range(32)]

    async def main() -> tuple[list[str], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def streamed(prompt: str) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True,
                                                      extra_body=NO_EOS, **GREEDY)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def whole(prompt: str) -> str:
            response = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                        extra_body=NO_EOS, **GREEDY)
            return response.choices[0].text

        texts = await asyncio.gather(*(streamed(p) for p in prompts))
        references = await asyncio.gather(*(whole(p) for p in prompts))
        await aclient.close()
        return list(texts), list(references)

    texts, references = asyncio.run(main())
    assert texts == references and all(texts)
    wait_idle(http)


def test_client_disconnect_aborts_and_frees_blocks(server, http):
    before = metric(http, "generation_tokens_total")
    # As long as the context (256) allows, so that neither request finishes before its client leaves.
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 250, "stream": True, **NO_EOS}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines)]
            assert any(line.startswith("data: {") for line in received)
            assert metric(http, "num_requests_running") == 1
    wait_idle(http)
    # Aborted well before its 250 tokens; nothing keeps generating after the abort.
    generated = metric(http, "generation_tokens_total") - before
    time.sleep(0.2)
    assert metric(http, "generation_tokens_total") - before == generated < 250
    # A non-streaming request whose client times out is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=0.05)
    wait_idle(http)


# ----------------------------------------------------------------------------- errors


def test_error_statuses_and_shapes(server, http, client):
    url = "/v1/completions"
    good = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    for field, value in [("temperature", -1), ("top_p", 2), ("n", 0), ("max_tokens", 0), ("logprobs", 50),
                         ("presence_penalty", 5), ("top_k", 0), ("min_p", 2), ("repetition_penalty", 0),
                         ("min_tokens", 5), ("stop_token_ids", [-1])]:
        assert_error(http.post(url, json={**good, field: value}), 400, field)
    assert_error(http.post(url, json={**good, "n": 10_000}), 400, "n", "max_num_seqs")
    assert_error(http.post(url, json={**good, "seed": 2**70}), 400, "seed")
    # Malformed JSON, wrong types, missing fields.
    assert_error(http.post(url, content=b'{"prompt": "x",', headers={"content-type": "application/json"}), 400,
                 contains="JSON")
    assert_error(http.post(url, json={**good, "max_tokens": "many"}), 400, "max_tokens")
    assert_error(http.post(url, json={**good, "prompt": 5}), 400, "prompt")
    assert_error(http.post(url, json={"model": MODEL}), 400, "prompt")
    assert_error(http.post(url, json=[1, 2]), 400)
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400, "messages")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages")
    assert_error(http.post(url, json={**good, "temperature": float("nan")}.__repr__().replace("'", '"')
                           .replace("nan", "NaN"), headers={"content-type": "application/json"}), 400)
    # Empty prompt, out-of-vocabulary token, prompt too long (both numbers in the message).
    assert_error(http.post(url, json={**good, "prompt": ""}), 400, "prompt", "empty")
    assert_error(http.post(url, json={**good, "prompt": [10**6]}), 400, "prompt")
    error = assert_error(http.post(url, json={**good, "prompt": [5] * 300}), 400)
    assert "300" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    error = assert_error(http.post(url, json={**good, "prompt": [5] * 200, "max_tokens": 100}), 400, "max_tokens")
    assert "300" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    # 401 without the right key, 404 for an unknown model or route, 413 for a body over the limit.
    assert_error(httpx.post(server.url + url, json=good), 401)
    assert_error(httpx.post(server.url + url, json=good, headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert_error(http.post(url, json={**good, "model": "no-such-model"}), 404, "model")
    assert_error(http.get("/v1/no-such-route"), 404)
    big = {**good, "prompt": "x" * (MAX_REQUEST_BYTES + 10)}
    assert_error(http.post(url, json=big), 413)

    def chunked():
        yield json.dumps(big).encode()

    assert_error(http.post(url, content=chunked(), headers={"content-type": "application/json"}), 413)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-3)
    # Still serving, nothing left behind.
    assert http.post(url, json=good).status_code == 200
    assert http.get("/health").status_code == 200
    wait_idle(http)


def test_bad_requests_do_not_disturb_a_good_one(client, http):
    kwargs = dict(prompt="Once upon a time", max_tokens=40, extra_body=NO_EOS, **GREEDY)
    reference = client.completions.create(model=MODEL, **kwargs).choices[0].text
    pieces = []
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        pieces.extend(c.text for c in chunk.choices)
        if len(pieces) in (2, 10, 20):
            assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 999}), 400)
            assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": -1}), 400)
            assert_error(http.post("/v1/completions", content=b"{{", headers={"content-type": "application/json"}),
                         400)
    assert "".join(pieces) == reference


def test_metrics_names(http):
    text = http.get("/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                 "gpu_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_success_total"]:
        assert f"pagedllm:{name}" in text, name
    assert metric(http, "time_to_first_token_seconds_count") > 0
    assert metric(http, "prompt_tokens_total") > 0


def test_metrics_cache_config_info(http):
    text = http.get("/metrics").text
    [labels] = re.findall(r"^pagedllm:cache_config_info\{([^}]*)\} 1\.0$", text, re.MULTILINE)
    for label in ('cache_dtype="auto"', 'cache_storage_dtype="float32"', 'block_size="16"', 'num_gpu_blocks="160"',
                  'num_cpu_blocks="0"', 'kv_bytes_per_token="512"', f'model_name="{MODEL}"'):
        assert label in labels, (label, labels)
    # float32 K and V of 2 layers x 2 KV heads x 16 dims.
    assert metric(http, "kv_cache_bytes_per_token") == 2 * 2 * 2 * 16 * 4
    assert metric(http, "num_gpu_blocks") == 160 and metric(http, "num_cpu_blocks") == 0
    assert metric(http, "kv_cache_pool_bytes") == 160 * 16 * 512


# ----------------------------------------------------------------------------- fuzzing: no 500s

_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12), st.lists(st.integers(-5, 1000), max_size=6), st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
_SMALL_TOKENS = st.one_of(st.integers(-2, 6), _ANY)


# Every field of the request bodies, as the OpenAPI schema declares them (checked against /openapi.json below).
_FIELDS = {
    False: sorted(CompletionRequest.model_json_schema()["properties"]),
    True: sorted(ChatCompletionRequest.model_json_schema()["properties"]),
}


@st.composite
def request_bodies(draw, chat: bool):
    body = {"model": MODEL, "max_tokens": draw(_SMALL_TOKENS)}
    if chat:
        body["messages"] = draw(st.one_of(
            st.just([{"role": "user", "content": "hi"}]),
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x", 3]),
                                            "content": st.one_of(st.text(max_size=8), st.none(), st.integers())}),
                     max_size=3),
            _ANY,
        ))
    else:
        body["prompt"] = draw(st.one_of(st.text(max_size=20), st.lists(st.integers(-3, 500), max_size=8), _ANY))
    for field in draw(st.lists(st.sampled_from(_FIELDS[chat]), max_size=5, unique=True)):
        body[field] = draw(_ANY)
    if isinstance(body.get("max_completion_tokens"), int):
        body["max_completion_tokens"] = body["max_completion_tokens"] % 8
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4  # keep generated work small; huge n is checked in test_error_statuses
    return body


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(request_bodies(chat=False), request_bodies(chat=True)))
def test_fuzzed_bodies_never_500(server, http, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = http.post(path, json=body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text


def test_openapi_schema_lists_the_endpoints(http):
    schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    for name, chat in (("CompletionRequest", False), ("ChatCompletionRequest", True)):
        assert sorted(schema["components"]["schemas"][name]["properties"]) == _FIELDS[chat]
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize", "/detokenize",
                 "/metrics", "/version"]:
        assert path in paths


# ----------------------------------------------------------------------------- failures and shutdown


def test_engine_failure_fails_requests_and_marks_unhealthy(model_dir):
    """build_app alone (no on_engine_dead): the app stays up, unhealthy; run_server exits instead
    (test_hardening.py::test_fatal_engine_failure_ends_the_process)."""
    app = build_app(engine_args(model_dir, num_kv_blocks=32), served_model_name=MODEL)
    engine = app.state.async_engine.engine
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        original_step = engine.step
        calls = {"n": 0}

        def failing_step():
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("simulated kernel failure")
            return original_step()

        engine.step = failing_step
        body = {"prompt": "hi", "max_tokens": 100, **NO_EOS}
        result: dict = {}
        streamer = threading.Thread(
            target=lambda: result.update(text=c.post("/v1/completions", json={**body, "stream": True}).text)
        )
        streamer.start()
        response = c.post("/v1/completions", json=body)
        streamer.join(30)
        # The error says what happened and what to do; the exception's text stays in the log.
        error = assert_error(response, 500, contains="engine failed")
        assert error["code"] == "engine_dead" and "simulated" not in error["message"]
        assert '"error"' in result["text"] and result["text"].rstrip().endswith("data: [DONE]")
        assert "simulated" not in result["text"]
        assert_error(c.get("/health"), 503, contains="engine has failed")
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 500
        assert c.get("/metrics").status_code == 200


def test_sigterm_stops_cleanly_with_streams_in_flight(model_dir):
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.serve_cli", "--model", model_dir,
               "--port", str(port), "--num-kv-blocks", "32", "--device", "cpu", "--dtype", "float32",
               "--num-threads", "1", "--served-model-name", MODEL]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.1)
        body = {"prompt": "hi", "max_tokens": 240, "stream": True, **NO_EOS}
        with httpx.Client(base_url=url, timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and any("shutting down" in line for line in rest)
        assert process.wait(timeout=20) == 0
        log = process.stdout.read()
        assert '"POST /v1/completions" 200' in log  # one line per request
        # The start-up line says where the model's layers run (engine.layer_placement).
        assert re.search(rf"Serving {MODEL} on http://127.0.0.1:{port}; layers: (C\+\+ layer loop|Python layers)", log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_tokenizing_runs_beside_a_step_not_behind_it(model_dir):
    """Prompt tokenization (here /tokenize's) runs on the server's tokenizer thread while the engine
    is in a step: on the engine thread it waited for that step to end."""
    app = build_app(engine_args(model_dir), served_model_name=MODEL)
    engine = app.state.async_engine.engine
    step = engine.step
    in_step, release = threading.Event(), threading.Event()

    def held_step():
        in_step.set()
        release.wait(30)
        return step()

    engine.step = held_step
    with serving(app) as running:
        def complete() -> None:
            with httpx.Client(base_url=running.url, timeout=60) as other:
                other.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3})

        busy = threading.Thread(target=complete)
        busy.start()
        try:
            assert in_step.wait(30)
            started = time.time()
            response = running.http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"})
            assert response.status_code == 200 and response.json()["count"] > 0
            assert time.time() - started < 10 and not release.is_set()
        finally:
            release.set()
            busy.join(60)
        wait_idle(running.http)
