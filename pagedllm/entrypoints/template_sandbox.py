"""Chat templates rendered within bounds: output size, work and time.

A chat template is a small program. Jinja's sandbox keeps it away from Python's internals and caps
``range()`` at 100,000 items, but not what it allocates: ``{{ 'a' * 1000000000 }}`` builds a
gigabyte in one step (even at compile time, where the optimizer folds constants), and two loops
nested over a long string run for hours. BoundedSandboxedEnvironment refuses such work *before*
doing it:

- ``*`` (repetition), ``+``, ``~`` and ``%`` whose result would pass ``max_chars`` characters
  (or ``MAX_ITEMS`` items for a list); ``**`` with a result past ``MAX_POWER_BITS`` bits;
- string methods and filters that pad or multiply (center/ljust/rjust/zfill, expandtabs, replace,
  translate, join, format, indent, wordwrap, tojson's indent, batch, slice) when their result would;
- more than ``max_chars`` characters of output, or more than ``work_factor * max_chars``
  characters made by those operations over the whole render (values kept in variables add up);
- rendering past ``timeout_s``, checked at every attribute access, call, operator, loop
  iteration and piece of output.

A refusal raises TemplateBoundError (a jinja2 SecurityError) naming the bound. Transformers
compiles chat templates in its own ImmutableSandboxedEnvironment; ``install()`` makes it build this
one, so that the model's own template and a request's are bounded alike.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHARS = 16 << 20  # 4x the server's default request body limit
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_WORK_FACTOR = 8
# A list longer than any conversation a request body can hold.
MAX_ITEMS = 1_000_000
MAX_POWER_BITS = 1 << 16
MAX_JSON_INDENT = 1024
# Names only the rewritten syntax tree refers to (a template cannot spell a filter name with dots).
_JOIN_FILTER = "pagedllm.bounded_join"
_ITER_FILTER = "pagedllm.bounded_iter"
_DIGITS = re.compile(r"\d+")
# The widths and precisions of a printf field ('%-10.3f'), the spec of a str.format field ('{0:>10}'), and
# fields whose width comes from an argument ('%*s', '{:{}}').
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+)?(?:\.(\d+))?")
_FORMAT_SPEC = re.compile(r"\{[^{}:]*:([^{}]*)\}")
_WIDTH_ARGUMENT = re.compile(r"%[^a-zA-Z%]*\*|\{[^{}]*\{")
_TICK_EVERY = 256  # loop iterations between clock reads


class TemplateBoundError(SecurityError):
    """A chat template went past a rendering bound; the message names the bound."""


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """What one render may make: ``max_chars`` of output (and per value), ``work_factor * max_chars``
    characters made in all, ``timeout_s`` seconds."""

    max_chars: int = DEFAULT_MAX_CHARS
    timeout_s: float = DEFAULT_TIMEOUT_S
    work_factor: int = DEFAULT_WORK_FACTOR

    def __post_init__(self) -> None:
        if self.max_chars < 1 or not self.timeout_s > 0 or self.work_factor < 1:
            raise ValueError(f"template limits must be positive, got {self}")


_LIMITS: ContextVar[TemplateLimits | None] = ContextVar("pagedllm_template_limits", default=None)


def _limits() -> TemplateLimits:
    return _LIMITS.get() or TemplateLimits()


class _Budget:
    """One render's account: the deadline and the characters made so far."""

    __slots__ = ("limits", "deadline", "work")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.work = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBoundError(
                f"the chat template ran past its time limit of {self.limits.timeout_s:g} s"
            )

    def charge(self, size: int, what: str) -> None:
        """Refuse a value of ``size`` characters (or items) past the bounds, else count it."""
        limit = self.limits.max_chars
        if size > limit:
            raise TemplateBoundError(
                f"the chat template's {what} would make {size} characters, over its limit of {limit}"
            )
        self.work += size
        if self.work > limit * self.limits.work_factor:
            raise TemplateBoundError(
                f"the chat template made more than {limit * self.limits.work_factor} characters in all "
                f"(its limit: {self.limits.work_factor} x {limit})"
            )

    def charge_items(self, count: int, what: str) -> None:
        if count > MAX_ITEMS:
            raise TemplateBoundError(
                f"the chat template's {what} would make a list of {count} items, over its limit of {MAX_ITEMS}"
            )
        self.charge(count, what)


_BUDGET: ContextVar[_Budget | None] = ContextVar("pagedllm_template_budget", default=None)


def _budget() -> _Budget:
    # Outside a render (a template's module, generate()): per-operation bounds, with a fresh clock.
    return _BUDGET.get() or _Budget(_limits())


class template_limits:
    """``with template_limits(TemplateLimits(...)):`` renders in this thread (or task) use these limits."""

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self._token: Any = None

    def __enter__(self) -> TemplateLimits:
        self._token = _LIMITS.set(self.limits)
        return self.limits

    def __exit__(self, *exc: object) -> None:
        _LIMITS.reset(self._token)


class _BoundedTemplate(jinja2.Template):
    def render(self, *args: Any, **kwargs: Any) -> str:
        if _BUDGET.get() is not None:  # a render inside a render: the outer account holds
            return super().render(*args, **kwargs)
        token = _BUDGET.set(_Budget(_limits()))
        try:
            return super().render(*args, **kwargs)
        finally:
            _BUDGET.reset(token)


class _Ticking:
    """A loop's iterable, reading the clock as it goes (a loop with an empty body calls nothing else).

    It keeps ``len`` where the iterable has one, so ``loop.length`` and ``loop.last`` work as before.
    """

    __slots__ = ("iterable",)

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __len__(self) -> int:
        return len(self.iterable)  # a TypeError here tells LoopContext to count by iterating

    def __iter__(self) -> Iterator[Any]:
        budget = _budget()
        for index, item in enumerate(self.iterable):
            if index % _TICK_EVERY == 0:
                budget.tick()
            yield item


class _Rewrite(NodeTransformer):
    """``a ~ b`` through a bounded join, and every ``for`` loop's iterable through _Ticking."""

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _JOIN_FILTER, [], [], None, None,
                            lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _ITER_FILTER, [], [], None, None, lineno=node.lineno)
        return node


@jinja2.pass_eval_context
def _bounded_join(eval_ctx: Any, pieces: list[Any]) -> str:
    budget = _budget()
    texts = [str(piece) for piece in pieces]
    budget.charge(sum(map(len, texts)), "'~' concatenation")
    return markup_join(pieces) if eval_ctx.autoescape else str_join(texts)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _ints(args: Iterable[Any]) -> list[int]:
    return [value for value in args if isinstance(value, int)]


def _format_bound(template: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """A generous bound on a format's result (``%`` or ``str.format``): its text, every width and
    precision written in it, widths passed as arguments (``%*s``, ``{:{}}``), and its arguments' text."""
    values = [*args, *kwargs.values()]
    for value in list(values):
        if isinstance(value, dict):  # format_map's mapping, '%(name)s' % mapping
            values.extend(value.values())
        elif isinstance(value, tuple):  # '%s %s' % (a, b)
            values.extend(value)
    widths = [digits for match in _PRINTF_FIELD.finditer(template) for digits in match.groups() if digits]
    widths += [digits for spec in _FORMAT_SPEC.findall(template) for digits in _DIGITS.findall(spec)]
    if any(len(digits) > 18 for digits in widths):
        return 1 << 62
    bound = len(template) + sum(map(int, widths)) + sum(len(v) for v in values if isinstance(v, str))
    if _WIDTH_ARGUMENT.search(template):
        bound += sum(max(n, 0) for n in values if isinstance(n, int))
    return bound


def _replace_bound(text: str, old: str, new: str, count: Any = -1) -> int:
    occurrences = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        occurrences = min(occurrences, count)
    return len(text) + occurrences * max(len(new) - len(old), 0)


def _join_bound(pieces: list[Any], separator: Any) -> int:
    separator_size = len(str(separator))
    return sum(len(str(piece)) for piece in pieces) + separator_size * max(len(pieces) - 1, 0)


def _pad_bound(text: str, width: Any = 0, *_: Any) -> int:
    return max(len(text), width if isinstance(width, int) else 0)


def _json_size(value: Any, limit: int, **options: Any) -> int:
    """The length of ``value`` as JSON with these options, counted piece by piece: stops past ``limit``."""
    options = {k: v for k, v in options.items() if k in ("ensure_ascii", "indent", "separators", "sort_keys")}
    total = 0
    for piece in json.JSONEncoder(**options).iterencode(value):
        total += len(piece)
        if total > limit:
            break
    return total


# str methods that make more than they are given: the bound of their result, from (text, *args).
_STR_METHOD_BOUNDS: dict[str, Callable[..., int]] = {
    "center": _pad_bound, "ljust": _pad_bound, "rjust": _pad_bound, "zfill": _pad_bound,
    "expandtabs": lambda text, tabsize=8: len(text) + text.count("\t") * max(tabsize, 0)
    if isinstance(tabsize, int) else len(text),
    "replace": lambda text, old="", new="", count=-1: _replace_bound(text, str(old), str(new), count),
    "translate": lambda text, table=None: len(text) * max(
        [1, *(len(v) for v in (table.values() if isinstance(table, dict) else ()) if isinstance(v, str))]),
}


class BoundedSandboxedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox that also bounds what a render may allocate and how long it runs."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})
    template_class = _BoundedTemplate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs; no chat template asks for it
        self.filters[_JOIN_FILTER] = _bounded_join
        self.filters[_ITER_FILTER] = _Ticking
        self._bounded_filters: set[str] = {_JOIN_FILTER, _ITER_FILTER}

    # -------------------------------------------------------------- compiling

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        # Filters set after construction (transformers adds its tojson) are bounded here, before use.
        self._bound_filters()
        tree = _Rewrite().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def _bound_filters(self) -> None:
        for name, func in list(self.filters.items()):
            if name not in self._bounded_filters:
                self.filters[name] = _bounded_filter(name, func)
                self._bounded_filters.add(name)

    # -------------------------------------------------------------- running

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        budget = _budget()
        limit = budget.limits.max_chars
        collected: list[str] = []
        total = 0
        for piece in pieces:
            budget.tick()
            total += len(piece)
            if total > limit:
                raise TemplateBoundError(f"the chat template's output passed its limit of {limit} characters")
            collected.append(piece)
        return "".join(collected)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.tick()
        if operator == "*":
            sequence, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(sequence, (str, list, tuple)) and isinstance(times, int):
                size = len(sequence) * max(times, 0)
                if isinstance(sequence, str):
                    budget.charge(size, "'*' repetition")
                else:
                    budget.charge_items(size, "'*' repetition")
        elif operator == "+":
            if isinstance(left, str) and isinstance(right, str):
                budget.charge(len(left) + len(right), "'+' concatenation")
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                budget.charge_items(len(left) + len(right), "'+' concatenation")
        elif operator == "%" and isinstance(left, str):
            arguments = right if isinstance(right, tuple) else (right,)
            budget.charge(_format_bound(left, arguments, {}), "'%' formatting")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if right * abs(left).bit_length() > MAX_POWER_BITS:
                raise TemplateBoundError(
                    f"the chat template's '**' would make a number of more than {MAX_POWER_BITS} bits"
                )
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        owner = getattr(obj, "__self__", None)
        name = getattr(obj, "__name__", None)
        if isinstance(owner, str) and name is not None:
            if name == "join" and args:
                pieces = list(args[0])
                budget.charge(_join_bound(pieces, owner), "join()")
                args = (pieces, *args[1:])
            elif name in _STR_METHOD_BOUNDS:
                budget.charge(_STR_METHOD_BOUNDS[name](owner, *args, **kwargs), f"{name}()")
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        template = value.__self__

        @functools.wraps(wrapper)
        def bounded(*args: Any, **kwargs: Any) -> str:
            _budget().charge(_format_bound(template, args, kwargs), "format()")
            return wrapper(*args, **kwargs)

        return bounded


def _filter_arguments(func: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    # A filter marked pass_context / pass_eval_context / pass_environment gets that object first.
    return args[1:] if getattr(func, "jinja_pass_arg", None) is not None else args


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the bound of its result checked first (where it can make more than it is given),
    and what it made counted."""

    @functools.wraps(func)  # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        value_args = _filter_arguments(func, args)
        if value_args:
            _check_filter(budget, name, value_args[0], value_args[1:], kwargs)
        result = func(*args, **kwargs)
        if isinstance(result, str):
            budget.charge(len(result), f"'{name}' filter")
        return result

    return bounded


def _check_filter(budget: _Budget, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    what = f"'{name}' filter"
    if name == "center":
        budget.charge(_pad_bound(str(value), *(args or (kwargs.get("width", 80),))), what)
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width_size = len(width) if isinstance(width, str) else max(width, 0) if isinstance(width, int) else 0
        text = str(value)
        budget.charge(len(text) + (text.count("\n") + 1) * width_size, what)
    elif name == "replace" and len(args) >= 2:
        budget.charge(_replace_bound(str(value), str(args[0]), str(args[1]), args[2] if len(args) > 2 else -1),
                      what)
    elif name == "format" and isinstance(value, str):
        budget.charge(_format_bound(value, args, kwargs), what)
    elif name == "wordwrap":
        wrapstring = args[2] if len(args) > 2 else kwargs.get("wrapstring")
        text = str(value)
        budget.charge(len(text) * (1 + (len(wrapstring) if isinstance(wrapstring, str) else 1)), what)
    elif name == "join" and isinstance(value, (list, tuple)) and not kwargs.get("attribute") and len(args) < 2:
        budget.charge(_join_bound(list(value), args[0] if args else kwargs.get("d", "")), what)
    elif name == "tojson" and (kwargs.get("indent") or (len(args) > 1 and args[1])):
        options = dict(kwargs)
        if args:  # transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
            options.update(zip(("ensure_ascii", "indent", "separators", "sort_keys"), args))
        options.setdefault("ensure_ascii", False)
        indent = options.get("indent")
        # Each line starts with the indent times its depth: refuse a wide one before a line is made.
        if (len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0) > MAX_JSON_INDENT:
            raise TemplateBoundError(f"the chat template's 'tojson' filter has an indent over {MAX_JSON_INDENT}")
        budget.charge(_json_size(value, budget.limits.max_chars, **options), what)
    elif name in ("batch", "slice"):
        count = args[0] if args else kwargs.get("linecount" if name == "batch" else "slices", 0)
        if isinstance(count, int):
            budget.charge_items(count, what)


def install() -> bool:
    """Have transformers compile chat templates in BoundedSandboxedEnvironment (idempotent).

    False (and a warning, once) when this transformers compiles them elsewhere: templates then
    render unbounded.
    """
    try:
        from transformers.utils import chat_template_utils
    except ImportError:
        return False
    if getattr(chat_template_utils, "ImmutableSandboxedEnvironment", None) is BoundedSandboxedEnvironment:
        return True
    if not hasattr(chat_template_utils, "ImmutableSandboxedEnvironment"):
        if not getattr(install, "warned", False):
            install.warned = True  # type: ignore[attr-defined]
            logger.warning("this transformers version compiles chat templates elsewhere; they render unbounded")
        return False
    chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandboxedEnvironment
    # Templates compiled before the switch would keep the unbounded environment.
    cached = getattr(chat_template_utils, "_cached_compile_jinja_template", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
    return True
