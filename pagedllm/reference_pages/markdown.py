"""Markdown pieces the reference pages share: table cells that cannot break a table, and tables."""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence

_MARKDOWN_PUNCTUATION = re.compile(r"[\\`*_\[\]|]")


def cell(text: object) -> str:
    """Plain text as one table cell, shown as it is: HTML-escaped (help texts hold ``<think>``, which
    Markdown would take for a tag), Markdown's punctuation backslash-escaped (``|`` would end the cell,
    ``*`` or ``_`` start emphasis) and newlines folded (a row is one line)."""
    value = html.escape(str(text), quote=False)
    value = _MARKDOWN_PUNCTUATION.sub(r"\\\g<0>", value)
    return " ".join(value.split())


def code(text: object) -> str:
    """Text as inline code in a table cell. A code span cannot hold an escaped ``|`` (Python-Markdown
    shows the backslash), so text with one is written as escaped plain text in a ``<code>`` element."""
    value = " ".join(str(text).split())
    if "|" in value or "`" in value:
        return f"<code>{cell(value)}</code>"
    return f"`{value}`"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a Markdown table; each row's cells must already be cell()- or code()-made."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def page(title: str, source_sentence: str, body: list[str]) -> str:
    """A page: ``# title``, the sentence saying what it is generated from, then the body."""
    return "\n".join([f"# {title}", "", source_sentence, "", *body]).rstrip("\n") + "\n"
