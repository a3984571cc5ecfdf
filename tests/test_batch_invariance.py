"""Same request, same answer: a greedy or seeded request's tokens and logprobs, to the bit, do not
depend on what else is in its batch, on whether its prompt ran in one step or in chunks, nor on a
prefix-cache hit (pagedllm/kernels/invariance.py)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_no_leaks

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import use_kernel_config

NEW_TOKENS = 16
PROMPT_LEN = 70  # several blocks of 8, and several chunks of 16


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    return [greedy, seeded]


def _others(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 90))] for _ in range(count)]


def _answers(llm: LLM, target: list[int], others: list[list[int]], at: int) -> list[tuple]:
    """(token ids, per-token logprobs) of the target prompt's greedy and seeded requests, sent among
    ``others`` (the target's requests at position ``at``)."""
    greedy, seeded = _params()
    filler = SamplingParams(temperature=0.8, seed=1, max_tokens=NEW_TOKENS + 8, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in others]
    params = [filler] * len(others)
    prompts[at:at] = [{"prompt_token_ids": target}] * 2
    params[at:at] = [greedy, seeded]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs[at:at + 2]]


def _engine(model: str, dtype: str, chunk: int | None, prefix: bool) -> LLM:
    chunking = dict(long_prompt_chunk_tokens=chunk, max_num_batched_tokens=chunk) if chunk else \
        dict(long_prompt_chunk_tokens=4096, max_num_batched_tokens=8192)
    return LLM(model=model, dtype=dtype, num_kv_blocks=1024, block_size=8, enable_prefix_caching=prefix,
               seed=0, **chunking)


def _check_invariance(model: str, dtype: str, batch_sizes: tuple[int, ...]) -> None:
    whole = _engine(model, dtype, None, prefix=False)
    vocab = whole.llm_engine.vocab_size
    target = [random.Random(3).randrange(4, vocab) for _ in range(PROMPT_LEN)]
    alone = _answers(whole, target, [], 0)
    assert len(set(alone[0][0])) > 3, "a reference repeating one token proves little"
    # Prompts in chunks of 16 tokens, with prefix caching: the seeded copy of the target hits the
    # greedy copy's blocks.
    chunked = _engine(model, dtype, 16, prefix=True)
    for llm in (whole, chunked):
        for size in batch_sizes:
            others = _others(size - 1, vocab, seed=size)
            assert _answers(llm, target, others, at=len(others) // 2) == alone, (dtype, llm is chunked, size)
    # A prefix hit on a prompt that shares the target's first 48 tokens (6 blocks) only.
    chunked.generate([{"prompt_token_ids": target[:48] + [5, 6, 7]}], _params()[0], use_tqdm=False)
    hits = chunked.llm_engine.scheduler.block_manager.prefix_cache_hit_tokens
    assert _answers(chunked, target, _others(6, vocab, seed=9), at=3) == alone
    assert chunked.llm_engine.scheduler.block_manager.prefix_cache_hit_tokens >= hits + 48


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_answers_do_not_depend_on_the_batch(tiny_model_factory, dtype):
    _check_invariance(tiny_model_factory("llama"), dtype, (1, 7, 32, 64))


def test_default_model_answers_do_not_depend_on_the_batch():
    """The embedded GGUF model (int8 activations over its packed weights), as `serve` runs it."""
    from pagedllm.models.loader import default_model_path

    _check_invariance(default_model_path(), "auto", (7, 32, 64))


@pytest.fixture(scope="module")
def sinks_and_latent_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random GPT-OSS (attention sinks, in the C++ attention kernels) and DeepSeek-V3 (latent
    attention on the torch path, grouped sigmoid routing) folders."""
    from conftest import train_tokenizer
    from test_deepseek_v3 import save_deepseek
    from test_gpt_oss import random_gpt_oss

    gpt_oss = str(tmp_path_factory.mktemp("gpt-oss"))
    train_tokenizer(gpt_oss)
    random_gpt_oss().save_pretrained(gpt_oss)
    deepseek = str(tmp_path_factory.mktemp("deepseek-v3"))
    save_deepseek(deepseek, with_tokenizer=True)
    return {"gpt-oss": gpt_oss, "deepseek-v3": deepseek}


def test_sinks_answers_do_not_depend_on_the_batch_nor_the_chunks(sinks_and_latent_models):
    """GPT-OSS: every attention row, sinks included, through the decode kernel, and routers that
    multiply each row alone-equal: the same bits alone and in batches, with prompts whole or in
    chunks, and after a prefix-cache hit."""
    _check_invariance(sinks_and_latent_models["gpt-oss"], "float32", (1, 3, 8))


def test_latent_attention_answers_do_not_depend_on_the_batch(sinks_and_latent_models):
    """DeepSeek-V3: decodes attend one sequence at a time over its own context (no padding to the
    batch's longest) and routers multiply each row alone-equal, so a request's tokens and logprobs are
    the same bits alone and among others of other lengths, for prompts run whole. (How a prompt is
    split into chunks still moves their last bits: kernels/invariance.py.)"""
    family = "deepseek-v3"
    llm = _engine(sinks_and_latent_models[family], "float32", None, prefix=False)
    vocab = llm.llm_engine.vocab_size
    target = [random.Random(3).randrange(4, vocab) for _ in range(PROMPT_LEN)]
    alone = _answers(llm, target, [], 0)
    for size in (3, 8, 32):
        others = _others(size - 1, vocab, seed=size)
        assert _answers(llm, target, others, at=len(others) // 2) == alone, (family, size)


@pytest.mark.parametrize("invariant", [True, False])
def test_mixed_steps_attend_every_row_as_a_decode(tiny_model_factory, invariant, kernel_level):
    """Under batch invariance a step with prompts attends every row with the decode kernel; without
    it (the setting that trades invariance for speed) its decodes and short chunks take the chunked
    kernel, whose sums differ from the decode kernel's in the last bits."""
    with use_kernel_config(batch_invariant=invariant):
        llm = _engine(tiny_model_factory("llama"), "float32", 16, prefix=False)
        vocab = llm.llm_engine.vocab_size
        _answers(llm, _others(1, vocab, seed=1)[0] + [4] * 40, _others(5, vocab, seed=2), at=2)
    kernel_level.assert_ran("paged_decode_attention")
    assert (kernel_level.runs("paged_chunked_attention") == 0) == invariant


ROW_COUNTS = (1, 2, 3, 4, 5, 7, 16, 33, 49, 64, 100)


def _linears(kernel_level) -> dict[str, object]:
    """Every product a linear layer can take at this level, as f(x) for float32 x [rows, 512]."""
    from test_quantized import _packed

    from pagedllm.layers.cpu_gemm import OneDNNWeight, PanelWeight
    from pagedllm.quantization.int8_tiles import tile_for_int8
    from pagedllm.quantization.kernels import packed_linear

    torch.manual_seed(0)
    weight = torch.randn(100, 512)
    products = {}
    if kernel_level.has("dense_gemm_f32"):
        panels = PanelWeight(weight)
        products["panels float32"] = lambda x: panels.linear(x, None)
    if kernel_level.has("dense_gemm_bf16"):
        panels_bf16 = PanelWeight(weight.bfloat16())
        products["panels bfloat16"] = lambda x: panels_bf16.linear(x.bfloat16(), None)
    if torch.backends.mkldnn.is_available():
        onednn = OneDNNWeight(weight)
        products["oneDNN float32 (K=512)"] = lambda x: onednn.linear(x, None)
    for name in ("Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        packed = _packed(name, 100, 512, seed=1)
        products[f"{name} float activations"] = (
            lambda x, p=packed: packed_linear(x, p.data, p.fmt, 512, None))
        tiled = tile_for_int8(packed.data, packed.fmt, 512) if kernel_level.has("int8_linear_dot") else None
        if tiled is not None:
            products[f"{name} int8 activations"] = lambda x, t=tiled: t.linear(x, None)
    return products


def test_linear_rows_do_not_depend_on_their_batch(kernel_level):
    """Each row of every linear product at each level: the same bits alone, in any batch size, at
    any position (the panel kernels, int8 dot products, packed blocks with float activations)."""
    x = torch.randn(max(ROW_COUNTS), 512, generator=torch.Generator().manual_seed(5))
    for name, product in _linears(kernel_level).items():
        full = product(x)
        for rows in ROW_COUNTS:
            assert torch.equal(product(x[:rows]), full[:rows]), f"{name} at {kernel_level.level}: {rows} rows"
        assert torch.equal(product(x[37:38]), full[37:38]), name
