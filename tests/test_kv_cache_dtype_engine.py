"""The engine over a quantized or 16-bit KV cache: the block mechanisms move scales with their blocks
(copy-on-write for n and beams, swapping, prefix caching, recomputation), so a run squeezed through
a tight pool equals an unconstrained one token for token; the one-call layer loop equals the Python
layers; the CPU kernels equal the torch path; and the real default model keeps its predictions."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks
from kernel_levels import NOT_ON_THIS_CPU
from requirements_here import require_kernels
from test_sharing import BS, _mixed_params, _random_prompts, _token_ids, run_and_watch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import cpu_kernels, use_kernel_config
from pagedllm.layers.cpu_gemm import panels_supported
from pagedllm.models.layer_stack import LayerStack

KV_DTYPES = ["int8", "fp8", "int4"]
SIXTEEN_BIT = ["bfloat16", "float16"]  # under a float32 model: half its KV bytes, values rounded as written


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama-hd64")


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [torch.tensor([next(iter(d.values())) for d in o.prompt_logprobs[1:]]) for o in outputs]


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES + SIXTEEN_BIT)
def test_pool_holds_the_quantized_format(llama_dir, kv_cache_dtype: str) -> None:
    """The pool's dtype names the format, its rows hold values and scales (16-bit formats: the values,
    half a float32 pool's bytes), and a head size int4's groups do not divide is refused at start-up."""
    llm = LLM(model=llama_dir, num_kv_blocks=32, block_size=BS, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    cache = llm.llm_engine.worker.cache_engine
    storage = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[kv_cache_dtype]
    assert cache.gpu_pool.dtype == storage
    head_dim = llm.llm_engine.worker.model_config.head_dim
    assert cache.gpu_pool.shape[-1] == cache.kv_format.pool_row(head_dim)
    stats = llm.llm_engine.get_stats()
    assert stats["kv_cache_storage"] == (kv_cache_dtype if kv_cache_dtype in SIXTEEN_BIT else stats["kv_cache_dtype"])
    if kv_cache_dtype in SIXTEEN_BIT:
        auto = LLM(model=llama_dir, num_kv_blocks=32, block_size=BS, dtype="float32")
        assert 2 * stats["kv_bytes_per_token"] == auto.llm_engine.get_stats()["kv_bytes_per_token"]


def test_int4_refuses_heads_its_groups_do_not_divide(tiny_model_factory) -> None:
    with pytest.raises(ValueError, match="multiple of 32, this model's is 16"):
        LLM(model=tiny_model_factory("llama"), num_kv_blocks=32, kv_cache_dtype="int4")


@pytest.mark.parametrize(
    "kv_cache_dtype, mode, swap_space",
    [("int8", "swap", "1MiB"), ("int4", "auto", "1MiB"), ("fp8", "recompute", 0), ("float16", "swap", "1MiB")],
)
def test_tight_pool_equals_unconstrained(llama_dir, kv_cache_dtype: str, mode: str, swap_space) -> None:
    """n samples and beams (copy-on-write), preemption by swap and by recomputation: the same tokens
    as a roomy pool of the same format, and no block left behind."""
    prompts, params = _random_prompts([7, 16, 17, 30, 11, 23], seed=2), _mixed_params()
    roomy = LLM(model=llama_dir, num_kv_blocks=512, block_size=BS, kv_cache_dtype=kv_cache_dtype)
    expected, _ = run_and_watch(roomy, prompts, params)
    assert roomy.llm_engine.get_stats()["num_preempted"] == 0
    tight = LLM(model=llama_dir, num_kv_blocks=48, block_size=BS, swap_space=swap_space, preemption_mode=mode,
                kv_cache_dtype=kv_cache_dtype)
    got, peaks = run_and_watch(tight, prompts, params)
    assert _token_ids(got) == _token_ids(expected)
    stats = tight.llm_engine.get_stats()
    assert stats["num_preempted"] > 0 and peaks["blocks_saved_by_sharing"] > 0
    if mode != "recompute":
        assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0
    assert_no_leaks(tight)
    assert_no_leaks(roomy)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_prefix_hits_read_the_cached_quantized_blocks(llama_dir, kv_cache_dtype: str) -> None:
    base = _random_prompts([24], seed=5)[0]
    prompts = [base + tail for tail in _random_prompts([3, 5, 2], seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    plain = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, enable_prefix_caching=False,
                kv_cache_dtype=kv_cache_dtype)
    cached = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, kv_cache_dtype=kv_cache_dtype)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = [cached.generate([p], params, use_tqdm=False)[0] for p in prompts]  # later ones hit the first's blocks
    assert cached.llm_engine.get_stats()["prefix_cache_hit_tokens"] > 0
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == e.outputs[0].logprobs  # batch invariance: to the bit
    assert_no_leaks(cached)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "bfloat16", "float16"])
def test_layer_loop_equals_python_layers(llama_dir, kv_cache_dtype: str, monkeypatch) -> None:
    require_kernels()
    prompts = _random_prompts([9, 30, 17], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    run = LayerStack.run
    monkeypatch.setattr(LayerStack, "run", lambda self, *args: runs.append(1) or run(self, *args))
    stacked = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, kv_cache_dtype=kv_cache_dtype)
    dtype = stacked.llm_engine.model_config.dtype
    if not panels_supported(dtype):  # the layer loop multiplies through the packed panels
        pytest.skip(f"{NOT_ON_THIS_CPU}: no packed {dtype} GEMM at this level (the layer loop needs it)")
    with use_kernel_config(layer_stack=False):
        python = LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, kv_cache_dtype=kv_cache_dtype)
        expected = python.generate(prompts, params, use_tqdm=False)
    assert not runs
    got = stacked.generate(prompts, params, use_tqdm=False)
    assert len(runs) >= 12  # every step through the C++ loop
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == e.outputs[0].logprobs


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES + SIXTEEN_BIT)
def test_cpu_kernels_equal_the_torch_path(llama_dir, kv_cache_dtype: str) -> None:
    """Teacher-forced log-probabilities of the kernels (in-register decoding) against the torch path
    (the reference quantizer and dequantizer, what a GPU runs). The two paths' projections differ in
    the last float bits, which moves a few values across a rounding boundary of the quantizer (one
    step, ~1/254 of a row's range for int8), so the bar is that of a one-step difference, not of
    float rounding (the kernels themselves are held to float tolerance in test_kv_cache_dtype.py)."""
    require_kernels()
    prompts = _random_prompts([40, 70], seed=8)
    kernels = _prompt_logprobs(LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, dtype="float32",
                                   kv_cache_dtype=kv_cache_dtype), prompts)
    with use_kernel_config(cpu_kernels=False):
        reference = _prompt_logprobs(LLM(model=llama_dir, num_kv_blocks=128, block_size=BS, dtype="float32",
                                         kv_cache_dtype=kv_cache_dtype), prompts)
    for got, expected in zip(kernels, reference, strict=True):
        # A flipped step can move one position's log-probability by a few hundredths in this random
        # model; a misread row (wrong scale, layout or rotation) moves them all by far more.
        torch.testing.assert_close(got, expected, atol=5e-2, rtol=0)
        assert (got - expected).abs().mean() < (5e-3 if kv_cache_dtype == "int4" else 2e-3)



@pytest.mark.kernels(level="amx")
@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_bfloat16_prompts_on_amx_tiles_over_a_quantized_cache(llama_dir, kv_cache_dtype: str) -> None:
    """bfloat16 prompts with kernels chosen by row counts go to the AMX tile kernel, which reads the
    quantized rows as bfloat16 in their rotated basis: its teacher-forced log-probabilities against
    the batch-invariant path's (every row through the decode kernel, decoding in float32). bfloat16
    rounding moves them here by 0.04 on average for int8 and 0.08 for int4 (0.7 at most); a score
    off by a factor of two (a wrong shift) or a misrotated query, by 0.7 or 2 on average, 5 or 10 at most."""
    prompts = _random_prompts([40, 70, 130], seed=8)
    settings = dict(model=llama_dir, num_kv_blocks=256, block_size=BS, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    tiled_runs = cpu_kernels().kernel_branches()["prompt_attention_amx"][1]
    with use_kernel_config(batch_invariant=False):
        tiled = _prompt_logprobs(LLM(**settings), prompts)
    assert cpu_kernels().kernel_branches()["prompt_attention_amx"][1] > tiled_runs
    per_row = _prompt_logprobs(LLM(**settings), prompts)
    difference = torch.cat([(a - b).abs() for a, b in zip(tiled, per_row, strict=True)])
    assert difference.max() < 1.5 and difference.mean() < 0.2

def test_batch_invariance_holds_over_a_quantized_cache(llama_dir) -> None:
    prompt = _random_prompts([33], seed=11)[0]
    others = _random_prompts([5, 40, 12, 28, 9], seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = LLM(model=llama_dir, num_kv_blocks=256, block_size=BS, kv_cache_dtype="int8", enable_prefix_caching=False)
    alone = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    batch = llm.generate([{"prompt_token_ids": p} for p in [*others[:3], prompt, *others[3:]]], params,
                         use_tqdm=False)[3]
    assert batch.outputs[0].token_ids == alone.outputs[0].token_ids
    assert batch.outputs[0].logprobs == alone.outputs[0].logprobs
    assert_no_leaks(llm)


DEFAULT_MODEL_TEXT = (
    "The KV cache, not the weights, decides how many requests fit in a batch, and the batch size decides "
    "throughput. Systems that keep each request's KV cache in one contiguous tensor reserve space for the "
    "maximum length; profiled, only a fifth to a third of their KV memory held token states. PagedAttention "
    "splits the cache into fixed-size blocks. A request sees logical blocks, filled left to right; a "
    "per-sequence block table maps each logical block to a physical block anywhere in the pool. A new "
    "physical block is allocated only when the last one is full, so waste is under one block per sequence. "
    "Pages also enable sharing: each physical block has a reference count, and a write into a shared block "
    "triggers copy-on-write of that one block. Parallel sampling shares the prompt's blocks, beam search "
    "shares every block up to the point where the beams diverge, and a shared system prompt is computed once "
    "and mapped into every request that starts with it."
)


@pytest.mark.parametrize("kv_cache_dtype, bar",
                         [("int8", 0.98), ("fp8_e4m3", 0.9), ("int4", 0.8), ("bfloat16", 0.98), ("float16", 0.99)])
def test_default_model_keeps_its_predictions(kv_cache_dtype: str, bar: float) -> None:
    """The real default model, teacher-forced over a paragraph: the quantized cache's top-1 tokens
    agree with the float cache's. float32 with float activations, so that the cache is the only
    difference (bfloat16 and int8 activations round its small changes into flipped near-ties;
    benchmarks/kv_cache_dtype.py measures every setting over long texts)."""
    settings = dict(kv_cache_memory="64MiB", enable_prefix_caching=False, dtype="float32", int8_activations=False)
    auto = LLM(**settings)
    tokenizer = auto.llm_engine.tokenizer
    ids = tokenizer.encode(DEFAULT_MODEL_TEXT)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def top1(llm: LLM) -> list[int]:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        return [max(d, key=d.get) for d in out.prompt_logprobs[1:]]

    expected = top1(auto)
    got = top1(LLM(**settings, kv_cache_dtype=kv_cache_dtype))
    agreement = sum(a == b for a, b in zip(got, expected, strict=True)) / len(expected)
    assert agreement >= bar, f"{kv_cache_dtype}: {agreement:.3f} of {len(expected)} positions agree"
