"""Hostile input the server must answer with an OpenAI-style error and survive: request chat
templates (refused unless trusted, bounded when trusted), a responses store bounded in bytes, a
dashboard key that is not Latin-1, an oversized body sent whole, the Bearer scheme in any case,
out-of-range top_k and priority; and prompt_cache_key reaching the engine front.

One in-process server per module (a tiny random Llama, an API key); the trusted-template test
starts a `pagedllm serve` subprocess, whose memory it reads from /proc.
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_server import API_KEY, CHATML, ServerThread, assert_error, engine_args, free_port, model_dir  # noqa: F401

from pagedllm import SamplingParams
from pagedllm.entrypoints.chat_utils import render_chat_checked
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.template_sandbox import (
    BoundedSandboxedEnvironment,
    TemplateBoundError,
    TemplateLimits,
    template_limits,
)
from pagedllm.sampling_params import MAX_TOP_K

MODEL = "tiny"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# The template that grew a server to 14 GB: one string of a billion characters.
BILLION_AS = "{{ 'a' * 1000000000 }}"
STORE_BYTES = 16 << 20
TEMPLATES = os.path.join(os.path.dirname(__file__), "chat_templates")


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/status")


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811 - test_server's fixture
    app = build_app(engine_args(model_dir, num_kv_blocks=64), served_model_name=MODEL, api_key=API_KEY,
                    responses_store_max_bytes=STORE_BYTES, log_requests=False)
    with ServerThread(app) as running:
        yield SimpleNamespace(url=running.url, port=running.port, app=app)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as client:
        yield client


# ----------------------------------------------------------------------------- request chat templates


def test_a_request_chat_template_is_refused_without_the_trust_flag(server, http):
    before = rss_bytes()
    for body in ({**CHAT, "chat_template": BILLION_AS},
                 {**CHAT, "chat_template_kwargs": {"chat_template": BILLION_AS}}):
        assert_error(http.post("/v1/chat/completions", json=body), 400, "chat_template",
                     "--trust-request-chat-template")
    tokenize = {"model": MODEL, "messages": CHAT["messages"], "chat_template": BILLION_AS}
    assert_error(http.post("/tokenize", json=tokenize), 400, "chat_template", "--trust-request-chat-template")
    assert rss_bytes() - before < 200 << 20
    ok = http.post("/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_a_trusted_request_template_renders_within_bounds(model_dir):  # noqa: F811
    """`serve --trust-request-chat-template`: a request's template renders, a hostile one is a 400 naming the
    bound it passed, before the memory is taken; the server stays small and keeps serving."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_dir, "--port", str(port),
               "--num-kv-blocks", "32", "--device", "cpu", "--dtype", "float32", "--num-threads", "1",
               "--served-model-name", MODEL, "--trust-request-chat-template", "--disable-log-requests"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # warm, then measure
            before = rss_bytes(process.pid)
            hostile = {
                BILLION_AS: "'*' repetition",
                "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}": "output passed its limit",
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}": "time limit",
            }
            for template, bound in hostile.items():
                error = assert_error(client.post("/v1/chat/completions", json={**CHAT, "chat_template": template}),
                                     400, "messages", "rendering bound")
                assert bound in error["message"], error
            assert rss_bytes(process.pid) - before < 300 << 20
            # A sensible template of the request's own is rendered (trusted), and the server still serves.
            echo = client.post("/tokenize", json={"model": MODEL, "messages": CHAT["messages"],
                                                  "chat_template": "{{ messages[0].content }}"})
            assert echo.status_code == 200 and echo.json()["count"] >= 1
            ok = client.post("/v1/chat/completions", json={**CHAT, "chat_template": CHATML})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] is not None
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


HOSTILE_TEMPLATES = [
    ("{{ 'a' * 1000000000 }}", "'*' repetition"),
    ("{{ ['a'] * 100000000 }}", "list of 100000000 items"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~'"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+'"),
    ("{{ '%1000000000s' % 'a' }}", "'%' formatting"),
    ("{{ '{:>1000000000}'.format('a') }}", "format()"),
    ("{{ '{:{}}'.format('a', 1000000000) }}", "format()"),
    ("{{ 'a'.ljust(10 ** 9) }}", "ljust()"),
    ("{{ 'a'|center(1000000000) }}", "'center' filter"),
    ("{{ ('a\\n' * 100000)|indent(1000) }}", "'indent' filter"),
    ("{{ ('a' * 1000000).replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') }}", "replace()"),
    ("{{ [1]|batch(1000000000, 'x')|list }}", "'batch' filter"),
    ("{{ {'a': 1}|tojson(indent=100000000) }}", "indent over"),
    ("{{ 2 ** 100000000 }}", "'**'"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output passed its limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}", "time limit"),
]


@pytest.mark.parametrize("source, bound", HOSTILE_TEMPLATES, ids=[b for _, b in HOSTILE_TEMPLATES])
def test_the_sandbox_refuses_work_past_its_bounds_before_doing_it(source, bound):
    environment = BoundedSandboxedEnvironment()
    before = rss_bytes()
    start = time.monotonic()
    with template_limits(TemplateLimits(timeout_s=0.5)), pytest.raises(TemplateBoundError, match=re.escape(bound)):
        environment.from_string(source).render()
    assert time.monotonic() - start < 3.0
    assert rss_bytes() - before < 100 << 20


def _hf_like(environment_class: type) -> jinja2.Environment:
    """An environment set up as transformers sets up its chat templates' (the filters and globals they use)."""
    environment = environment_class(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    environment.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "26 Jul 2024")
    return environment


def test_real_chat_templates_render_the_same_bounded():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello " * 200}],
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]},
         {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}, {"role": "user", "content": "Thanks"}],
    ]
    plain, bounded = _hf_like(ImmutableSandboxedEnvironment), _hf_like(BoundedSandboxedEnvironment)
    names = sorted(name for name in os.listdir(TEMPLATES) if name.endswith(".jinja"))
    assert names
    for name in names:
        with open(os.path.join(TEMPLATES, name), encoding="utf-8") as handle:
            source = handle.read()
        for messages in conversations:
            for with_tools in (None, tools):
                kwargs = dict(messages=messages, tools=with_tools, add_generation_prompt=True, bos_token="<s>",
                              eos_token="</s>")
                try:
                    expected = plain.from_string(source).render(**kwargs)
                except jinja2.TemplateError as exc:  # the template refuses this conversation: the same way
                    with pytest.raises(type(exc)):
                        bounded.from_string(source).render(**kwargs)
                    continue
                assert bounded.from_string(source).render(**kwargs) == expected, name


def test_the_models_own_template_is_bounded_too(server):
    """The tokenizer's template (and --chat-template's) render through the same bounds as a request's."""
    tokenizer = server.app.state.serving_context.tokenizer
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = BILLION_AS
        with pytest.raises(ValueError, match="rendering bound: .*'\\*' repetition"):
            render_chat_checked(tokenizer, CHAT["messages"])
    finally:
        tokenizer.chat_template = original
    with pytest.raises(ValueError, match="rendering bound"):
        render_chat_checked(tokenizer, CHAT["messages"], chat_template=BILLION_AS)
    with pytest.raises(ValueError, match="over its limit of 100"):
        render_chat_checked(tokenizer, [{"role": "user", "content": "x" * 200}], chat_template=CHATML,
                            limits=TemplateLimits(max_chars=100))
    text, token_ids = render_chat_checked(tokenizer, CHAT["messages"])
    assert "hi" in text and token_ids


# ----------------------------------------------------------------------------- the responses store


def test_the_store_is_bounded_in_bytes():
    store = ResponseStore(max_responses=100, max_bytes=10_000)
    for index in range(10):
        assert store.put(f"r{index}", StoredResponse({"id": f"r{index}", "user": "u" * 3000}, []))
    # Oldest out first: three of ~3 kB fit in 10 kB.
    assert len(store) == 3 and store.num_bytes <= 10_000
    assert [store.get(f"r{i}") is not None for i in (6, 7, 8, 9)] == [False, True, True, True]
    assert not store.put("huge", StoredResponse({"id": "huge", "user": "u" * 20_000}, []))
    assert store.get("huge") is None and store.refused_size("huge") > 10_000 and len(store) == 3
    store.delete("r9")
    assert len(store) == 2 and store.num_bytes == sum(store.get(f"r{i}").size() for i in (7, 8))
    with pytest.raises(ValueError, match="byte limit"):
        ResponseStore(max_bytes=-1)


def test_large_user_fields_do_not_multiply_the_servers_memory(server, http):
    """Responses with a 3.9 MB user field each: the store keeps what its byte bound allows. Python memory
    kept over 30 more of them (traced: RSS in a process that is client too mostly shows the allocator's
    working set) stays near the bound, where keeping them all would take 117 MB."""
    store = server.app.state.serving_responses.store
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    user = "u" * 3_900_000

    def create(count: int) -> list[str]:
        ids = []
        for _ in range(count):
            response = http.post("/v1/responses", json={**body, "user": user})
            assert response.status_code == 200 and response.json()["user"] == user  # accepted, as vLLM does
            ids.append(response.json()["id"])
        return ids

    create(2)
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        ids = create(30)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < STORE_BYTES + (8 << 20), kept
    assert store.num_bytes <= STORE_BYTES and len(store) == STORE_BYTES // 3_900_000
    # The latest are kept; the oldest went first.
    assert http.get(f"/v1/responses/{ids[-1]}").status_code == 200
    assert_error(http.get(f"/v1/responses/{ids[0]}"), 404, None, "by count and by size")
    follow = http.post("/v1/responses", json={**body, "previous_response_id": ids[-1]})
    assert follow.status_code == 200


def test_a_response_larger_than_the_store_is_not_stored_and_says_so(server, http):
    store = server.app.state.serving_responses.store
    store.max_bytes, saved = 1 << 20, store.max_bytes
    try:
        response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                    "user": "u" * 2_000_000})
        assert response.status_code == 200
        response_id = response.json()["id"]
        error = assert_error(http.post("/v1/responses", json={"model": MODEL, "input": "more",
                                                              "previous_response_id": response_id}),
                             404, "previous_response_id", "was not stored")
        assert "--responses-store-max-bytes" in error["message"]
        assert_error(http.get(f"/v1/responses/{response_id}"), 404, None, "was not stored")
    finally:
        store.max_bytes = saved


# ----------------------------------------------------------------------------- keys and bodies


def test_a_dashboard_key_that_is_not_latin1_is_401(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/dashboard?key=%ff", "/dashboard/state?key=%ff", "/dashboard?key=%E2%82%AC",
                     "/dashboard?key=\u20ac"):
            assert_error(client.get(path), 401, None, "API key")
        assert client.get("/dashboard", params={"key": API_KEY}).status_code == 200


def test_the_bearer_scheme_is_case_insensitive(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for value in (f"bearer {API_KEY}", f"BEARER {API_KEY}", f"Bearer  {API_KEY}"):
            assert client.get("/v1/models", headers={"Authorization": value}).status_code == 200, value
        for value in (f"Basic {API_KEY}", f"Bearer{API_KEY}", f"bearer {API_KEY}x", "bearer", API_KEY):
            assert_error(client.get("/v1/models", headers={"Authorization": value}), 401, None, "API key")


def _send_then_read(port: int, head: bytes, body_chunks) -> tuple[int, dict]:
    """Write the whole request first, then read the response: a client that never reads early."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            sock.sendall(chunk)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), json.loads(payload)


def test_an_oversized_body_sent_whole_reads_its_413(server):
    size = 12 << 20  # three times the 4 MiB limit
    body = b'{"prompt": "' + b"a" * (size - 40) + b'", "max_tokens": 1}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    status, payload = _send_then_read(server.port, head, [body])
    assert status == 413 and payload["error"]["code"] == "request_too_large"
    # Chunked, no Content-Length: refused once counted past the limit, then read to its end all the same.
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    piece = b"a" * (1 << 20)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 12 + [b"0\r\n\r\n"]
    status, payload = _send_then_read(server.port, head, chunks)
    assert status == 413 and payload["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ----------------------------------------------------------------------------- ranges


def test_top_k_and_priority_out_of_range_are_400(http):
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for path, base in (("/v1/completions", completion), ("/v1/chat/completions", CHAT)):
        assert_error(http.post(path, json={**base, "top_k": 10**30}), 400, "top_k", str(MAX_TOP_K))
        assert_error(http.post(path, json={**base, "top_k": MAX_TOP_K + 1}), 400, "top_k")
        for priority in (10**30, -(10**30), 2**63):
            assert_error(http.post(path, json={**base, "priority": priority}), 400, "priority")
        # The ends of the ranges are served: a top_k past the vocabulary keeps all of it.
        assert http.post(path, json={**base, "top_k": MAX_TOP_K, "priority": 2**63 - 1}).status_code == 200
        assert http.post(path, json={**base, "priority": -(2**63)}).status_code == 200
    assert_error(http.post("/v1/responses", json={"model": MODEL, "input": "hi", "priority": 10**30}), 400,
                 "priority")
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=10**30)


def test_the_library_refuses_an_out_of_range_priority(server):
    engine = server.app.state.async_engine.engine
    with pytest.raises(ValueError, match="priority must be an integer in"):
        engine.add_request("huge-priority", [5, 6, 7], SamplingParams(max_tokens=1), priority=10**30)
    assert not engine.has_unfinished_requests()


# ----------------------------------------------------------------------------- prompt_cache_key


def test_prompt_cache_key_reaches_the_engine_front(server, http, monkeypatch):
    """Chat and responses hand prompt_cache_key to the engine front's add (where replicas route by it; one
    engine ignores it)."""
    async_engine = server.app.state.async_engine
    original = async_engine.add
    seen: list[str | None] = []

    async def spy(request):
        seen.append(request.cache_key)
        return await original(request)

    monkeypatch.setattr(async_engine, "add", spy)
    assert http.post("/v1/chat/completions", json={**CHAT, "prompt_cache_key": "conversation-7"}).status_code == 200
    response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                "prompt_cache_key": "conversation-8"})
    assert response.status_code == 200 and response.json()["prompt_cache_key"] == "conversation-8"
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert seen == ["conversation-7", "conversation-8", None]
