"""Chat rendering: a conversation (plus tools) through a chat template into prompt text and token ids."""

from __future__ import annotations

import logging
import os
from typing import Any

import jinja2

from pagedllm.entrypoints.template_sandbox import TemplateBoundError, TemplateLimits, install, template_limits

logger = logging.getLogger(__name__)


def load_chat_template(template: str | None) -> str | None:
    """``--chat-template``: a file holding a Jinja template, or the template text itself (as vLLM)."""
    if template is None:
        return None
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as handle:
            return handle.read()
    if "{" not in template:  # neither a file nor a template: most likely a mistyped path
        raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja template.")
    return template


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    limits: TemplateLimits | None = None,
) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation; ``tools`` are passed to the template as HF does.

    The template renders within ``limits`` (template_sandbox.py; default: TemplateLimits()), the
    model's own template as much as one passed in: past them it raises TemplateBoundError."""
    if not isinstance(conversation, list) or not all(isinstance(m, dict) and "role" in m for m in conversation):
        raise ValueError("A conversation must be a list of {'role': ..., 'content': ...} messages.")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("This model's tokenizer has no chat template; pass chat_template=... or use generate().")
    install()
    with template_limits(limits or TemplateLimits()):
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False,
            tools=tools, continue_final_message=continue_final_message, **(template_kwargs or {}),
        )
    # The template already holds any BOS it wants: do not let the tokenizer add another.
    return text, tokenizer.encode(text, add_special_tokens=False)


def render_chat_checked(tokenizer: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[int]]:
    """render_chat whose failures are ValueErrors a client can act on, never a Python error's text.

    A template's own error (jinja2 TemplateError, e.g. raise_exception("roles must alternate")) is
    the template author's message about the conversation, and is passed on.
    """
    kwargs.setdefault("chat_template", None)
    kwargs.setdefault("add_generation_prompt", True)
    try:
        return render_chat(tokenizer, conversation, **kwargs)
    except ValueError:
        raise
    except TemplateBoundError as exc:
        raise ValueError(f"The chat template was stopped at a rendering bound: {exc.message}.") from exc
    except jinja2.TemplateError as exc:
        raise ValueError(f"The chat template refused these messages: {exc.message or 'no reason given'}") from exc
    except Exception as exc:  # noqa: BLE001 - tokenizer and template internals: log, answer plainly
        logger.warning("rendering a chat failed", exc_info=exc)
        raise ValueError(
            "These messages could not be rendered with the chat template; check their roles and contents."
        ) from exc
