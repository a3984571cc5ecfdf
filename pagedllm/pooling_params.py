"""PoolingParams: what one embedding request asks of the pooled hidden state (vLLM's names).

``dimensions`` keeps the first d values of the embedding (Matryoshka representation learning) and,
when normalizing, renormalizes what is kept; only a model trained that way (its config says
``is_matryoshka`` or lists ``matryoshka_dimensions``) gives useful truncated vectors, so other
models refuse it, as vLLM does. ``normalize``: L2-normalize the embedding (None: the engine's pooler
setting, on by default for embeddings). Pure Python: core/ reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PoolingParams:
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        dimensions = self.dimensions
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
            raise ValueError(f"dimensions must be an integer, got {dimensions!r}.")
        if dimensions is not None and dimensions < 1:
            raise ValueError(f"dimensions must be greater than 0, got {dimensions}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}.")

    def verify(self, hf_config: Any, model_name: str) -> None:
        """Refuse ``dimensions`` the model cannot give (ValueError naming the model and what it supports)."""
        if self.dimensions is None:
            return
        hidden_size = hf_config.hidden_size
        supported = matryoshka_dimensions(hf_config)
        if not is_matryoshka(hf_config):
            raise ValueError(
                f'Model "{model_name}" does not support matryoshka representation, changing output dimensions '
                "will lead to poor results (leave dimensions out)."
            )
        if supported and self.dimensions not in supported:
            raise ValueError(
                f'Model "{model_name}" only supports {supported} matryoshka dimensions, got {self.dimensions}; '
                "other output dimensions will lead to poor results."
            )
        if self.dimensions > hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's hidden size {hidden_size}, got {self.dimensions}."
            )


def matryoshka_dimensions(hf_config: Any) -> list[int] | None:
    """The embedding sizes a Matryoshka model was trained for, when its config lists them."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return list(dims) if dims else None


def is_matryoshka(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "is_matryoshka", False) or matryoshka_dimensions(hf_config))
