"""The server's settings, gathered by the command line (serve_cli) and read by run_server.

Each field declared with setting() is a `pagedllm serve` flag (``--kebab-case`` of its name, in the --help
group it names); serve_cli.py builds the flags from these fields and ServerSettings back from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.config import SERVER_ARG_GROUPS, EngineArgs, setting
from pagedllm.entrypoints.openai import defaults
from pagedllm.serving.data_parallel import DataParallelConfig

SERVER_GROUP, LIMITS_GROUP, CHAT_GROUP = SERVER_ARG_GROUPS[:3]
LOG_LEVELS = ("debug", "info", "warning", "error")


def tool_parser_names() -> Sequence[str]:
    # The registry imports every tool format; read when the flags are built, not when this module loads.
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def reasoning_parser_names() -> Sequence[str]:
    from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    return sorted(REASONING_PARSERS)


@dataclass(slots=True)
class ServerSettings:
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    host: str = setting("127.0.0.1", SERVER_GROUP, "Address to bind (default loopback only).")
    port: int = setting(8000, SERVER_GROUP, "Port to listen on.")
    api_key: str | None = setting(
        None, SERVER_GROUP, "Require 'Authorization: Bearer KEY' on /v1 routes (or set PAGEDLLM_API_KEY)."
    )
    served_model_name: list[str] | None = setting(
        None, SERVER_GROUP, "Model name(s) clients use (default: the model path)."
    )
    max_request_bytes: int = setting(
        defaults.DEFAULT_MAX_REQUEST_BYTES, LIMITS_GROUP, "Larger request bodies get 413 (default 4 MiB)."
    )
    max_prompts_per_request: int = setting(
        defaults.DEFAULT_MAX_PROMPTS_PER_REQUEST, LIMITS_GROUP,
        "More prompts in one /v1/completions request get 400.", positive=True,
    )
    timeout_keep_alive: float = setting(
        defaults.DEFAULT_TIMEOUT_KEEP_ALIVE, LIMITS_GROUP, "Seconds an idle keep-alive connection stays open.",
        positive=True,
    )
    timeout_headers: float = setting(
        defaults.DEFAULT_TIMEOUT_HEADERS, LIMITS_GROUP,
        "Seconds a connection has to send a request's headers, from opening or from the previous response; then "
        "it is closed (408).",
        positive=True,
    )
    timeout_body: float = setting(
        defaults.DEFAULT_TIMEOUT_BODY, LIMITS_GROUP,
        "Seconds a request has to send its whole body; then 408 and the connection is closed.", positive=True,
    )
    limit_concurrency: int = setting(
        defaults.DEFAULT_LIMIT_CONCURRENCY, LIMITS_GROUP, "Most open connections or requests in flight; beyond, 503.",
        positive=True,
    )
    log_level: str = setting("info", SERVER_GROUP, "How much the server logs.", choices=LOG_LEVELS, parse=str.lower)
    # vLLM's --disable-log-requests sets it False.
    log_requests: bool = setting(
        True, SERVER_GROUP, "A log line per request.", negative_aliases=("--disable-log-requests",)
    )
    shutdown_timeout: float = setting(
        10.0, SERVER_GROUP, "Seconds to wait for connections to close on SIGINT/SIGTERM."
    )
    # Chat: a template (file or text) instead of the tokenizer's, the role replies carry, tool calls.
    chat_template: str | None = setting(
        None, CHAT_GROUP, "A Jinja chat template (a file, or the template text) instead of the tokenizer's."
    )
    # vLLM's flag: a template is a program the server runs, so a request's own is refused by default.
    trust_request_chat_template: bool = setting(
        False, CHAT_GROUP,
        "Render a chat_template sent with a request (/v1/chat/completions, /tokenize) instead of refusing it "
        "with 400. Every template, trusted or not, renders within bounds of output size and time.",
    )
    response_role: str = setting("assistant", CHAT_GROUP, "The role of the replies of /v1/chat/completions.")
    tool_call_parser: str | None = setting(
        None, CHAT_GROUP,
        "How tool calls are read out of replies (tool_choice auto), in the model's format: hermes (Hermes, "
        "Qwen2.5), qwen3_coder, llama3_json (Llama 3.1/3.2 JSON), pythonic (Llama 3.2/4), mistral, deepseek_v3, ...",
        choices=tool_parser_names,
    )
    enable_auto_tool_choice: bool = setting(
        False, CHAT_GROUP, 'Allow tool_choice "auto" (needs --tool-call-parser).'
    )
    reasoning_parser: str | None = setting(
        None, CHAT_GROUP,
        "Read a reasoning model's thinking out of its replies into reasoning_content: qwen3, deepseek_r1 "
        "(<think>...</think>), gpt_oss (harmony's analysis channel).",
        choices=reasoning_parser_names,
    )
    # /v1/responses with store: how many responses the in-memory store keeps (least recently used out).
    responses_store_size: int = setting(
        defaults.DEFAULT_RESPONSES_STORE_SIZE, CHAT_GROUP,
        "How many /v1/responses (store: true) the server keeps in memory for GET and previous_response_id; the "
        "least recently used go first; 0 keeps none.",
    )
    responses_store_max_bytes: int = setting(
        defaults.DEFAULT_RESPONSES_STORE_BYTES, CHAT_GROUP,
        "The most the stored /v1/responses may take in all, as their JSON (e.g. 64MiB, the default); the least "
        "recently used go first, and a response larger than this alone is not stored.", byte_size=True,
    )
    root_path: str = setting(
        "", SERVER_GROUP, "The path prefix a proxy in front of the server strips (FastAPI's root_path; default: none)."
    )
    # Engine replicas on Ray behind this one front end (--data-parallel-size, ...); the default: one engine here.
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
