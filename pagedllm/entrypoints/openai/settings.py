"""The server's settings, gathered by the command line (serve_cli) and read by run_server."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.config import EngineArgs
from pagedllm.distributed.data_parallel import DataParallelConfig
from pagedllm.entrypoints.openai import defaults


@dataclass(slots=True)
class ServerSettings:
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] | None = None
    max_request_bytes: int = defaults.DEFAULT_MAX_REQUEST_BYTES
    max_prompts_per_request: int = defaults.DEFAULT_MAX_PROMPTS_PER_REQUEST
    timeout_keep_alive: float = defaults.DEFAULT_TIMEOUT_KEEP_ALIVE
    timeout_headers: float = defaults.DEFAULT_TIMEOUT_HEADERS
    timeout_body: float = defaults.DEFAULT_TIMEOUT_BODY
    limit_concurrency: int = defaults.DEFAULT_LIMIT_CONCURRENCY
    log_level: str = "info"
    log_requests: bool = True
    shutdown_timeout: float = 10.0
    # Chat: a template (file or text) instead of the tokenizer's, the role replies carry, tool calls.
    chat_template: str | None = None
    response_role: str = "assistant"
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # The path prefix a proxy in front of the server strips (FastAPI's root_path).
    root_path: str = ""
    # Engine replicas on Ray behind this one front end (--data-parallel-size, ...); the default: one engine here.
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
