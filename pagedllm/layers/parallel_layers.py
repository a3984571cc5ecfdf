"""Megatron-style tensor-parallel layers; with world size 1 each is the plain layer it replaces.

- ColumnParallelLinear: output features split (no communication); its merged forms stack several
  HF linears in one GEMM (q/k/v, gate/up) and split each part separately.
- RowParallelLinear: input features split, partial sums all-reduced, then the bias added once.
- VocabParallelEmbedding: vocabulary rows split; out-of-shard ids give zeros; all-reduced.
- lm_logits: each rank multiplies by its vocabulary shard; rank 0 gathers the full logits.

Each layer owns a ``weight_loader(param, full_tensor, shard_id)`` that cuts this rank's slice out
of the full checkpoint tensor, so a rank only ever keeps its own shard. The state (rank, world
size, group) is read once at construction from pagedllm.layers.parallel_state.get_tp_state().
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.cpu_gemm import PackableLinear, dense, lm_head_matmul
from pagedllm.layers.norms_and_activations import copy_checked
from pagedllm.layers.parallel_state import all_reduce, gather_last_dim, get_tp_state


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}).")
    return numerator // denominator


def local_num_kv_heads(num_kv_heads: int, world_size: int) -> int:
    """KV heads one rank holds: its share, or one replicated head when there are fewer heads than ranks."""
    return max(1, num_kv_heads // world_size)


class _TPMixin:
    """Rank, world size and group captured when the layer is built."""

    def _init_tp(self) -> None:
        state = get_tp_state()
        self.tp_state = state
        self.tp_rank = state.rank
        self.tp_size = state.world_size


class ColumnParallelLinear(PackableLinear, _TPMixin):
    """y = x A^T with A's rows (output features) split across ranks; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        self._init_tp()
        self.full_out_features = out_features
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"), bias=bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        size = param.shape[0]
        copy_checked("column-parallel weight", param.data, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears with one input (e.g. gate/up), each split on its own."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        self._init_tp()
        local = {name: divide(size, self.tp_size, f"{name} features") for name, size in shard_sizes.items()}
        self.full_out_features = sum(shard_sizes.values())
        nn.Linear.__init__(self, in_features, sum(local.values()), bias=bias)
        # shard -> (offset in this rank's output, size on this rank, offset of this rank in the full shard)
        self.shard_slices: dict[str, tuple[int, int]] = {}
        self.shard_sources: dict[str, int] = {}
        offset = 0
        for name, size in local.items():
            self.shard_slices[name] = (offset, size)
            self.shard_sources[name] = self.tp_rank * size
            offset += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:
            # A checkpoint that already stores the parts stacked (GPT-2's c_attn): split, then load each.
            sizes = [size * self.tp_size for _, size in self.shard_slices.values()]
            for name, part in zip(self.shard_slices, loaded.split(sizes, dim=0)):
                self.weight_loader(param, part, name)
            return
        offset, size = self.shard_slices[shard_id]
        source = loaded.narrow(0, self.shard_sources[shard_id], size)
        copy_checked(f"{shard_id} shard", param.data[offset : offset + size], source)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections: query heads split; KV heads split, or replicated when fewer than ranks."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        self._init_tp()
        tp = self.tp_size
        self.num_local_heads = divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_local_kv_heads = divide(num_kv_heads, tp, "number of KV heads")
            kv_head_start = self.tp_rank * self.num_local_kv_heads
        else:
            # Fewer KV heads than ranks: each rank keeps the one KV head its query heads read.
            divide(tp, num_kv_heads, "number of KV heads (replicated)")
            self.num_local_kv_heads = 1
            kv_head_start = self.tp_rank // (tp // num_kv_heads)
        q_size = self.num_local_heads * head_dim
        kv_size = self.num_local_kv_heads * head_dim
        self.full_out_features = (num_heads + 2 * num_kv_heads) * head_dim
        self.full_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        nn.Linear.__init__(self, hidden, q_size + 2 * kv_size, bias=bias)
        self.shard_slices = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        self.shard_sources = {
            "q": self.tp_rank * q_size,
            "k": kv_head_start * head_dim,
            "v": kv_head_start * head_dim,
        }

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:
            for name, part in zip(self.full_sizes, loaded.split(list(self.full_sizes.values()), dim=0)):
                super().weight_loader(param, part, name)
            return
        super().weight_loader(param, loaded, shard_id)


class RowParallelLinear(PackableLinear, _TPMixin):
    """y = x A^T with A's columns (input features) split; partial outputs are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        self._init_tp()
        self.full_in_features = in_features
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features, bias=bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if param.dim() == 1:  # the bias is whole on every rank, added once after the reduction
            copy_checked("row-parallel bias", param.data, loaded)
            return
        size = param.shape[1]
        copy_checked("row-parallel weight", param.data, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return dense(x, self, self.bias)
        out = all_reduce(dense(x, self, None), self.tp_state)
        if self.bias is not None:
            out += self.bias
        return out


class VocabParallelEmbedding(nn.Embedding, _TPMixin):
    """Embedding rows split by vocabulary range (padded to a multiple of the world size)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self._init_tp()
        self.full_num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        super().__init__(self.shard_size, embedding_dim)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        rows = self.vocab_end - self.vocab_start
        copy_checked("embedding", param.data[:rows], loaded.narrow(0, self.vocab_start, rows))
        if rows < self.shard_size:
            with torch.no_grad():
                param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = self._lookup(local_ids)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out, self.tp_state)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return F.embedding(ids, self.weight)
        return self.weight.embedding(ids)  # a QuantizedWeight: only these rows are dequantized


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary-split as the embedding is (so tying them needs no copy);
    its bias, if any, is split the same way (``weight_loader`` cuts 1-D tensors as it cuts rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.bias = nn.Parameter(torch.zeros(self.shard_size)) if bias else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not an embedding
        raise RuntimeError("ParallelLMHead is applied through lm_logits().")


def lm_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor | None:
    """Full logits [N, vocab] in the model's dtype on rank 0; None on the other ranks (only rank 0
    samples). They stay in that dtype: at 64 rows of a 49k vocabulary a float32 copy is a 12 MB pass
    of its own, and the greedy kernel reads bfloat16 as it is; the sampler widens what it needs."""
    local = lm_head_matmul(hidden, head)
    bias = getattr(head, "bias", None)  # an embedding serving as the head has none
    if bias is not None:
        local = local + bias
    if head.tp_size == 1:
        return local
    full = gather_last_dim(local, head.tp_state)
    if full is None:
        return None
    return full[:, : head.full_num_embeddings]
