"""AWQ and GPTQ 4-bit checkpoints loaded into the packed int4 formats (quantization/awq_gptq.py).

The checkpoints are written here from tiny random transformers models: each linear quantized into
the exact tensors AutoAWQ ("gemm") and AutoGPTQ / GPTQModel save, packed word by word by the
reference packers below (no code shared with the loader). The oracle is transformers on a float
checkpoint of the converted weights dequantized, ``q * s + fp16(-z * s)``: equal to the
checkpoint's own ``(q - z) * s`` wherever fp16 holds ``-z * s`` (every symmetric checkpoint); for
AWQ's zero points it rounds, and ``test_conversion_exactness`` measures and bounds by how much.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from oracle import hf_greedy
from requirements_here import require

from pagedllm import LLM, SamplingParams
from pagedllm.layers.cpu_gemm import PackableLinear
from pagedllm.models.loader import build_model, load_model_config
from pagedllm.quantization.apply import packed_weight_bytes
from pagedllm.quantization.awq_gptq import (
    AWQ_ORDER,
    CheckpointQuant,
    ConversionStats,
    checkpoint_quantization,
    convert_linear,
    unpack_int4_columns,
    unpack_int4_rows,
)
from pagedllm.quantization.packed import QuantizedWeight

transformers = require("transformers")
safetensors_torch = require("safetensors")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NEW_TOKENS = 16


# ------------------------------------------------------------------ reference packers (by the layouts)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as the int32 a checkpoint stores (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_columns(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] in 0..15 -> int32 [R, C / 8]: nibble k of word c is column 8 c + order[k]."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for k, column in enumerate(order):
        words |= values[:, column::8].long() << (4 * k)
    return _int32(words)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] in 0..15 -> int32 [R / 8, C]: nibble k of word r is row 8 r + k (GPTQ's qweight)."""
    words = torch.zeros(values.shape[0] // 8, values.shape[1], dtype=torch.int64)
    for k in range(8):
        words |= values[k::8, :].long() << (4 * k)
    return _int32(words)


@dataclass
class Quantized:
    """One linear quantized: q [out, in], per (group, out) scale (fp16) and zero point, g_idx [in]."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """The checkpoint's own weights, (q - z) * s (exact in float32)."""
        s, z = self.scales.float()[self.g_idx].t(), self.zeros.float()[self.g_idx].t()
        return (self.q.float() - z) * s

    def converted(self) -> torch.Tensor:
        """What Q4_1's layout holds: q * s + m with m = -z * s rounded to fp16."""
        s = self.scales.float()
        m = (-self.zeros.float() * s).half().float()
        return self.q.float() * s[self.g_idx].t() + m[self.g_idx].t()


def act_order_g_idx(in_features: int, group_size: int, seed: int) -> torch.Tensor:
    """GPTQ desc_act's g_idx: the inputs quantized in a permuted order (by the Hessian's diagonal,
    here random), each run of group_size of that order one group."""
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    return (torch.arange(in_features) // group_size)[torch.argsort(order)]


def quantize(w: torch.Tensor, group_size: int, sym: bool, g_idx: torch.Tensor | None = None) -> Quantized:
    """Round-to-nearest per group (the packing, not GPTQ's error feedback, is under test)."""
    out_features, in_features = w.shape
    size = in_features if group_size == -1 else group_size
    g_idx = torch.arange(in_features) // size if g_idx is None else g_idx
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, out_features, dtype=torch.float16)
    zeros = torch.empty(groups, out_features, dtype=torch.int32)
    q = torch.empty(out_features, in_features, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = (cols.abs().amax(dim=1) / 7).half().float()
            z = torch.full_like(s, 8)
        else:
            low, high = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            s = ((high - low) / 15).half().float()
            z = torch.round(-low / s).clamp(0, 15)
        scales[g], zeros[g] = s.half(), z.int()
        q[:, g_idx == g] = torch.round(cols / s[:, None] + z[:, None]).clamp(0, 15).int()
    return Quantized(q, scales, zeros, g_idx)


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack_columns(qz.q.t(), AWQ_ORDER), "qzeros": pack_columns(qz.zeros, AWQ_ORDER),
            "scales": qz.scales}


def gptq_tensors(qz: Quantized, v2: bool = False) -> dict[str, torch.Tensor]:
    stored = qz.zeros if v2 else (qz.zeros - 1) & 0xF  # the original format stores z - 1
    return {"qweight": pack_rows(qz.q.t()), "qzeros": pack_columns(stored), "scales": qz.scales,
            "g_idx": qz.g_idx.int()}


# ---------------------------------------------------------------------------------- unpacking


def test_unpacking_orders_against_reference():
    # A word whose nibble k holds k: AWQ's column order is [0, 2, 4, 6, 1, 3, 5, 7].
    word = _int32(torch.tensor([[sum(k << (4 * k) for k in range(8))]]))
    assert unpack_int4_columns(word, AWQ_ORDER).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert unpack_int4_columns(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_int4_rows(word).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    values = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4_columns(pack_columns(values, AWQ_ORDER), AWQ_ORDER).long(), values)
    assert torch.equal(unpack_int4_columns(pack_columns(values)).long(), values)
    assert torch.equal(unpack_int4_rows(pack_rows(values)).long(), values)
    # The top nibble is the int32's sign bit: 15 there is a negative word.
    assert bool((pack_rows(torch.full((8, 4), 15)) == -1).all())


# --------------------------------------------------------------------------------- conversion


def _weight(out_features: int = 48, in_features: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_conversion_exactness(group_size):
    """GPTQ symmetric: exact. AWQ: exact up to m = -z * s rounded to fp16, measured and bounded."""
    w = _weight()
    sym = quantize(w, group_size, sym=True)
    packed = convert_linear("gptq", gptq_tensors(sym), CheckpointQuant("gptq", group_size, zero_offset=1))
    expected_format = {32: "Q4_1", 64: "I4_G64"}.get(group_size, "I4_G128")
    assert packed.fmt.name == expected_format and packed.input_order is None
    assert torch.equal(packed.dequantize(), sym.dequantized())

    asym = quantize(w, group_size, sym=False)
    stats = ConversionStats()
    packed = convert_linear("awq", awq_tensors(asym), CheckpointQuant("awq", group_size), stats=stats)
    assert torch.equal(packed.dequantize(), asym.converted())
    error = (packed.dequantize() - asym.dequantized()).abs()
    steps = asym.scales.float()[asym.g_idx].t()
    # Half an fp16 ulp of z * s (z <= 15): at most 15 * s * 2^-11.
    assert float((error / steps).max()) <= 15 * 2**-11
    assert stats.rounded_groups > 0 and float(error.max()) > 0  # the rounding is real, not hidden
    assert stats.max_error == pytest.approx(float(error.max()), rel=1e-6)
    print(f"AWQ group {group_size}: max |converted - (q - z) * s| = {float(error.max()):.3g} "
          f"({float((error / steps).max()):.3%} of a step; {stats.rounded_groups}/{stats.groups} groups rounded)")


def test_gptq_zero_formats():
    """The original format stores z - 1 (its kernels add one back unmasked: a stored 15 is 16);
    gptq_v2 stores z."""
    w = _weight(16, 64)
    w[:8] = w[:8].abs()  # no negative weight: zero point 0, stored as 15 in the original format
    qz = quantize(w, 32, sym=False)
    v2 = convert_linear("v2", gptq_tensors(qz, v2=True), CheckpointQuant("gptq", 32))
    v1 = convert_linear("v1", gptq_tensors(qz), CheckpointQuant("gptq", 32, zero_offset=1))
    assert torch.equal(v2.dequantize(), qz.converted())
    wrapped = Quantized(qz.q, qz.scales, torch.where(qz.zeros == 0, 16, qz.zeros), qz.g_idx)
    assert bool((qz.zeros == 0).any())
    assert torch.equal(v1.dequantize(), wrapped.converted())


def test_desc_act_permutes_inputs_exactly():
    w = _weight(40, 256)
    qz = quantize(w, 64, sym=True, g_idx=act_order_g_idx(256, 64, seed=3))
    assert not torch.equal(qz.g_idx, torch.arange(256) // 64)
    packed = convert_linear("act", gptq_tensors(qz), CheckpointQuant("gptq", 64, 1, desc_act=True))
    assert packed.input_order is not None and packed.fmt.name == "I4_G64"
    assert torch.equal(packed.dequantize(), qz.dequantized())
    # As a layer: the activation's columns are taken in the packed order.
    holder = QuantizedWeight(40, 256, torch.float32)
    holder.data[0:24].assign("a", packed.narrow(0, 0, 24))
    holder.data[24:40].assign("b", packed.narrow(0, 24, 16))
    holder.finish("act")
    assert len(holder.segments) == 1  # same format and order: merged, one kernel call
    x = torch.randn(5, 256)
    torch.testing.assert_close(holder.linear(x, None), x @ qz.dequantized().T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(holder.float_weight(), qz.dequantized(), rtol=0, atol=0)
    # Parts of another act-order (k_proj quantized on its own) stay a segment of their own.
    other = quantize(_weight(8, 256, seed=1), 64, sym=True, g_idx=act_order_g_idx(256, 64, seed=4))
    holder = QuantizedWeight(48, 256, torch.float32)
    holder.data[0:40].assign("a", packed)
    holder.data[40:48].assign("b", convert_linear("b", gptq_tensors(other), CheckpointQuant("gptq", 64, 1, True)))
    holder.finish("two orders")
    assert len(holder.segments) == 2
    both = torch.cat((qz.dequantized(), other.dequantized()))
    torch.testing.assert_close(holder.linear(x, None), x @ both.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="desc_act"):
        packed.narrow(1, 0, 128)
    # g_idx whose groups are blocks in a shuffled order needs no permutation.
    blocks = torch.arange(256).view(8, 32)[torch.tensor([3, 1, 0, 2, 7, 5, 6, 4])].flatten() // 64
    shuffled_blocks = Quantized(qz.q, qz.scales, qz.zeros, blocks)
    packed = convert_linear("blocks", gptq_tensors(shuffled_blocks), CheckpointQuant("gptq", 64, 1, desc_act=True))
    assert packed.input_order is None and packed.fmt.name == "Q4_1"
    assert torch.equal(packed.dequantize(), shuffled_blocks.dequantized())


def test_config_errors():
    def config(**quantization):
        return transformers.LlamaConfig(quantization_config=quantization)

    assert checkpoint_quantization(transformers.LlamaConfig()) is None
    assert checkpoint_quantization(config(quant_method="gptq", bits=4, group_size=-1, checkpoint_format="gptq_v2",
                                          desc_act=True)) == CheckpointQuant("gptq", -1, 0, True)
    assert checkpoint_quantization(config(quant_method="awq", bits=4, group_size=128, version="GEMM",
                                          zero_point=True)) == CheckpointQuant("awq", 128)
    refused = {
        "only 4-bit GPTQ": dict(quant_method="gptq", bits=8, group_size=128),
        "only 4-bit AWQ": dict(quant_method="awq", bits=3, group_size=128),
        "quant_method 'bitsandbytes'": dict(quant_method="bitsandbytes", load_in_4bit=True),
        "quant_method 'exl2'": dict(quant_method="exl2", bits=4),
        "version 'gemv'": dict(quant_method="awq", bits=4, group_size=128, version="gemv"),
        "zero_point=False": dict(quant_method="awq", bits=4, group_size=128, zero_point=False),
        "format 'marlin'": dict(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"),
        "group_size=16": dict(quant_method="gptq", bits=4, group_size=16),
    }
    for message, quantization in refused.items():
        with pytest.raises(ValueError, match=message):
            checkpoint_quantization(config(**quantization))


# ------------------------------------------------------------------------------- whole models


def _hf_model(kind: str):
    common = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3)
    if kind == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)  # q/k/v with biases
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            param.copy_(param.half().float())  # what an fp16 checkpoint holds
    return model


@dataclass(frozen=True)
class Scheme:
    method: str  # "awq" | "gptq"
    group_size: int
    sym: bool = False
    desc_act: bool = False
    v2: bool = False

    def config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": self.sym, "true_sequential": True, "damp_percent": 0.01,
                "checkpoint_format": "gptq_v2" if self.v2 else "gptq"}


def write_checkpoints(kind: str, scheme: Scheme, quant_dir: str, float_dir: str) -> dict[str, torch.Tensor]:
    """The quantized checkpoint (fp16, as AutoAWQ / AutoGPTQ save it) and a float32 one of its
    converted weights dequantized; returns those float weights by parameter name."""
    model = _hf_model(kind)
    # Act-order follows each input's Hessian: layers reading one input (q/k/v, gate/up) share their g_idx.
    inputs = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}
    state: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            seed = 10 * int(module.split(".")[2]) + inputs[module.rpartition(".")[2]]
            g_idx = act_order_g_idx(param.shape[1], scheme.group_size, seed) if scheme.desc_act else None
            qz = quantize(param, scheme.group_size, scheme.sym, g_idx)
            parts = awq_tensors(qz) if scheme.method == "awq" else gptq_tensors(qz, scheme.v2)
            state.update({f"{module}.{part}": tensor for part, tensor in parts.items()})
            dequantized[name] = qz.converted()
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            state[name] = param.half()
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()},
                                os.path.join(quant_dir, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(quantization_config=scheme.config(), dtype="float16", architectures=[type(model).__name__])
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with torch.no_grad():
        for name, weight in dequantized.items():
            model.get_parameter(name).copy_(weight)
    model.save_pretrained(float_dir)
    return dequantized


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    train_tokenizer(path)
    return path


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(4, 384, (n,), generator=gen).tolist() for n in (1, 6, 19, 33)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


SCHEMES = {
    "llama-awq-g64": ("llama", Scheme("awq", 64)),
    "qwen2-awq-g128": ("qwen2", Scheme("awq", 128)),
    "qwen2-gptq-desc-act": ("qwen2", Scheme("gptq", 64, sym=True, desc_act=True)),
    "llama-gptq-v2-g-1": ("llama", Scheme("gptq", -1, v2=True)),
}


@pytest.mark.parametrize("case", SCHEMES)
def test_greedy_equals_transformers_on_dequantized(case, tokenizer_dir, tmp_path):
    kind, scheme = SCHEMES[case]
    quant_dir, float_dir = str(tmp_path / "quant"), str(tmp_path / "float")
    os.makedirs(quant_dir)
    weights = write_checkpoints(kind, scheme, quant_dir, float_dir)
    llm = LLM(quant_dir, tokenizer=tokenizer_dir, dtype="float32", num_kv_blocks=64, block_size=8,
              int8_activations=False)
    assert llm.llm_engine.model_config.quantization == scheme.method
    model = llm.llm_engine.worker.runner.model
    # Every decoder linear holds packed rows only: no float copy.
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    assert linears and all(isinstance(m.weight, QuantizedWeight) and not m.weight.is_float for m in linears)
    packed_bytes, found = packed_weight_bytes(model)
    expected = {64: {"I4_G64"}, 128: {"I4_G128"}, -1: {"I4_G128"}}[scheme.group_size]
    assert set(found) == expected
    assert packed_bytes < sum(w.numel() for w in weights.values()) * 4 * 0.17
    attn = model.model.layers[1].self_attn
    ordered = [s.weight.input_order is not None for s in attn.qkv_proj.weight.segments]
    assert ordered == [scheme.desc_act]  # q, k, v share their act-order (one input): one merged segment
    torch.testing.assert_close(attn.o_proj.weight.float_weight(), weights["model.layers.1.self_attn.o_proj.weight"],
                               rtol=0, atol=0)
    prompts = _prompts()
    assert _greedy(llm, prompts) == hf_greedy(float_dir, prompts, NEW_TOKENS)
    assert_no_leaks(llm)


def test_load_errors(tokenizer_dir, tmp_path):
    quant_dir, float_dir = str(tmp_path / "quant"), str(tmp_path / "float")
    os.makedirs(quant_dir)
    write_checkpoints("llama", Scheme("gptq", 64, sym=True, desc_act=True), quant_dir, float_dir)
    assert load_model_config(quant_dir, quantization="gptq").quantization == "gptq"
    with pytest.raises(ValueError, match="already quantized"):
        load_model_config(quant_dir, quantization="int4")
    with pytest.raises(ValueError, match="already quantized"):
        load_model_config(quant_dir, quantization="awq")
    with pytest.raises(ValueError, match="is for AWQ checkpoints"):
        load_model_config(float_dir, quantization="awq")
    neox_dir = tmp_path / "neox"  # its loader regroups per-head q/k/v rows of float tensors
    neox = transformers.GPTNeoXConfig(vocab_size=384, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=128, architectures=["GPTNeoXForCausalLM"],
                                      quantization_config=Scheme("awq", 64).config())
    neox.save_pretrained(neox_dir)
    (neox_dir / "model.safetensors").write_bytes(b"")  # never read: refused from the config
    with pytest.raises(ValueError, match="AWQ checkpoints of model_type 'gpt_neox' are not supported"):
        load_model_config(str(neox_dir))
    # Tensor parallelism cannot split act-order inputs (o_proj / down_proj are row-parallel).
    from pagedllm.layers.parallel_state import override_tp_state

    config = load_model_config(quant_dir)
    with override_tp_state(0, 2), pytest.raises(ValueError, match="desc_act"):
        build_model(config)
    # A layer missing a part is named.
    path = os.path.join(quant_dir, "model.safetensors")
    state = safetensors_torch.load_file(path)
    del state["model.layers.0.mlp.up_proj.qzeros"]
    safetensors_torch.save_file(state, path)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj has .* but no qzeros"):
        build_model(config)


def test_tensor_parallel_shards(tokenizer_dir, tmp_path):
    """Each of 2 ranks holds its rows (column-parallel) or its inputs (row-parallel) of the packed
    weights, cut on block boundaries: a group of 128 split over 2 ranks takes blocks of 64; and two
    ranks' greedy output equals transformers'."""
    from pagedllm.layers.parallel_state import override_tp_state

    quant_dir, float_dir = str(tmp_path / "quant"), str(tmp_path / "float")
    os.makedirs(quant_dir)
    weights = write_checkpoints("llama", Scheme("awq", 128), quant_dir, float_dir)
    config = load_model_config(quant_dir, dtype="float32")
    config.int8_activations = False  # keep the packed rows (not int8 tiles) to compare
    prefix = "model.layers.0."
    for rank in range(2):
        with override_tp_state(rank, 2):
            layer = build_model(config).model.layers[0]
        o_proj = weights[prefix + "self_attn.o_proj.weight"]
        torch.testing.assert_close(layer.self_attn.o_proj.weight.float_weight(), o_proj.chunk(2, dim=1)[rank],
                                   rtol=0, atol=0)
        assert layer.self_attn.o_proj.weight.formats == ["I4_G64"]
        gate, up = (weights[prefix + f"mlp.{name}.weight"].chunk(2)[rank] for name in ("gate_proj", "up_proj"))
        torch.testing.assert_close(layer.mlp.gate_up_proj.weight.float_weight(), torch.cat((gate, up)), rtol=0, atol=0)
    tp2 = LLM(quant_dir, tokenizer=tokenizer_dir, dtype="float32", num_kv_blocks=64, block_size=8,
              int8_activations=False, tensor_parallel_size=2)
    try:
        prompts = _prompts()
        assert _greedy(tp2, prompts) == hf_greedy(float_dir, prompts, NEW_TOKENS)
        assert_no_leaks(tp2)
    finally:
        tp2.llm_engine.shutdown()
