"""DeepSeek-V3 against transformers on tiny random models, through a paged cache of latent rows.

Three layers, the first dense (first_k_dense_replace=1), the others routing to 2 of 8 experts in
2 groups (1 group kept) beside a shared expert; 4 heads whose keys and values come from a
32-wide latent plus an 8-wide shared rope key: one 40-value row per token and layer in the pool.
Blocks hold 4 tokens, so prompts of 1 to 21 tokens end inside and across blocks. Variants: the
low-rank query (q_lora_rank 24) and the direct q_proj (None), and yarn rope with mscale_all_dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from oracle import hf_greedy
from requirements_here import require
from test_models import PagedBatch

from pagedllm import LLM, SamplingParams
from pagedllm.models import build_model, load_model_config

transformers = require("transformers")

VOCAB = 384  # conftest's trained tokenizer
BS = 4
LAYERS = 3
LATENT_ROW = 32 + 8  # kv_lora_rank + qk_rope_head_dim
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS = {
    "q-lora": {},
    "q-proj": {"q_lora_rank": None},
    "yarn": {"rope_parameters": YARN},
}


def deepseek_config(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )
    settings.update(overrides)
    return transformers.DeepseekV3Config(**settings)


def save_deepseek(path: str, with_tokenizer: bool = False, **overrides):
    """random_deepseek saved under path."""
    if with_tokenizer:
        train_tokenizer(path)
    hf_model = random_deepseek(**overrides)
    hf_model.save_pretrained(path)
    return hf_model


def random_deepseek(**overrides):
    """A seeded random model, its 1-D weights and the routing bias made to count (a zero
    e_score_correction_bias would leave choosing and weighing on the same scores)."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(deepseek_config(**overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return hf_model


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("deepseek-v3"))
    save_deepseek(path, with_tokenizer=True)
    return path


def _random_tokens(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]


# ------------------------------------------------------------------ the model, step by step

# Per step, the tokens each of 4 sequences computes: prompts (a 21-token one in two chunks), then a
# mixed step of decodes beside a 15-token chunk after 6 cached tokens, then decodes only.
SCHEDULE = [[1, 7, 13, 6], [1, 1, 1, 15], [1, 1, 1, 1]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_through_latent_pages(variant: str, tmp_path) -> None:
    hf_model = save_deepseek(str(tmp_path), **VARIANTS[variant])
    model_config = load_model_config(str(tmp_path), dtype="float32")
    model = build_model(model_config, "cpu")
    sequences = _random_tokens([sum(step[i] for step in SCHEDULE) for i in range(4)], seed=1)
    with torch.inference_mode():
        expected = [hf_model(torch.tensor([ids])).logits[0] for ids in sequences]
    pool = torch.zeros(LAYERS, 1, 32, BS, 1, LATENT_ROW)
    caches = [(pool[layer, 0],) for layer in range(LAYERS)]
    batch = PagedBatch(4, num_blocks=32, block_size=BS)
    done = [0] * 4
    for counts in SCHEDULE:
        positions, meta = batch.step(counts)
        ids = torch.tensor([t for i, n in enumerate(counts) for t in sequences[i][done[i]:done[i] + n]])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, positions, caches, meta)).split(counts)
        for i, n in enumerate(counts):
            torch.testing.assert_close(logits[i], expected[i][done[i]:done[i] + n], atol=1e-4, rtol=1e-4)
            done[i] += n
    # Every computed token left one latent row per layer in its slot, and nothing else was written.
    slots = {batch._slot(i, pos) for i, n in enumerate(done) for pos in range(n)}
    written = pool.view(LAYERS, -1, LATENT_ROW).abs().sum(dim=-1) != 0  # [layers, slots]
    assert all(set(written[layer].nonzero().flatten().tolist()) == slots for layer in range(LAYERS))


def test_yarn_mscale_reaches_the_softmax_scale(tmp_path) -> None:
    """The scale the yarn variant's equality rests on: qk_head_dim^-0.5 times mscale^2 (mscale > 1 here)."""
    save_deepseek(str(tmp_path), rope_parameters=YARN)
    model = build_model(load_model_config(str(tmp_path), dtype="float32"), "cpu")
    mscale = 0.1 * math.log(4.0) + 1.0
    assert model.model.layers[0].self_attn.attn.scale == pytest.approx(24**-0.5 * mscale**2)


def test_dense_and_moe_layers_follow_the_config() -> None:
    """first_k_dense_replace dense layers, then experts every moe_layer_freq-th layer (DeepSeek's and
    vLLM's rule; transformers' config has no moe_layer_freq, which reads as 1 there and here)."""
    from pagedllm.models.deepseek_moe import DeepseekMoE
    from pagedllm.models.deepseek_v3 import DeepseekV3ForCausalLM

    def sparse_layers(**overrides) -> list[int]:
        config = deepseek_config(num_hidden_layers=5, **overrides)
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(config)
        return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, DeepseekMoE)]

    assert sparse_layers() == [1, 2, 3, 4]
    assert sparse_layers(first_k_dense_replace=2) == [2, 3, 4]
    assert sparse_layers(moe_layer_freq=2) == [2, 4]


# ------------------------------------------------------------------ the engine


def test_pool_holds_one_latent_row_per_token_and_layer(deepseek_dir) -> None:
    llm = LLM(deepseek_dir, dtype="float32", block_size=BS, num_kv_blocks=20)
    cache_engine = llm.llm_engine.worker.cache_engine
    assert tuple(cache_engine.gpu_pool.shape) == (LAYERS, 1, 20, BS, 1, LATENT_ROW)
    assert all(len(views) == 1 and tuple(views[0].shape) == (20, BS, 1, LATENT_ROW)
               for views in cache_engine.kv_caches)
    bytes_per_token = LAYERS * LATENT_ROW * 4  # float32
    assert llm.llm_engine.kv_cache_info["kv_bytes_per_token"] == bytes_per_token
    # A byte budget buys blocks of latent rows, not of per-head K and V.
    budget = LLM(deepseek_dir, dtype="float32", block_size=BS, kv_cache_memory=100 * BS * bytes_per_token + 7)
    assert budget.llm_engine.num_gpu_blocks == 100


def test_batched_greedy_equals_transformers(deepseek_dir) -> None:
    """Prompts of several lengths at once, prefills chunked beside running decodes."""
    prompts = _random_tokens([3, 9, 14, 21], seed=2)
    llm = LLM(deepseek_dir, dtype="float32", block_size=BS, num_kv_blocks=64, enable_chunked_prefill=True,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(deepseek_dir, prompts, 16)
    assert_no_leaks(llm)


def test_prefix_cache_hit_equals_transformers(deepseek_dir) -> None:
    prefix = _random_tokens([3 * BS], seed=3)[0]  # three full blocks
    prompts = [prefix + suffix for suffix in _random_tokens([2, 5], seed=4)]
    llm = LLM(deepseek_dir, dtype="float32", block_size=BS, num_kv_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = []
    for prompt in prompts:
        before = engine.get_stats()["prefix_cache_hit_tokens"]
        got.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        hits = engine.get_stats()["prefix_cache_hit_tokens"] - before
    assert hits == 3 * BS  # the second prompt read the first one's latent rows
    assert got == hf_greedy(deepseek_dir, prompts, 12)
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tight_pool_preempts_and_keeps_outputs(deepseek_dir, mode: str) -> None:
    """Greedy requests and a parallel-sampling one (its forks share blocks: copy-on-write) through
    a pool too small for all of them: preempted by swapping the latent blocks out and in, or by
    recomputation, the outputs stay those of a roomy pool and of transformers."""
    prompts = _random_tokens([7, 16, 17, 11, 13], seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(n=3, temperature=1.0, seed=6, max_tokens=20, ignore_eos=True)
    params = [greedy, greedy, greedy, greedy, sampled]
    roomy = LLM(deepseek_dir, dtype="float32", block_size=BS, num_kv_blocks=128)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert roomy.llm_engine.get_stats()["num_preempted"] == 0
    tight = LLM(deepseek_dir, dtype="float32", block_size=BS, num_kv_blocks=24, swap_space="1MiB",
                preemption_mode=mode)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert [ids[0] for ids in got[:4]] == hf_greedy(deepseek_dir, prompts[:4], 20)
    stats = tight.llm_engine.get_stats()
    assert stats[f"num_preempted_by_{mode}"] > 0 and stats["num_cow_copies"] > 0
    if mode == "swap":
        assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0
    assert_no_leaks(tight)


# ------------------------------------------------------------------ refused at start-up


def test_other_routing_methods_are_refused() -> None:
    from pagedllm.models.deepseek_v3 import DeepseekV3ForCausalLM

    with pytest.raises(ValueError, match="topk_method='greedy' is not supported"):
        DeepseekV3ForCausalLM.check_config(deepseek_config(topk_method="greedy"))


def test_quantized_kv_cache_is_refused(deepseek_dir) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported for DeepseekV3ForCausalLM"):
        LLM(deepseek_dir, dtype="float32", block_size=BS, num_kv_blocks=16, kv_cache_dtype="int8")


def test_tensor_parallelism_is_refused(deepseek_dir) -> None:
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        LLM(deepseek_dir, dtype="float32", block_size=BS, num_kv_blocks=16, tensor_parallel_size=2)
