"""GPT-OSS against transformers on tiny random models, through the paged KV cache and the engine.

What GPT-OSS adds to the one decoder: attention sinks (a learned logit per head in every softmax's
denominator, served on CPU by the C++ attention kernels, on a GPU by the torch path), sliding and
full layers alternating, biases on q/k/v/o, yarn rope (``truncate`` off, as released), and its
mixture of experts (a router with a bias choosing the top k logits before a softmax over them;
experts with biases and the clamped SwiGLU; fused 3-D expert tensors with gate and up interleaved).
Its released checkpoints store the experts in MXFP4: those load packed, never as floats, and equal
transformers running the same weights dequantized.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from oracle import hf_greedy
from requirements_here import require, require_kernels
from test_gguf_families import _logits
from test_model_families import VOCAB, WINDOW, hf_prompt_and_step, random_hf_model
from test_models import PagedBatch, make_caches

from pagedllm import LLM, SamplingParams
from pagedllm.attention import PagedAttention
from pagedllm.kernels import cpu_kernels, use_kernel_config
from pagedllm.models import build_model, load_model_config
from pagedllm.models.layer_program import layer_program
from pagedllm.models.moe import ClampedSwiGLU, SparseMoE
from pagedllm.quantization.formats import MXFP4, dequantize
from pagedllm.quantization.int8_tiles import Int8TiledTensor, resolve_int8_activations
from pagedllm.quantization.kernels import cpu_kernels_serve, packed_linear
from pagedllm.quantization.mxfp4 import pack_mxfp4, quantize_mxfp4
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight

transformers = require("transformers")

PROMPT_LENS = (1, 6, 9, 21)  # inside the window of 8, just past it, well past it; blocks of 4
NEW_TOKENS = 12
# Far below the released 7.0, so that the tiny model's gate/up values (about N(0, 1.6)) reach it.
SWIGLU_LIMIT = 1.5


def gpt_oss_config(**overrides):
    """Two layers, sliding then full; 4 heads over 2 KV heads of 16; 4 experts, 2 per token; yarn
    rope over a short original context so that its ramp reaches the rotated channels."""
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64}
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                    max_position_embeddings=256, initializer_range=0.2, swiglu_limit=SWIGLU_LIMIT,
                    rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    settings.update(overrides)
    return transformers.GptOssConfig(**settings)


def random_gpt_oss(**overrides):
    """A random model whose sinks and expert biases are far from zero (a decoder ignoring them fails)."""
    hf_model = random_hf_model(gpt_oss_config(**overrides))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4, generator=gen) * 2)
            experts = layer.mlp.experts
            experts.gate_up_proj_bias.copy_(torch.randn(experts.gate_up_proj_bias.shape, generator=gen) * 0.5)
            experts.down_proj_bias.copy_(torch.randn(experts.down_proj_bias.shape, generator=gen) * 0.5)
    return hf_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp("gpt_oss"))
    random_gpt_oss().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_hf(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def set_attention_kernels(model, use_kernel: bool) -> None:
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.use_cpu_kernel = use_kernel


def prompts_for(seed: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lens]


def test_settings_reach_the_layers(gpt_oss_dir: str) -> None:
    """What the equality tests exercise, read off the built model."""
    model = build_model(load_model_config(gpt_oss_dir, dtype="float32"), "cpu")
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None]
    for layer in layers:
        attn = layer.self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
        assert attn.attn.sinks is not None and bool((attn.attn.sinks.abs() > 0.05).all())
        moe = layer.mlp
        assert isinstance(moe, SparseMoE) and moe.routing == "topk_softmax" and moe.gate.bias is not None
        expert = moe.experts[0]
        assert isinstance(expert.act_and_mul, ClampedSwiGLU) and expert.act_and_mul.limit == SWIGLU_LIMIT
        assert expert.gate_up_proj.bias is not None and expert.down_proj.bias is not None
        # The C++ layer loop takes the sinks, the router and the experts; only float32 weights where
        # no panel kernel multiplies them can keep these layers out of it (test_layer_programs runs
        # them in the loop over int8 rows).
        gaps = layer_program(layer, list(model.model.rotary), torch.float32).gaps
        assert all(gap.endswith("a weight torch or oneDNN multiplies") for gap in gaps), gaps
        assert attn.attn.cpu_kernels_apply  # the C++ attention kernels take sinks


def test_sinks_and_clamp_change_the_reference(gpt_oss_dir: str) -> None:
    """The equality tests can fail: without its sinks, or without the clamp, transformers' own
    greedy output is another."""
    hf_model = load_hf(gpt_oss_dir)
    prompts = prompts_for(4)
    reference = _hf_greedy(hf_model, prompts)
    with torch.no_grad():
        saved = [layer.self_attn.sinks.clone() for layer in hf_model.model.layers]
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink in the denominator
        assert _hf_greedy(hf_model, prompts) != reference
        for layer, sinks in zip(hf_model.model.layers, saved):
            layer.self_attn.sinks.copy_(sinks)
    for layer in hf_model.model.layers:
        layer.mlp.experts.limit = float("inf")
    assert _hf_greedy(hf_model, prompts) != reference


def _hf_greedy(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    hf_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=3)[0, len(p):].tolist()
                for p in prompts]


def attention_kernel_runs() -> dict[str, int]:
    """Calls of each C++ attention kernel since the module loaded."""
    branches = cpu_kernels().kernel_branches()
    return {name: branches[name][1] for name in ATTENTION_KERNELS}


ATTENTION_KERNELS = ("paged_decode_attention", "paged_chunked_attention", "prompt_attention_amx")


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_logits_match_transformers(gpt_oss_dir: str, use_kernel: bool, invariant: bool) -> None:
    """A batched prefill of prompts inside, across and past the window, then a decode step: logits
    equal transformers'. ``use_kernel``: through the C++ attention kernels (the decode kernel for
    every row under batch invariance, else the chunked kernel for the prompts), which must serve
    every attention of the step; else the torch path, which must serve them all."""
    if use_kernel:
        require_kernels()
    hf_model = load_hf(gpt_oss_dir)
    model_config = load_model_config(gpt_oss_dir, dtype="float32")
    model = build_model(model_config, "cpu")
    set_attention_kernels(model, use_kernel)
    prompts = prompts_for(1)
    next_tokens = [5, 17, 101, 42]
    before = attention_kernel_runs() if cpu_kernels() is not None else None
    with use_kernel_config(batch_invariant=invariant):
        prefill, decode = _logits(model, model_config, prompts, next_tokens)
    if use_kernel:
        runs = {name: n - before[name] for name, n in attention_kernel_runs().items()}
        layers = len(model.model.layers)
        # Per layer: the prefill (every row as a decode, or the chunked kernel) and the decode step.
        expected_decodes = 2 * layers if invariant else layers
        assert runs == {"paged_decode_attention": expected_decodes,
                        "paged_chunked_attention": 0 if invariant else layers, "prompt_attention_amx": 0}, runs
    elif before is not None:
        assert attention_kernel_runs() == before  # the torch path served every layer
    for i, (prompt, token) in enumerate(zip(prompts, next_tokens)):
        ref_prefill, ref_step = hf_prompt_and_step(hf_model, prompt, token)
        torch.testing.assert_close(prefill[i], ref_prefill, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[i], ref_step, atol=1e-4, rtol=1e-4)
    if not use_kernel:
        assert model.model._stack is None  # the Python layers ran


# Per sequence, the tokens it computes at each step: chunks after a cached context, decodes and
# both mixed in one batch, chunks spanning the window and block boundaries.
CHUNK_PLAN = ([4, 4, 4, 4, 4, 4], [9, 1, 1, 1, 11, 1], [1, 1, 1, 1, 1, 19])


@pytest.mark.parametrize("invariant", [True, False])
def test_chunked_steps_match_transformers(gpt_oss_dir: str, invariant: bool) -> None:
    """Sequences of 24 tokens fed in the chunks of CHUNK_PLAN: every row's logits equal
    transformers' over the whole sequence, the C++ attention kernels serving every step (the decode
    kernel for every row under batch invariance, else the chunked kernel for mixed steps)."""
    require_kernels()
    before = attention_kernel_runs()
    with use_kernel_config(batch_invariant=invariant):
        _check_chunked_steps(gpt_oss_dir)
    runs = {name: n - before[name] for name, n in attention_kernel_runs().items()}
    calls = len(CHUNK_PLAN[0]) * gpt_oss_config().num_hidden_layers  # every step has a chunk
    kernel = "paged_decode_attention" if invariant else "paged_chunked_attention"
    assert runs == {**dict.fromkeys(ATTENTION_KERNELS, 0), kernel: calls}, runs


def _check_chunked_steps(gpt_oss_dir: str) -> None:
    hf_model = load_hf(gpt_oss_dir)
    model_config = load_model_config(gpt_oss_dir, dtype="float32")
    model = build_model(model_config, "cpu")
    sequences = prompts_for(2, (24, 24, 24))
    with torch.inference_mode():
        expected = [hf_model(torch.tensor([s])).logits[0] for s in sequences]
    caches = make_caches(model_config)
    batch = PagedBatch(len(sequences))
    done = [0] * len(sequences)
    got: list[list[torch.Tensor]] = [[] for _ in sequences]
    with torch.inference_mode():
        for step in range(len(CHUNK_PLAN[0])):
            sizes = [plan[step] for plan in CHUNK_PLAN]
            positions, meta = batch.step(sizes)
            ids = torch.tensor([t for s, d, n in zip(sequences, done, sizes) for t in s[d:d + n]])
            logits = model.compute_logits(model(ids, positions, caches, meta)).split(sizes)
            for i, n in enumerate(sizes):
                got[i].append(logits[i])
                done[i] += n
    for i, ref in enumerate(expected):
        torch.testing.assert_close(torch.cat(got[i]), ref, atol=1e-4, rtol=1e-4)


def test_engine_greedy_equals_transformers(gpt_oss_dir: str) -> None:
    """Through the engine (scheduler, block manager with windows, sampler; prompts chunked by a small
    token budget): greedy tokens equal transformers' token for token, no block leaked."""
    require_kernels()
    llm = LLM(gpt_oss_dir, dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    prompts = prompts_for(3, (3, 9, 21))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    before = attention_kernel_runs()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # The decode kernel attends every row (batch invariance, the default): every step, every layer.
    assert attention_kernel_runs()["paged_decode_attention"] - before["paged_decode_attention"] >= (
        NEW_TOKENS * gpt_oss_config().num_hidden_layers)
    assert got == hf_greedy(gpt_oss_dir, prompts, NEW_TOKENS)
    assert_no_leaks(llm)


def test_tensor_parallel_rank_holds_its_heads_sinks(gpt_oss_dir: str) -> None:
    """Under tensor parallelism each rank's attention holds the sinks of its own heads."""
    from pagedllm.layers.parallel_state import override_tp_state
    from pagedllm.models.decoder import DecoderForCausalLM

    hf_model = load_hf(gpt_oss_dir)
    weights = list(hf_model.state_dict().items())
    for rank in (0, 1):
        with override_tp_state(rank, 2):
            model = DecoderForCausalLM(hf_model.config)
            model.load_weights(weights)
        for ours, theirs in zip(model.model.layers, hf_model.model.layers):
            assert torch.equal(ours.self_attn.attn.sinks, theirs.self_attn.sinks[2 * rank:2 * rank + 2])


def test_tensor_parallel_greedy(gpt_oss_dir: str) -> None:
    """Two ranks: heads and their sinks split, each expert split like an MLP (its down bias added
    once), the router whole on both: greedy equals transformers'."""
    from test_tensor_parallel import _children_alive, _engine_kwargs

    prompts = prompts_for(7, (5, 17))
    tp2 = LLM(gpt_oss_dir, tensor_parallel_size=2, **_engine_kwargs(num_kv_blocks=96))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in tp2.generate(prompts, params, use_tqdm=False)]
        assert got == hf_greedy(gpt_oss_dir, prompts, NEW_TOKENS)
        assert_no_leaks(tp2)
    finally:
        tp2.llm_engine.shutdown()
    assert not _children_alive()


# ---------------------------------------------------------------- MXFP4


def test_mxfp4_format_is_gguf_and_transformers_mxfp4() -> None:
    """Our MXFP4 blocks are GGUF's (gguf-py quantizes the same weights to the same bytes and
    dequantizes them to our values), and hold what transformers dequantizes from a checkpoint's
    blocks and scales; the C++ kernels and the torch reference multiply it."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert MXFP4.id == GGMLQuantizationType.MXFP4.value
    weight = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(0)) * 0.3
    weight[0, 0, :32] = 0  # a block of zeros
    blocks, scales = quantize_mxfp4(weight)
    packed = pack_mxfp4("w", blocks, scales)
    assert packed.data.shape == (24, 2 * MXFP4.block_bytes) and packed.in_features == 64
    ours = dequantize(packed.data, MXFP4, 64)
    mxfp4 = GGMLQuantizationType.MXFP4
    assert np.array_equal(packed.data.numpy(), gguf_quantize(weight.reshape(24, 64).numpy(), mxfp4))
    assert np.array_equal(ours.numpy(), gguf_dequantize(packed.data.numpy(), mxfp4))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, rows]
    assert torch.equal(ours.view(3, 8, 64), theirs.transpose(1, 2))
    assert (ours.view(3, 8, 64) - weight).abs().max() < 0.3 * weight.abs().max()  # a quantization of it

    assert cpu_kernels_serve(torch.device("cpu"), 64, MXFP4)  # the C++ kernels decode MXFP4 blocks
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(packed_linear(x, packed.data, MXFP4, 64, None), x @ ours.t())
    with use_kernel_config(quant_kernel="torch"):  # and the torch reference gives the same product
        torch.testing.assert_close(packed_linear(x, packed.data, MXFP4, 64, None), x @ ours.t())


def write_mxfp4_checkpoint(hf_model, folder: str, float_folder: str) -> None:
    """``hf_model`` as a released GPT-OSS checkpoint stores it (experts as MXFP4 blocks and scales,
    quantization_config mxfp4) under ``folder``, and with those experts dequantized as a float
    checkpoint under ``float_folder`` (transformers' reference for the same weights)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model.save_pretrained(float_folder)
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # transformers' fused [E, in, out] -> nn.Linear's [E, out, in], blocks of 32 along in.
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
            quantized[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16).contiguous()
            quantized[f"{name}_scales"] = scales.contiguous()
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantized[name] = dequantized[name] = tensor
    save_file(quantized, os.path.join(folder, "model.safetensors"))
    save_file(dequantized, os.path.join(float_folder, "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def test_mxfp4_checkpoint_stays_packed_and_matches_dequantized(tmp_path, tokenizer) -> None:
    """An MXFP4 checkpoint loads with every expert weight packed (MXFP4 rows only, no float copy)
    and runs greedy equal to transformers on the same weights dequantized, no block leaked."""
    folder, float_folder = str(tmp_path / "mxfp4"), str(tmp_path / "dequantized")
    os.makedirs(folder)
    write_mxfp4_checkpoint(random_gpt_oss(), folder, float_folder)
    tokenizer.save_pretrained(folder)

    model_config = load_model_config(folder, dtype="float32")
    assert model_config.quantization == "mxfp4"
    model = build_model(model_config, "cpu")
    # With int8 activations (on wherever the CPU has an integer dot product) the MXFP4 rows are
    # re-tiled for the int8 kernels (4.25 bits per weight, as the file).
    tiled = resolve_int8_activations(model_config.int8_activations, torch.device("cpu"))
    for layer in model.model.layers:
        for expert in layer.mlp.experts:
            for linear in (expert.gate_up_proj, expert.down_proj):
                weight = linear.weight
                assert isinstance(weight, QuantizedWeight) and linear.packed_weight is None
                assert weight.formats == ["MXFP4/int8-tiled" if tiled else "MXFP4"]
                assert all(isinstance(seg.weight, Int8TiledTensor if tiled else PackedTensor)
                           for seg in weight.segments)
        # Attention stays float (its holders turned back into parameters).
        assert not isinstance(getattr(layer.self_attn.qkv_proj, "weight", None), QuantizedWeight)

    # Float activations: the exact product with the dequantized weights, as transformers computes it.
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64, int8_activations=False)
    prompts = prompts_for(6, (2, 9, 19))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(float_folder, prompts, NEW_TOKENS)
    assert_no_leaks(llm)


def test_mxfp4_refused_outside_gpt_oss(tmp_path) -> None:
    """Only GPT-OSS's expert tensors are mapped from MXFP4 blocks: another family's is refused by name."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    random_hf_model(config).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="MXFP4 checkpoints of model_type 'llama'"):
        load_model_config(str(tmp_path))
