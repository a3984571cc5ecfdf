"""A transformers model written as a GGUF file the way llama.cpp's converter writes it.

Tensor names come from gguf-py's own HF -> GGUF name map; the converter's per-architecture
changes are made here: Llama's q/k rows permuted for interleaved rope, GPT-NeoX's per-head
q/k/v rows stacked, Gemma's norm weights stored with the 1 of ``1 + weight`` added. The
tokenizer (a byte-level BPE) goes in as llama.cpp's "gpt2" tokenizer model.
"""

from __future__ import annotations

import json
import math

import numpy as np


def _metadata(writer, arch: str, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    if "full_attention" in rope:
        rope = rope["full_attention"]
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "gptneox":
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_bool("gptneox.use_parallel_residual", config.use_parallel_residual)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
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


def _converted(arch: str, name: str, tensor: np.ndarray, config) -> np.ndarray:
    heads = config.num_attention_heads
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        n = heads if ".q_proj." in name else config.num_key_value_heads
        rest = tensor.shape[1:]
        return tensor.reshape(n, 2, tensor.shape[0] // n // 2, *rest).swapaxes(1, 2).reshape(tensor.shape)
    if arch == "gptneox" and ".query_key_value." in name:
        rest = tensor.shape[1:]
        return tensor.reshape(heads, 3, -1, *rest).swapaxes(0, 1).reshape(tensor.shape)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return tensor + 1.0
    return tensor


def write_family_gguf(hf_model, tokenizer, arch: str, path: str, weight_type: str = "F32") -> str:
    """``hf_model`` (float32) as a GGUF file of architecture ``arch``; 2-D weights in ``weight_type``
    (F32, or a type gguf-py quantizes: Q8_0, Q4_0, Q4_1)."""
    import gguf
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType
    from gguf.quants import quantize

    config = hf_model.config
    arch_id = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch and a in MODEL_ARCH)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, arch, config)
    _tokenizer(writer, tokenizer)
    tied = getattr(config, "tie_word_embeddings", False)
    for name, param in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"gguf-py has no name for {name} in {arch}")
        data = _converted(arch, name, param.float().numpy(), config).astype(np.float32)
        if data.ndim == 2 and weight_type != "F32":
            qtype = GGMLQuantizationType[weight_type]
            writer.add_tensor(gguf_name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
