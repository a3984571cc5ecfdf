"""Every decoder family against transformers on a tiny random model, through the paged KV cache.

Sliding windows are 8 positions and blocks 4 slots, so prompts of 1 to 21 tokens and the decode
step after them run inside, across and well past the window. The reference runs transformers
with its KV cache (prompt, then one token), which is what its ``generate`` computes: for the rope
variants that depend on the sequence length (dynamic NTK, longrope) that is the definition.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer
from requirements_here import require
from test_models import PagedBatch, make_caches

from pagedllm import LLM, SamplingParams
from pagedllm.attention import PagedAttention
from pagedllm.models import build_model, load_model_config, supported_architectures

transformers = require("transformers")

WINDOW = 8
VOCAB = 384  # the size of conftest's trained tokenizer
PROMPT_LENS = (1, 7, 13, 21)


def family_config(name: str):
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=3)
    neox = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    configs = {
        "qwen3": lambda: t.Qwen3Config(head_dim=16, attention_bias=True, use_sliding_window=True,
                                       sliding_window=WINDOW, max_window_layers=1, **common),
        "qwen3-moe": lambda: t.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                                              **common),
        "mixtral": lambda: t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                           **common),
        "gemma": lambda: t.GemmaConfig(head_dim=16, **common),
        # Untied: Gemma scales the embedding by sqrt(hidden), and with these tiny random layers a tied head
        # maps each token back to itself: greedy repeats one token, a degenerate oracle (oracle.py).
        "gemma2": lambda: t.Gemma2Config(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                         tie_word_embeddings=False, **common),
        "gemma3": lambda: t.Gemma3TextConfig(
            head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
            **common),
        "phi3-longrope": lambda: t.Phi3Config(
            sliding_window=WINDOW, original_max_position_embeddings=16,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
                             "original_max_position_embeddings": 16},
            **common),
        "gpt-neox": lambda: t.GPTNeoXConfig(use_parallel_residual=True, attention_bias=True, **neox),
        "gpt-neox-sequential": lambda: t.GPTNeoXConfig(
            use_parallel_residual=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **neox),
        "starcoder2": lambda: t.Starcoder2Config(sliding_window=WINDOW, use_bias=True, **common),
        "mistral-window": lambda: t.MistralConfig(sliding_window=WINDOW, **common),
        "qwen2-window": lambda: t.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                                              **common),
        "llama-yarn": lambda: t.LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 64}, **common),
        "llama-dynamic": lambda: t.LlamaConfig(
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            **{**common, "max_position_embeddings": 16}),
    }
    return configs[name]()


FAMILIES = ["qwen3", "qwen3-moe", "mixtral", "gemma", "gemma2", "gemma3", "phi3-longrope", "gpt-neox",
            "gpt-neox-sequential", "starcoder2", "mistral-window", "qwen2-window", "llama-yarn", "llama-dynamic"]


def random_hf_model(config):
    """A transformers model of the config, seeded, its 1-D weights (biases, norms) made to count."""
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return hf_model


def save_family(name: str, path: str, with_tokenizer: bool = False):
    """A tiny random model of the family saved under path."""
    if with_tokenizer:
        train_tokenizer(path)
    hf_model = random_hf_model(family_config(name))
    hf_model.save_pretrained(path)
    return hf_model


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = str(tmp_path_factory.mktemp(name))
            save_family(name, cache[name], with_tokenizer=True)
        return cache[name]

    return get


def hf_prompt_and_step(hf_model, prompt: list[int], next_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        step = hf_model(torch.tensor([[next_token]]), past_key_values=out.past_key_values, use_cache=True)
    return out.logits[0].float(), step.logits[0, -1].float()


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers(name: str, tmp_path) -> None:
    hf_model = save_family(name, str(tmp_path))
    model_config = load_model_config(str(tmp_path), dtype="float32")
    model = build_model(model_config, "cpu")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    next_tokens = [5, 17, 101, 42]
    expected = [hf_prompt_and_step(hf_model, p, t) for p, t in zip(prompts, next_tokens)]
    # The C++ decode kernel, then the torch-native path (the reference for every backend).
    for use_kernel in (True, False):
        for module in model.modules():
            if isinstance(module, PagedAttention):
                module.use_cpu_kernel = use_kernel
        caches = make_caches(model_config)
        batch = PagedBatch(len(prompts))
        with torch.inference_mode():
            positions, meta = batch.step([len(p) for p in prompts])
            ids = torch.tensor([t for p in prompts for t in p])
            prefill = model.compute_logits(model(ids, positions, caches, meta)).split(list(PROMPT_LENS))
            positions, meta = batch.step([1] * len(prompts))
            decode = model.compute_logits(model(torch.tensor(next_tokens), positions, caches, meta))
        for i, (ref_prefill, ref_step) in enumerate(expected):
            torch.testing.assert_close(prefill[i], ref_prefill, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(decode[i], ref_step, atol=1e-4, rtol=1e-4)


def test_gemma2_softcapping_and_windows_are_real(tmp_path) -> None:
    """The settings reach the layers (a test of the family table, where the equality test would
    also pass if transformers ignored a setting the same way)."""
    save_family("gemma2", str(tmp_path))
    model = build_model(load_model_config(str(tmp_path), dtype="float32"), "cpu")
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [WINDOW, None]
    assert all(a.logits_soft_cap == 5.0 for a in attns) and model.final_logit_softcapping == 3.0
    assert attns[0].scale == 16**-0.5


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path) -> None:
    config = transformers.OlmoConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, architectures=["OlmoForCausalLM"])
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the architecture is refused first
    with pytest.raises(ValueError, match="OlmoForCausalLM is not supported. Supported architectures: .*Qwen3ForCaus"):
        load_model_config(str(tmp_path))
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
            "GPTNeoXForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel"} <= set(supported_architectures())


# ---------------------------------------------------------------- the engine, past the window


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_sliding_window_generation_past_the_window(family_dir, name: str) -> None:
    """Greedy generation far past the window equals transformers, and the blocks before the
    window go back to the pool as the sequences move on."""
    from oracle import hf_greedy

    folder = family_dir(name)
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=64)
    engine = llm.llm_engine
    assert engine.scheduler.block_manager.sliding_window == WINDOW
    assert engine.model_config.max_model_len == 256  # no longer capped at the window
    prompts = [[(7 * i + 3 * n) % 380 + 4 for i in range(n)] for n in (3, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(folder, prompts, 30)
    assert_no_leaks(llm)

    # One 30-token prompt and 30 new tokens: after the prefill it holds the window's blocks only.
    engine.add_request("long", prompts[2], params)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.get_stats()["gpu_blocks_used"])
    assert held[0] == 8 and max(held[2:]) <= WINDOW // 4 + 2
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", ["gemma2", "mixtral"])
def test_beam_search_equals_transformers(family_dir, name: str) -> None:
    folder = family_dir(name)
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=128)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[(5 * i + n) % 380 + 4 for i in range(n)] for n in (4, 11)]
    params = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    num_beams=3, num_return_sequences=2, do_sample=False, max_new_tokens=10,
                                    eos_token_id=None, pad_token_id=3)
        assert [c.token_ids for c in output.outputs] == [row[len(prompt):] for row in ref.tolist()]
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_tensor_parallel_greedy(family_dir, name: str) -> None:
    from oracle import hf_greedy
    from test_tensor_parallel import _children_alive, _engine_kwargs, _greedy, _prompts

    folder = family_dir(name)
    prompts = _prompts(VOCAB)[:6]
    tp2 = LLM(folder, tensor_parallel_size=2, **_engine_kwargs(num_kv_blocks=96))
    try:
        got = _greedy(tp2, prompts, 16)
        assert got == hf_greedy(folder, prompts, 16)
        assert_no_leaks(tp2)
    finally:
        tp2.llm_engine.shutdown()
    assert not _children_alive()
