"""What every model shares: run the backbone, turn hidden states into logits, load HF weights.

A model sets up its modules, then says which one is the backbone (``[T] ids -> [T, hidden]``) and
which is the input embedding (the output projection when the embeddings are tied), and maps
checkpoint names to its own with ``map_weight``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata
from pagedllm.layers.norms_and_activations import WeightLoader
from pagedllm.layers.parallel_layers import ParallelLMHead, VocabParallelEmbedding, lm_logits


class CausalLM(nn.Module):
    """Base of every model: ``forward`` -> hidden states, ``compute_logits``, ``load_weights``."""

    # Checkpoint linears fused here: checkpoint name part -> (our module, shard).
    stacked_params: dict[str, tuple[str, str]] = {}

    def __init__(self, hf_config: Any, tie_default: bool) -> None:
        super().__init__()
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", tie_default))
        # tanh soft-capping of the final logits (Gemma 2); None: plain logits.
        self.final_logit_softcapping: float | None = None
        # The logits times this (Cohere's logit_scale, Granite's 1 / logits_scaling); None: plain logits.
        self.logit_scale: float | None = None

    def add_lm_head(self, width: int, bias: bool = False) -> None:
        """The untied output projection, vocabulary-split as the embedding is (with a bias: Phi-2)."""
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(self.config.vocab_size, width, bias=bias)

    def backbone(self) -> nn.Module:
        raise NotImplementedError

    def embedding(self) -> VocabParallelEmbedding:
        raise NotImplementedError

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """A checkpoint tensor under our parameter name (None: not a weight, e.g. a mask buffer)."""
        return name, tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        return self.backbone()(input_ids, positions, kv_caches, attn_metadata)

    def logits_head(self) -> nn.Module:
        """The module whose weight is the output projection (the embedding when tied)."""
        return self.embedding() if self.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] in the model's dtype (soft-capped ones in float32); under tensor
        parallelism only rank 0 gets them (None elsewhere)."""
        logits = lm_logits(hidden, self.logits_head())
        if logits is not None and self.logit_scale is not None:
            logits = logits * self.logit_scale
        cap = self.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the parameter names loaded, raises ValueError if any is missing."""
        loader = WeightLoader(self, self.stacked_params)
        for name, tensor in weights:
            mapped = self.map_weight(name, tensor)
            if mapped is None or (mapped[0] == "lm_head.weight" and self.tie_word_embeddings):
                continue
            loader.load(*mapped)
        return loader.finish()
