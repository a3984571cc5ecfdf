"""Every dense decoder family, and every family of sparse experts, runs through the C++ layer loop,
bit for bit as its Python layers.

Each family's tiny random model (the configs the transformers-equality tests use: test_model_families,
test_model_families_2026 and test_model_families_transformers) is built with weights the loop
multiplies (int8 rows, which every instruction-set level serves, and our bfloat16 / float32 panels
where this CPU has them). Its layer
programs must have no gaps, every step of test_layer_stack's STEPS must go through the loop, and
the logits must equal the Python layers' exactly: the Python layers are the ones the family tests
compare with transformers, so the loop's tokens are transformers' too. A family whose programs gain
a gap fails here instead of falling back to the Python layers unseen.
"""

from __future__ import annotations

import pytest
import torch
from requirements_here import require
from test_layer_stack import CONFIGS, STEPS, _count_stack_runs, _step_logits, _without_stack
from test_model_families import family_config as family_config_a
from test_model_families_2026 import family_config as family_config_b
from test_model_families_transformers import DENSE as DENSE_C
from test_model_families_transformers import family_config as family_config_c
from test_models import TINY
from test_moe_families import moe_config

from pagedllm.kernels import kernel_config, use_kernel_config
from pagedllm.kernels.attention import prompt_attention_amx_supported
from pagedllm.kernels.codes import AMX_KERNEL, CHUNKED_KERNEL, DECODE_KERNEL
from pagedllm.layers.cpu_gemm import panels_supported
from pagedllm.models import build_model, load_model_config
from pagedllm.models.families import FAMILIES
from pagedllm.models.layer_program import gaps_summary
from pagedllm.models.layer_stack import model_programs, stack_report

transformers = require("transformers")

pytestmark = pytest.mark.kernels

# One config per dense family of models/families.py (and the variants that change a layer's ops).
DENSE = {
    "llama": lambda: TINY["llama-gqa"],
    "mistral": lambda: family_config_a("mistral-window"),
    "qwen2": lambda: family_config_a("qwen2-window"),
    "qwen3": lambda: family_config_a("qwen3"),
    "gemma": lambda: family_config_a("gemma"),
    "gemma2": lambda: family_config_a("gemma2"),
    "gemma3": lambda: family_config_a("gemma3"),
    "phi3": lambda: family_config_a("phi3-longrope"),
    "gpt-neox": lambda: family_config_a("gpt-neox"),
    "gpt-neox-sequential": lambda: family_config_a("gpt-neox-sequential"),
    "starcoder2": lambda: family_config_a("starcoder2"),
    "olmo2": lambda: family_config_b("olmo2"),
    "olmo3": lambda: family_config_b("olmo3"),
    "granite": lambda: family_config_b("granite"),
    "stablelm": lambda: family_config_b("stablelm"),
    "stablelm-parallel": lambda: family_config_b("stablelm-parallel"),
    "phi": lambda: family_config_b("phi"),
    "phi-qk-layernorm": lambda: family_config_b("phi-qk-layernorm"),
    "cohere": lambda: family_config_b("cohere"),
    "cohere2": lambda: family_config_b("cohere2"),
    **{name: (lambda name=name: family_config_c(name)) for name in DENSE_C},
}


def _build(tmp_path, name: str, dtype: str, quantization: str | None):
    return _build_config(tmp_path, DENSE[name](), dtype, quantization)


def _build_config(tmp_path, config, dtype: str, quantization: str | None):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones
        for param_name, p in hf_model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                p.add_(torch.randn_like(p) * 0.1)
    hf_model.save_pretrained(tmp_path)
    model_config = load_model_config(str(tmp_path), dtype=dtype, quantization=quantization)
    return model_config, build_model(model_config, "cpu")


@pytest.mark.parametrize("weights", ["int8", "panels"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(DENSE))
def test_every_dense_family_runs_in_the_layer_loop(name, dtype, weights, tmp_path, monkeypatch) -> None:
    if weights == "panels" and not panels_supported(getattr(torch, dtype)):
        pytest.skip(f"not on this CPU: no {dtype} panels here (the int8 rows of this test ran)")
    with use_kernel_config(gemm="panels" if weights == "panels" else "auto"):
        model_config, model = _build(tmp_path, name, dtype, "int8" if weights == "int8" else None)
        programs = model_programs(model.model)
        assert not any(p.gaps for p in programs), gaps_summary(programs)
        assert stack_report(model.model).startswith("C++ layer loop")
        runs = _count_stack_runs(monkeypatch)
        with_stack = _step_logits(model, model_config)
        assert len(runs) == len(STEPS)  # every step ran in the loop (a batch-invariant plan or the kernels')
        without = _without_stack(model, model_config)
    for step, (a, b) in enumerate(zip(with_stack, without, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"


def test_every_dense_family_has_a_config_here() -> None:
    """A dense family cannot join families.FAMILIES without a config in DENSE, whose programs the test
    above holds to no gaps (families of experts: MOE below)."""
    covered = {DENSE[name]().model_type for name in DENSE}
    dense = {model_type for model_type, family in FAMILIES.items() if not family.moe}
    assert dense <= covered, f"add a config to DENSE for {sorted(dense - covered)}"


def test_a_layer_the_loop_cannot_run_names_its_gap(tmp_path) -> None:
    """Float32 weights torch multiplies (no panels asked): the report names the gap per layer."""
    with use_kernel_config(gemm="torch"):
        _, model = _build(tmp_path, "olmo2", "float32", None)
        report = stack_report(model.model)
    assert report.startswith("Python layers: ") and "a weight torch or oneDNN multiplies (layers 0-1)" in report


# Dense models given GPT-OSS's attention sinks: no transformers family has sinks over a dense MLP (GPT-OSS's
# own layers have experts, which the loop does not run: test_gpt_oss checks that this is their only gap).
# Qwen3 as configured here: q/k/v/o biases and a full then a sliding layer, as GPT-OSS alternates them;
# llama-head64: one window for all layers (the loop then plans mixed steps too) and heads the AMX
# prompt kernel takes.
SINKS = {"qwen3": lambda: family_config_a("qwen3"), "llama-head64": lambda: CONFIGS["llama-head64"]}


def _add_sinks(model) -> None:
    """A sink logit per head on every attention layer, far from zero as trained ones are, in the
    model's dtype as GPT-OSS's load."""
    gen = torch.Generator().manual_seed(7)
    dtype = model.model.embed_tokens.weight.dtype
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        sinks = torch.randn(attn.num_heads, generator=gen) * 2
        attn.sinks = torch.nn.Parameter(sinks.to(dtype), requires_grad=False)


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(SINKS))
def test_dense_layers_with_sinks_run_in_the_layer_loop(name, dtype, invariant, tmp_path, monkeypatch) -> None:
    """The loop passes each layer's sinks to the attention kernels: its programs have no gaps, the
    steps it plans run there, and the logits equal the Python layers' (attending through the same
    kernels with the same sinks) bit for bit; without the sinks they differ."""
    with use_kernel_config(batch_invariant=invariant):
        model_config, model = _build_config(tmp_path, SINKS[name](), dtype, "int8")
        plain = _step_logits(model, model_config)
        _add_sinks(model)
        model.model._stack_key = -1  # decide again, over the layers with sinks
        programs = model_programs(model.model)
        assert not any(p.gaps for p in programs), gaps_summary(programs)
        runs = _count_stack_runs(monkeypatch)
        with_stack = _step_logits(model, model_config)
        if kernel_config().batch_invariant:  # every step, every row through the decode kernel
            assert runs == [[DECODE_KERNEL]] * len(STEPS)
        elif name == "llama-head64":  # the loop plans the mixed steps of one window
            assert runs.count([DECODE_KERNEL]) == 4 and [CHUNKED_KERNEL] in runs
            bf16 = torch.empty(1, model_config.head_dim, dtype=torch.bfloat16)
            if dtype == "bfloat16" and prompt_attention_amx_supported(bf16, bf16):
                assert [AMX_KERNEL, CHUNKED_KERNEL] in runs
        else:  # windows differ between layers: mixed steps on the Python layers, decodes in the loop
            assert runs == [[DECODE_KERNEL]] * 4
        without = _without_stack(model, model_config)
    for step, (a, b, c) in enumerate(zip(with_stack, without, plain, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"
        assert not torch.equal(a, c), f"step {step}: the sinks changed nothing"


def _gpt_oss_config():
    from test_gpt_oss import gpt_oss_config

    return gpt_oss_config(vocab_size=256)


# The families of sparse experts (models/moe.py SparseMoE), each routing its own way: a softmax's top
# k renormalized (Qwen3-MoE) or not (Mixtral, OLMoE), a shared expert behind a sigmoid gate
# (Qwen2-MoE), a biased router's top k then a softmax, biased experts with a clamped SwiGLU and
# windows that differ between layers (GPT-OSS), norms after each block (FlexOlmo).
MOE = {
    "mixtral": lambda: moe_config("mixtral", vocab_size=256),
    "qwen3_moe": lambda: moe_config("qwen3_moe", vocab_size=256),
    "qwen2_moe": lambda: moe_config("qwen2_moe", vocab_size=256),
    "gpt_oss": _gpt_oss_config,
    "olmoe": lambda: family_config_c("olmoe"),
    "flex_olmo": lambda: family_config_c("flex_olmo"),
}
# Families of experts the loop does not run, with the gap that keeps them on the Python layers.
MOE_GAPS = {"mellum": "layers of different sizes"}  # dense and sparse layers in one model


@pytest.mark.parametrize("weights", ["int8", "panels"])
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MOE))
def test_every_moe_family_runs_in_the_layer_loop(name, dtype, invariant, weights, tmp_path, monkeypatch) -> None:
    """Router, routing, experts and a shared expert in the loop: no gaps, every decode step (and
    every step where one window serves all layers) through it, and the logits equal the Python
    layers' bit for bit, with and without batch invariance (routers through panels, or torch), over
    int8 rows and over our float panels (gated ones where the experts' activation is fused)."""
    if weights == "panels" and not panels_supported(getattr(torch, dtype)):
        pytest.skip(f"not on this CPU: no {dtype} panels here (the int8 rows of this test ran)")
    config = {"batch_invariant": invariant, "gemm": "panels" if weights == "panels" else "auto"}
    with use_kernel_config(**config):
        model_config, model = _build_config(tmp_path, MOE[name](), dtype, "int8" if weights == "int8" else None)
        programs = model_programs(model.model)
        assert not any(p.gaps for p in programs), gaps_summary(programs)
        assert stack_report(model.model).startswith("C++ layer loop")
        runs = _count_stack_runs(monkeypatch)
        with_stack = _step_logits(model, model_config)
        assert runs.count([DECODE_KERNEL]) >= sum(set(step) == {1} for step in STEPS)  # every decode step
        if invariant:
            assert len(runs) == len(STEPS)
        without = _without_stack(model, model_config)
    for step, (a, b) in enumerate(zip(with_stack, without, strict=True)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"


def test_every_moe_family_is_covered() -> None:
    """A family of experts cannot join families.FAMILIES without a config in MOE, or its gap named in
    MOE_GAPS and shown by stack_report (the test below)."""
    covered = {MOE[name]().model_type for name in MOE} | set(MOE_GAPS)
    moe = {model_type for model_type, family in FAMILIES.items() if family.moe}
    assert moe <= covered, f"add a config to MOE for {sorted(moe - covered)}"


def test_a_family_of_experts_the_loop_cannot_run_names_its_gap(tmp_path) -> None:
    _, model = _build_config(tmp_path, family_config_c("mellum"), "float32", "int8")
    report = stack_report(model.model)
    assert report.startswith("Python layers: ") and MOE_GAPS["mellum"] in report, report
