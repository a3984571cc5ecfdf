"""What a model setting names, read without torch: a local path or a hub id ``ORG/NAME[:QUANT]``.

Settings (config.py) check a reference here before anything loads; models/hub.py fetches hub ids
and models/loader.py opens paths.
"""

from __future__ import annotations

import os
import re

# ORG/NAME with huggingface_hub's allowed characters, then llama.cpp's optional ":QUANT".
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?::(?P<quant>[A-Za-z0-9_.-]+))?")


def is_hub_id(reference: str) -> bool:
    """``ORG/NAME`` or ``ORG/NAME:QUANT`` (not ``..`` or ``--``, which the hub refuses)."""
    match = HUB_ID.fullmatch(reference)
    return match is not None and ".." not in match["repo"] and "--" not in match["repo"]


def is_missing_local_path(reference: str) -> bool:
    """True when ``reference`` can only be a local path (not a hub id) and nothing is there: the
    loader would refuse it, so a setting can say so before the engine starts."""
    return not os.path.exists(os.path.expanduser(reference)) and not is_hub_id(reference)
