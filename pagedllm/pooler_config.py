"""Which runner an engine is (generation or pooling) and how the pooling runner pools (vLLM's names).

vLLM's ``--runner {auto,generate,pooling}`` picks what the engine serves; ``--convert {auto,none,embed}``
says how a generation checkpoint (``*ForCausalLM``) serves the pooling runner: ``embed`` pools its final
hidden states (after the final norm, before the LM head). The older ``--task embed`` means runner
pooling with convert embed, ``--task generate`` the generation runner. ``--pooler-config`` sets the
pooling (LAST, MEAN or CLS) and whether embeddings are L2-normalized.

``runner="auto"`` chooses pooling for a sentence-transformers embedding checkpoint (a folder with
``modules.json``, as Qwen3-Embedding ships), whose ``1_Pooling/config.json`` and Normalize module then
give the pooler's defaults; anything else generates. Pure Python: config.py imports it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.json_setting import json_object_setting

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
TASKS = ("generate", "embed")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(slots=True)
class PoolerConfig:
    """How the pooling runner turns a prompt's final hidden states into one vector.

    LAST: the last token's (a causal model's summary of the whole prompt; Qwen3-Embedding's pooling,
    its tokenizer appending ``<|endoftext|>``); MEAN: the mean over the prompt's tokens; CLS: the first
    token's. ``normalize``: L2-normalize embeddings (a request's PoolingParams.normalize wins).
    None: the checkpoint's sentence-transformers setting, else LAST and normalized.
    """

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(
                    f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}."
                )
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}.")

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig | None:
        """From a dict or its JSON text (``--pooler-config '{"pooling_type": "MEAN"}'``)."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**json_object_setting(value, "pooler_config", set(cls.__dataclass_fields__)))

    def resolved(self, model_path: str | None) -> PoolerConfig:
        """Every setting filled: this config's, else the checkpoint's sentence-transformers ones, else
        LAST and normalized (vLLM's defaults for the embed task)."""
        modules = sentence_transformers_modules(model_path)
        pooling_type = self.pooling_type or (_st_pooling_type(model_path, modules) if modules else None)
        normalize = self.normalize
        if normalize is None:  # a sentence-transformers model normalizes when it has a Normalize module
            normalize = not modules or any(str(module.get("type", "")).endswith("Normalize") for module in modules)
        return PoolerConfig(pooling_type=pooling_type or "LAST", normalize=normalize)


def check_runner_settings(runner: str, convert: str, task: str | None) -> tuple[str, str]:
    """(runner, convert) after the older ``task`` name is folded in; a ValueError for bad or clashing values."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}.")
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}.")
        wanted = "pooling" if task == "embed" else "generate"
        if runner not in ("auto", wanted):
            raise ValueError(f"task={task!r} means runner={wanted!r}, but runner={runner!r} was given.")
        runner = wanted
        if task == "embed" and convert == "auto":
            convert = "embed"
    if convert == "embed":
        if runner == "generate":
            raise ValueError("convert='embed' makes an embedding model, which the generate runner cannot serve; "
                             "use runner='pooling'.")
        runner = "pooling"
    if runner == "pooling" and convert == "none":
        raise ValueError("runner='pooling' needs convert='embed' (or 'auto'): the decoder models here have no pooler "
                         "of their own.")
    return runner, convert


def resolve_runner(runner: str, model_path: str | None) -> str:
    """The runner an engine over ``model_path`` is: "generate" or "pooling"."""
    if runner != "auto":
        return runner
    return "pooling" if is_sentence_transformers_model(model_path) else "generate"


def is_sentence_transformers_model(model_path: str | None) -> bool:
    return bool(model_path) and os.path.isfile(os.path.join(str(model_path), "modules.json"))


def sentence_transformers_modules(model_path: str | None) -> list[dict[str, Any]] | None:
    """The module list of a sentence-transformers checkpoint (modules.json), or None."""
    if not is_sentence_transformers_model(model_path):
        return None
    try:
        with open(os.path.join(str(model_path), "modules.json"), encoding="utf-8") as file:
            modules = json.load(file)
    except (OSError, ValueError):
        return None
    return [module for module in modules if isinstance(module, dict)] if isinstance(modules, list) else None


def _st_pooling_type(model_path: str | None, modules: list[dict[str, Any]]) -> str | None:
    """The pooling of the checkpoint's Pooling module (its config.json), or None without one."""
    pooling = [module for module in modules if str(module.get("type", "")).endswith("Pooling")]
    if not pooling:
        return None
    config_path = os.path.join(str(model_path), str(pooling[0].get("path", "")), "config.json")
    try:
        with open(config_path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    for key, pooling_type in (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
                              ("pooling_mode_cls_token", "CLS")):
        if config.get(key):
            return pooling_type
    others = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value)
    if others:
        raise ValueError(
            f"the checkpoint's sentence-transformers pooling ({', '.join(others)} in {config_path}) is not supported; "
            'choose LAST, MEAN or CLS with pooler_config, e.g. \'{"pooling_type": "MEAN"}\'.'
        )
    return None
