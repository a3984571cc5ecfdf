"""The server's default limits, in one import-cheap place (the CLI's --help must not load the server).

Documented in docs/guides/server.md (Hardening); each is a `pagedllm serve` flag.
"""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # --max-request-bytes: a larger body gets 413
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024  # --max-prompts-per-request: more prompts in one completion get 400
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0  # --timeout-keep-alive: an idle keep-alive connection is closed
DEFAULT_TIMEOUT_HEADERS = 10.0  # --timeout-headers: a request's headers must be complete by then (else 408, closed)
DEFAULT_TIMEOUT_BODY = 30.0  # --timeout-body: a request's whole body must arrive by then (else 408, closed)
DEFAULT_LIMIT_CONCURRENCY = 512  # --limit-concurrency: open connections / requests in flight before 503
DEFAULT_RESPONSES_STORE_SIZE = 1000  # --responses-store-size: stored /v1/responses kept in memory (LRU)
DEFAULT_RESPONSES_STORE_BYTES = 64 << 20  # --responses-store-max-bytes: their JSON size in all (LRU)
