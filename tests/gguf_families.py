"""A transformers model written as a GGUF file the way llama.cpp's converter writes it.

Tensor names come from gguf-py's own HF -> GGUF name map; the converter's per-architecture
changes are made here: Llama's (and Granite's) q/k rows permuted for interleaved rope, StableLM's
per-head q/k norms stacked into one tensor, norms kept in F32, GPT-NeoX's per-head
q/k/v rows stacked, Gemma's norm weights stored with the 1 of ``1 + weight`` added, the experts
of a mixture stacked into 3-D tensors (``ffn_{gate,up,down}_exps``, [n_expert, rows, cols]) with
the routers kept in F32 (Mixtral goes in as a "llama" with experts). GPT-OSS: its fused experts
(transposed, gate and up interleaved) split into gate / up / down stacks with their biases, the
sinks as ``attn_sinks.weight``, yarn rope. DeepSeek-V3 ("deepseek2"): its latent attention sizes as
llama.cpp's MLA keys, kv_b_proj split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, the
routing bias as ``exp_probs_b.bias``, sigmoid gating over groups. The tokenizer (a byte-level
BPE) goes in as llama.cpp's "gpt2" tokenizer model.
"""

from __future__ import annotations

import json
import math

import numpy as np


def _metadata(writer, arch: str, config) -> None:
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    if "full_attention" in rope:
        rope = rope["full_attention"]
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if arch == "deepseek2":
        _deepseek2_metadata(writer, config)
    else:
        writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("mscale_all_dim"):
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "gptneox":
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_bool("gptneox.use_parallel_residual", config.use_parallel_residual)
    elif arch in _LAYER_NORM_ARCHS:
        writer.add_layer_norm_eps(config.layer_norm_eps)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    _layout_metadata(writer, arch, config)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if arch == "gpt-oss":  # its experts are intermediate_size wide; llama.cpp fixes the clamp at 7
        writer.add_expert_feed_forward_length(config.intermediate_size)
        if config.swiglu_limit != 7.0:
            writer.add_swiglu_clamp_exp([config.swiglu_limit] * config.num_hidden_layers)
    if experts and arch != "deepseek2":  # DeepSeek's: _deepseek2_metadata
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "moe_intermediate_size", None):  # Mixtral's experts are feed_forward_length wide
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _deepseek2_metadata(writer, config) -> None:
    """What llama.cpp's MLA converter writes for DeepSeek-V3: one latent KV head, whose key is the latent
    and the rope key and whose value is the latent; the per-head sizes under the _mla keys."""
    import gguf

    rope_dim = config.qk_rope_head_dim
    writer.add_head_count_kv(1)
    writer.add_key_length(config.kv_lora_rank + rope_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + rope_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)


def _tokenizer(writer, tokenizer) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_ids)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)


_LAYER_NORM_ARCHS = ("stablelm", "phi2", "command-r", "cohere2")


def _layout_metadata(writer, arch: str, config) -> None:
    """What llama.cpp's converters add for OLMo 2/3, Granite, StableLM, Command-R and Cohere 2."""
    if arch == "olmo2" and getattr(config, "layer_types", None):  # OLMo 3: which layers slide
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    if arch == "granite":  # the multipliers under llama.cpp's names (logits_scaling is its logit_scale)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch in ("command-r", "cohere2"):
        writer.add_logit_scale(config.logit_scale)
    if arch == "stablelm":
        writer.add_parallel_residual(config.use_parallel_residual)


def _stacked_head_norms(tensors: dict[str, object], config) -> dict[str, object]:
    """StableLM's per-head q/k norms (``q_layernorm.norms.H.weight``) stacked into one [heads, head_dim]
    tensor per layer, as llama.cpp's converter writes them."""
    import torch

    out: dict[str, object] = {}
    for name, tensor in tensors.items():
        stem, marker, rest = name.partition("_layernorm.norms.")
        if not marker:
            out[name] = tensor
        elif rest.split(".")[0] == "0":
            heads = config.num_attention_heads if stem.endswith(".q") else config.num_key_value_heads
            out[f"{stem}_layernorm.weight"] = torch.stack(
                [tensors[f"{stem}_layernorm.norms.{h}.weight"] for h in range(heads)])
    return out


def _converted(arch: str, name: str, tensor: np.ndarray, config) -> np.ndarray:
    heads = config.num_attention_heads
    if arch in ("llama", "granite") and (".q_proj." in name or ".k_proj." in name):  # Granite: a Llama
        n = heads if ".q_proj." in name else config.num_key_value_heads
        rest = tensor.shape[1:]
        return tensor.reshape(n, 2, tensor.shape[0] // n // 2, *rest).swapaxes(1, 2).reshape(tensor.shape)
    if arch == "gptneox" and ".query_key_value." in name:
        rest = tensor.shape[1:]
        return tensor.reshape(heads, 3, -1, *rest).swapaxes(0, 1).reshape(tensor.shape)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return tensor + 1.0
    return tensor


def _gpt_oss_tensor(name: str, param) -> dict[str, object] | None:
    """GPT-OSS's fused experts as llama.cpp's converter writes them: [n_expert, in, out] transposed to
    nn.Linear's orientation, the interleaved gate (even) and up (odd) outputs split apart, each bias
    with its weight; the sinks under a ``.weight`` name. None: not one of these."""
    stem = name.rpartition(".")[0]
    if name.endswith(".experts.gate_up_proj"):
        weight = param.transpose(1, 2)
        return {f"{stem}.gate_proj.weight": weight[:, 0::2], f"{stem}.up_proj.weight": weight[:, 1::2]}
    if name.endswith(".experts.gate_up_proj_bias"):
        return {f"{stem}.gate_proj.bias": param[:, 0::2], f"{stem}.up_proj.bias": param[:, 1::2]}
    if name.endswith(".experts.down_proj"):
        return {f"{stem}.down_proj.weight": param.transpose(1, 2)}
    if name.endswith(".experts.down_proj_bias"):
        return {f"{stem}.down_proj.bias": param}
    if name.endswith(".self_attn.sinks"):
        return {f"{name}.weight": param}
    return None


def _deepseek_tensor(name: str, param, config) -> dict[str, object] | None:
    """DeepSeek-V3's kv_b_proj as llama.cpp's MLA converter writes it: per head, the key rows transposed
    ([heads, kv_lora_rank, nope], k_b_proj) and the value rows ([heads, v, kv_lora_rank], v_b_proj); the
    routing bias under a ``.bias`` name. None: not one of these."""
    if name.endswith(".self_attn.kv_b_proj.weight"):
        heads, nope = config.num_attention_heads, config.qk_nope_head_dim
        per_head = param.reshape(heads, nope + config.v_head_dim, param.shape[-1])
        stem = name.removesuffix(".kv_b_proj.weight")
        return {f"{stem}.k_b_proj.weight": per_head[:, :nope].transpose(1, 2),
                f"{stem}.v_b_proj.weight": per_head[:, nope:]}
    if name.endswith(".e_score_correction_bias"):
        return {name.replace("e_score_correction_bias", "e_score_correction.bias"): param}
    return None


def checkpoint_tensors(hf_model) -> dict[str, object]:
    """The model's tensors as the converter sees a checkpoint, experts stacked: transformers holds
    them fused ([n_expert, 2 * I, H] gate and up, [n_expert, H, I] down); llama.cpp's converter
    stacks the per-expert gate, up and down matrices, which is the same split in halves (GPT-OSS's
    and DeepSeek-V3's own layouts: _gpt_oss_tensor, _deepseek_tensor)."""
    tensors = {}
    model_type = hf_model.config.model_type
    for name, param in hf_model.state_dict().items():
        special = (_gpt_oss_tensor(name, param) if model_type == "gpt_oss"
                   else _deepseek_tensor(name, param, hf_model.config) if model_type == "deepseek_v3" else None)
        if special is not None:
            tensors.update(special)
        elif name.endswith(".experts.gate_up_proj"):
            gate, up = param.chunk(2, dim=1)
            tensors[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            tensors[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith(".experts.down_proj"):
            tensors[name + ".weight"] = param
        else:
            tensors[name] = param
    return tensors


def quantized_here(name: str, tensor, weight_type: str | None = None) -> bool:
    """Whether the writer stores this tensor in the quantized type: every matrix (a stack of expert
    matrices too) but the routers, the norms (Cohere's and StableLM's q/k norms are matrices) and the
    stacked expert biases, which llama.cpp keeps in F32. MXFP4 (llama.cpp's MXFP4_MOE): the experts only."""
    if tensor.ndim < 2 or name.endswith(("bias", ".mlp.gate.weight", ".mlp.router.weight", ".shared_expert_gate.weight",
                                         "norm.weight")):
        return False
    return weight_type != "MXFP4" or ".experts." in name


def dequantized_copy(hf_model, weight_type: str):
    """A copy of ``hf_model`` holding the weights a ``weight_type`` file written from it holds,
    dequantized by gguf-py: the transformers reference for that file. Blocks run along rows, so
    quantizing the fused expert tensors or their halves, permuted rows or not, gives these values."""
    import copy

    import torch
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[weight_type]
    reference = copy.deepcopy(hf_model)
    # GPT-OSS holds its experts as [n_expert, in, out]: blocks run along ``in``, its second-last axis.
    transposed = hf_model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, param in reference.named_parameters():  # a tied head once, with its embedding
            flip = transposed and ".experts." in name
            rows = param.float().transpose(-1, -2) if flip else param.float()
            if quantized_here(name, param, weight_type) and rows.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
                values = torch.from_numpy(dequantize(quantize(rows.contiguous().numpy(), qtype), qtype))
                values = values.reshape(rows.shape)
                param.copy_(values.transpose(-1, -2) if flip else values)
    return reference


def write_family_gguf(hf_model, tokenizer, arch: str, path: str, weight_type: str = "F32") -> str:
    """``hf_model`` (float32) as a GGUF file of architecture ``arch``; weight matrices in ``weight_type``
    (F32, or a type gguf-py quantizes: Q8_0, Q4_0, Q4_1; MXFP4 for the experts only)."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType
    from gguf.quants import quantize

    config = hf_model.config
    arch_id = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch and a in MODEL_ARCH)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, arch, config)
    _tokenizer(writer, tokenizer)
    tied = getattr(config, "tie_word_embeddings", False)
    for name, param in _stacked_head_norms(checkpoint_tensors(hf_model), config).items():
        if tied and name == "lm_head.weight":
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"gguf-py has no name for {name} in {arch}")
        data = _converted(arch, name, param.float().numpy(), config).astype(np.float32)
        # Rows that are not whole blocks stay float, as llama.cpp's converter falls back for them.
        blocks = weight_type != "F32" and data.shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType[weight_type]][0] == 0
        if quantized_here(name, data, weight_type) and blocks:
            qtype = GGMLQuantizationType[weight_type]
            writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
