"""The one decoder every Llama-like family runs on, configured by families.DecoderSettings.

Inputs are a flattened batch: ``input_ids[T]`` and ``positions[T]`` for every token computed this
step, all sequences concatenated without padding; the attention backend finds the sequence
boundaries in the metadata.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata, PagedAttention
from pagedllm.distributed.parallel_state import all_reduce
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.cpu_gemm import GatedPanelWeight, dense
from pagedllm.models.families import DecoderSettings, decoder_settings
from pagedllm.models.layer_stack import LayerStack, build_layer_stack, weights_key
from pagedllm.models.layers import ActAndMul, get_activation, make_norm
from pagedllm.models.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedllm.models.rotary import RotaryEmbedding, rotate_heads

Rope = tuple[torch.Tensor, torch.Tensor]
KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderAttention(nn.Module):
    def __init__(self, s: DecoderSettings, layer: int) -> None:
        super().__init__()
        self.head_dim = s.head_dim
        # Under tensor parallelism this rank computes only its heads (and their KV heads).
        self.qkv_proj = QKVParallelLinear(s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, bias=s.qkv_bias)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * s.head_dim
        self.kv_size = self.num_kv_heads * s.head_dim
        self.o_proj = RowParallelLinear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        self.q_norm = make_norm(s.family.norm, s.head_dim, s.norm_eps) if s.family.qk_norm else None
        self.k_norm = make_norm(s.family.norm, s.head_dim, s.norm_eps) if s.family.qk_norm else None
        self.attn = PagedAttention(
            self.num_heads, s.head_dim, self.num_kv_heads, scale=s.attn_scale,
            sliding_window=s.layer_windows[layer], logits_soft_cap=s.attn_softcap,
        )

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache: KVCache | None,
                meta: AttentionMetadata | None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_size = self.q_size + self.kv_size
        if self.q_norm is None:
            # Rotate q and k in one go: they are adjacent in the fused output.
            qk = rotate_heads(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim), *rope).view(num_tokens, qk_size)
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        else:
            q, k = qkv[:, :qk_size].split([self.q_size, self.kv_size], dim=-1)
            q = rotate_heads(self.q_norm(q.reshape(num_tokens, -1, self.head_dim)), *rope)
            k = rotate_heads(self.k_norm(k.reshape(num_tokens, -1, self.head_dim)), *rope)
        v = qkv[:, qk_size:]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, s: DecoderSettings, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        sizes = {"gate": intermediate_size, "up": intermediate_size}
        self.gate_up_proj = MergedColumnParallelLinear(s.hidden_size, sizes, bias=bias)
        self.gate_up_proj.gated_activation = s.activation  # lets the CPU GEMM fuse act(gate) * up
        self.down_proj = RowParallelLinear(intermediate_size, s.hidden_size, bias=bias)
        self.act_and_mul = ActAndMul(s.activation)

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x): one kernel when the gate/up weight is packed for it."""
        packed = self.gate_up_proj.packed_weight
        if isinstance(packed, GatedPanelWeight):
            return packed.silu_and_mul(x)
        return self.act_and_mul(self.gate_up_proj(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce (experts reduce once, together)."""
        return dense(self.activated(x), self.down_proj, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activated(x))


class PlainMLP(nn.Module):
    """c_proj(act(c_fc(x))) (GPT-NeoX, StarCoder2; names apart from the gated MLP's up_proj,
    which checkpoint loading fuses with gate_proj)."""

    def __init__(self, s: DecoderSettings) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.c_proj = RowParallelLinear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)
        self.act = get_activation(s.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class SparseMoE(nn.Module):
    """Top-k routed experts (Mixtral, Qwen3-MoE). Tokens are grouped by expert, so each expert runs
    one GEMM over all its tokens of the step; under tensor parallelism every expert is split like
    an MLP and the summed outputs are all-reduced once."""

    def __init__(self, s: DecoderSettings) -> None:
        super().__init__()
        self.top_k = s.num_experts_per_token
        self.normalize = s.normalize_expert_weights
        # The router stays a plain float linear on every rank: quantizing it would move routing choices.
        self.gate = nn.Linear(s.hidden_size, s.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(s, s.expert_intermediate_size, bias=False) for _ in range(s.num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        token_weights = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = tokens[start:start + count]
                y = expert.partial(x[rows]) * token_weights[start:start + count, None]
                out.index_add_(0, rows, y.to(out.dtype))
            start += count
        tp_state = self.experts[0].down_proj.tp_state
        return out if tp_state.world_size == 1 else all_reduce(out, tp_state)


class DecoderLayer(nn.Module):
    def __init__(self, s: DecoderSettings, layer: int) -> None:
        super().__init__()
        norm, hidden, eps = s.family.norm, s.hidden_size, s.norm_eps
        self.rope_key = s.layer_rope_keys[layer]
        self.parallel_residual = s.parallel_residual
        self.self_attn = DecoderAttention(s, layer)
        if s.moe_layers[layer]:
            self.mlp: nn.Module = SparseMoE(s)
        elif s.family.gated_mlp:
            self.mlp = GatedMLP(s, s.intermediate_size, bias=s.mlp_bias)
        else:
            self.mlp = PlainMLP(s)
        self.input_layernorm = make_norm(norm, hidden, eps)
        self.post_attention_layernorm = make_norm(norm, hidden, eps)
        self.sandwich = s.family.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(norm, hidden, eps)
            self.post_feedforward_layernorm = make_norm(norm, hidden, eps)

    def forward(self, ropes: dict[str | None, Rope], hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache | None, meta: AttentionMetadata | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) -> the next layer's (hidden, residual), vLLM's form: the residual is
        carried beside the hidden state and each add is fused into the norm after it; the first
        layer gets residual None. Parallel-residual layers take and return a plain hidden state
        (residual None)."""
        rope = ropes[self.rope_key]
        if self.parallel_residual:
            h = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
            out = self.mlp(self.post_attention_layernorm(hidden))
            out += h
            out += hidden
            return out, None
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        h = self.self_attn(rope, hidden, kv_cache, meta)
        if self.sandwich:
            h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def token_seq_lens(positions: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
    """Per token: its sequence's length after this step (what length-dependent rope variants read)."""
    if meta is None:  # profiling run: one sequence
        return torch.full_like(positions, int(positions.max()) + 1)
    repeats = torch.tensor(meta.query_lens, device=positions.device)
    return torch.repeat_interleave(meta.context_lens.to(positions.device), repeats)


class DecoderModel(nn.Module):
    def __init__(self, s: DecoderSettings, hf_config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(s.num_layers))
        self.norm = make_norm(s.family.norm, s.hidden_size, s.norm_eps)
        self.embed_scale = s.embed_scale
        # One rotary per distinct rope setting (Gemma 3: local and global); not submodules: no weights.
        self.rotary = {key: RotaryEmbedding(hf_config, key) for key in dict.fromkeys(s.layer_rope_keys)}
        self.rope_needs_lengths = any(r.depends_on_length for r in self.rotary.values())
        # The C++ loop over the layers (models/layer_stack.py), built for the weights named by the key.
        self._stack: LayerStack | None = None
        self._stack_key: int | None = -1

    def _layer_stack(self, hidden: torch.Tensor, kv_caches: list[KVCache] | None,
                     meta: AttentionMetadata | None) -> LayerStack | None:
        """The C++ loop over the layers when it serves this model on CPU (decided once per set of
        weights, packed or quantized); None for a step without a cache (profiling) or with autograd on."""
        if meta is None or kv_caches is None or hidden.device.type != "cpu" or torch.is_grad_enabled():
            return None
        key = weights_key(self)
        if self._stack_key != key:
            self._stack, self._stack_key = build_layer_stack(self), key
        return self._stack

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache] | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # The scale rounded to the model dtype first, as the reference does.
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        seq_lens = token_seq_lens(positions, attn_metadata) if self.rope_needs_lengths else None
        ropes = {key: rotary.cos_sin(positions, hidden.dtype, seq_lens) for key, rotary in self.rotary.items()}
        residual = None
        stack = self._layer_stack(hidden, kv_caches, attn_metadata)
        plan = None if stack is None else stack.plan(attn_metadata, hidden, kv_caches[0][0])
        if plan is not None:
            hidden, residual = stack.run(hidden, next(iter(ropes.values())), kv_caches, attn_metadata, plan)
        else:
            for i, layer in enumerate(self.layers):
                kv_cache = kv_caches[i] if kv_caches is not None else None
                hidden, residual = layer(ropes, hidden, residual, kv_cache, attn_metadata)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


def _qkv_per_head_to_stacked(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GPT-NeoX rows [h0: q k v, h1: q k v, ...] -> [q of all heads; k ...; v ...]."""
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


class DecoderForCausalLM(CausalLM):
    """Every family of families.FAMILIES (HF parameter names, mapped per family)."""

    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    @staticmethod
    def check_config(hf_config: Any) -> None:
        """ValueError for variants the decoder does not cover (rope scaling, activation, ...)."""
        decoder_settings(hf_config)

    def __init__(self, hf_config: Any) -> None:
        super().__init__(hf_config, tie_default=False)
        self.settings = decoder_settings(hf_config)
        self.model = DecoderModel(self.settings, hf_config)
        self.add_lm_head(self.settings.hidden_size)
        self.final_logit_softcapping = self.settings.final_softcap

    def backbone(self) -> nn.Module:
        return self.model

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        family = self.settings.family
        if "rotary_emb." in name or name.endswith((".attention.bias", ".attention.masked_bias")):
            return None  # rope tables and causal-mask buffers saved by some checkpoints
        # Only a transformers checkpoint stores q, k, v per head (GGUF files store them stacked).
        per_head = family.qkv_per_head and ".query_key_value." in name
        if name.startswith(family.prefix):
            name = "model." + name[len(family.prefix):]
        dotted = "." + name
        for old, new in family.renames:
            dotted = dotted.replace(old, new)
        name = dotted[1:]
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name  # checkpoints of the bare backbone
        if per_head:
            tensor = _qkv_per_head_to_stacked(tensor, self.settings.num_heads)
        return name, tensor
