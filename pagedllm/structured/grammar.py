"""StructuredOutputsParams -> a compiled xgrammar grammar, cached by the constraint's content."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import StructuredOutputsParams

# Compiling a large schema takes up to a second: keep recent grammars, keyed by their content.
DEFAULT_CACHE_SIZE = 256
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the useful part.
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def cache_key(spec: StructuredOutputsParams) -> tuple[str, str, bool]:
    """The same constraint, however it was spelled (a schema as dict or text, spacing), gives one key.

    Key order stays: a schema's property order is the order the grammar writes them in.
    """
    kind = spec.kind
    if kind == "json":
        schema = parse_schema(spec.json)
        text = json.dumps(schema, separators=(",", ":"))
    elif kind == "choice":
        text = json.dumps(list(spec.choice or []))
    elif kind == "json_object":
        text = ""
    else:
        text = str(getattr(spec, kind))
    return kind, text, spec.disable_any_whitespace


def parse_schema(schema: str | dict | None) -> Any:
    if isinstance(schema, dict):
        return schema
    try:
        return json.loads(schema or "")
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", "structured_outputs") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings."""
    # JSON string escapes are EBNF string-literal escapes; non-ASCII stays as it is.
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def xgrammar_message(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server may compile off the engine thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # Our own cache (keyed by content, with hit counts); xgrammar's would key by the raw text.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._compiling: dict[tuple[str, str, bool], threading.Lock] = {}
        self.cache_hits = 0
        self.cache_misses = 0

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``; a constraint that cannot compile raises InvalidRequestError.

        Requests with the same constraint arriving together wait for one compilation.
        """
        key = cache_key(spec)
        with self._lock:
            compiled = self._cached(key)
            if compiled is not None:
                return compiled
            key_lock = self._compiling.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                compiled = self._cached(key)
                if compiled is not None:
                    return compiled
            try:
                compiled = self._compile(spec, key)
            finally:
                with self._lock:
                    self._compiling.pop(key, None)
            with self._lock:
                self.cache_misses += 1
                self._cache[key] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return compiled

    def _cached(self, key: tuple[str, str, bool]) -> Any:
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
        return compiled

    def _compile(self, spec: StructuredOutputsParams, key: tuple[str, str, bool]) -> Any:
        kind, text, compact = key
        compiler = self._compiler
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice list",
                "json_object": "JSON grammar", "structural_tag": "structural tag"}[kind]
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=not compact, strict_mode=True)
            if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(text)))
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"the {what} cannot be used for structured output: {xgrammar_message(exc)}", "structured_outputs"
            ) from None

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher (the grammar's state at the start of the output).

        Speculative decoding walks it through up to num_speculative_tokens drafts and rolls them
        back. xgrammar 0.2.9's matchers roll back without limit (its Earley parser keeps every
        state): ``max_rollback_tokens`` is deprecated there, fixed at -1 (unlimited), and any other
        value only raises a DeprecationWarning, so it is left at its default.
        """
        return self._xgr.GrammarMatcher(self.compile(spec))
