"""A setting given as a dict or its JSON text (``--speculative-config``, ``--pooler-config``)."""

from __future__ import annotations

import json
from typing import Any


def json_object_setting(value: dict[str, Any] | str, name: str, known: set[str] | None = None) -> dict[str, Any]:
    """The dict of a setting given as a dict or JSON object text; ValueError naming ``name`` otherwise,
    and for keys outside ``known`` when it is given."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object, got {type(value).__name__}.")
    unknown = set(value) - known if known is not None else set()
    if unknown:
        raise ValueError(f"{name} has unknown keys: {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))}).")
    return value
