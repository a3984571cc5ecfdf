"""Our model implementations against Hugging Face transformers, through the paged KV cache."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from requirements_here import require

from pagedllm.attention import AttentionMetadata
from pagedllm.models import build_model, load_model_config, load_tokenizer
from pagedllm.models.gguf_loader import gguf_name_to_hf, iter_gguf_weights, read_gguf
from pagedllm.quantization.apply import packed_weight_bytes
from pagedllm.quantization.packed import PackedTensor, QuantizedWeight

transformers = require("transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def make_caches(model_config, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE):
    """Each layer's pools as the model declares them: K and V, or DeepSeek's one latent row."""
    from pagedllm.models.registry import kv_cache_spec

    spec = kv_cache_spec(model_config)
    shape = (num_blocks, block_size, spec.num_heads, spec.head_dim)
    return [tuple(torch.zeros(shape) for _ in range(spec.num_pools)) for _ in range(model_config.num_layers)]


class PagedBatch:
    """Hands out physical blocks in a scrambled order and builds step metadata, as the worker would."""

    def __init__(self, num_seqs: int, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE) -> None:
        gen = torch.Generator().manual_seed(0)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_size = block_size
        self.tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.lens = [0] * num_seqs

    def _slot(self, seq: int, pos: int) -> int:
        while len(self.tables[seq]) <= pos // self.block_size:
            self.tables[seq].append(self.free.pop())
        return self.tables[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, new_tokens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        positions, slots, starts = [], [], [0]
        cached = list(self.lens)
        for seq, n in enumerate(new_tokens):
            for pos in range(self.lens[seq], self.lens[seq] + n):
                positions.append(pos)
                slots.append(self._slot(seq, pos))
            self.lens[seq] += n
            starts.append(starts[-1] + n)
        width = max(len(t) for t in self.tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int64)
        meta = AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_lens=list(new_tokens),
            query_start_loc=starts,
            context_lens=torch.tensor(self.lens, dtype=torch.int64),
            block_tables=tables,
            num_cached_tokens=cached,
            max_context_len=max(self.lens),
        )
        return torch.tensor(positions, dtype=torch.int64), meta


def run_prefill_and_decode(model, model_config, prompts: list[list[int]], next_tokens: list[int]):
    """Logits of each prompt (prefill, batched) and of one decode step per sequence."""
    caches = make_caches(model_config)
    batch = PagedBatch(len(prompts))
    with torch.inference_mode():
        positions, meta = batch.step([len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
        prefill_logits = model.compute_logits(model(ids, positions, caches, meta))
        positions, meta = batch.step([1] * len(prompts))
        decode_logits = model.compute_logits(model(torch.tensor(next_tokens), positions, caches, meta))
    return prefill_logits.split([len(p) for p in prompts]), decode_logits


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _tiny_configs():
    common = dict(vocab_size=211, initializer_range=0.2)
    llama = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                 max_position_embeddings=256, **common)
    return {
        "llama-gqa": transformers.LlamaConfig(num_key_value_heads=2, rope_theta=500.0, **llama),
        "llama-tied-llama3rope": transformers.LlamaConfig(
            num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            **llama),
        "llama-linear-rope": transformers.LlamaConfig(
            num_key_value_heads=8, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            **llama),
        "mistral": transformers.MistralConfig(num_key_value_heads=2, sliding_window=128, **llama),
        "qwen2": transformers.Qwen2Config(num_key_value_heads=2, **llama),
        "gpt2": transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                                        eos_token_id=0, **common),
        "opt-proj": transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                           max_position_embeddings=128, word_embed_proj_dim=32, init_std=0.2,
                                           vocab_size=211, bos_token_id=0, eos_token_id=0, pad_token_id=1),
        "opt-post-ln": transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                              max_position_embeddings=128, do_layer_norm_before=False, init_std=0.2,
                                              vocab_size=211, bos_token_id=0, eos_token_id=0, pad_token_id=1),
    }


TINY = _tiny_configs()


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_model_matches_hf(name: str, tmp_path) -> None:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(TINY[name], dtype=torch.float32).eval()
    if name.startswith("opt"):  # OPT's init leaves biases at 0 and LN at identity; make them count
        with torch.no_grad():
            for param_name, p in hf_model.named_parameters():
                if param_name.endswith("bias") or "layer_norm" in param_name:
                    p.add_(torch.randn_like(p) * 0.1)
    hf_model.save_pretrained(tmp_path)
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path))

    model_config = load_model_config(str(tmp_path), dtype="float32")
    model = build_model(model_config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 211, (n,), generator=gen).tolist() for n in (7, 13, 1, 5)]
    next_tokens = [3, 17, 101, 42]
    prefill, decode = run_prefill_and_decode(model, model_config, prompts, next_tokens)
    for i, prompt in enumerate(prompts):
        assert prefill[i].dtype == torch.float32
        torch.testing.assert_close(prefill[i], hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[i], hf_logits(hf_model, prompt + [next_tokens[i]])[-1], atol=1e-4, rtol=1e-4)

    # Profiling run: no cache, no metadata, one causal sequence.
    with torch.inference_mode():
        hidden = model(torch.tensor(prompts[1]), torch.arange(len(prompts[1])), None, None)
    torch.testing.assert_close(model.compute_logits(hidden), hf_logits(hf_model, prompts[1]), atol=1e-4, rtol=1e-4)


def test_bfloat16_build_runs(tmp_path) -> None:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(TINY["llama-gqa"], dtype=torch.float32).eval()
    hf_model.save_pretrained(tmp_path)
    model_config = load_model_config(str(tmp_path), dtype="bfloat16")
    model = build_model(model_config, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = [5, 6, 7, 8, 9]
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(5), None, None))
    assert logits.dtype == torch.bfloat16  # the model's dtype: the sampler widens what it needs
    ref = hf_logits(hf_model, ids)
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


# ---------------------------------------------------------------- the default model (GGUF)


@pytest.fixture(scope="module")
def default_model():
    model_config = load_model_config(None)
    model_config.int8_activations = False  # float activations: the dequantized model's exact results
    model = build_model(model_config, "cpu")
    tokenizer = load_tokenizer(model_config)
    return model_config, model, tokenizer


@pytest.fixture(scope="module")
def hf_default_model(default_model):
    import gguf

    model_config = default_model[0]
    folder, name = os.path.split(model_config.gguf_file)
    with pytest.MonkeyPatch.context() as mp:
        # transformers rebuilds the same tensor-name map once per tensor (~10 s); the map is pure.
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    return hf_model.eval()


def test_default_model_config(default_model) -> None:
    model_config, model, tokenizer = default_model
    cfg = model_config.hf_config
    assert model_config.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert model_config.head_dim == 64 and cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert model_config.max_model_len == 8192 and model_config.dtype == torch.float32
    # Norms stay float parameters; every linear and the embedding keep the file's packed blocks.
    packed_bytes, formats = packed_weight_bytes(model)
    holders = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)]
    packed_params = sum(w.shape.numel() for w in holders)
    assert sum(p.numel() for p in model.parameters()) + packed_params == 134_515_008
    assert formats == {"Q4_1": 120, "Q8_0": 1}
    tensor_bytes = sum(t.nbytes for t in read_gguf(model_config.gguf_file).tensors.values() if len(t.shape) == 2)
    assert packed_bytes == tensor_bytes


def test_default_tokenizer_round_trip(default_model) -> None:
    tokenizer = default_model[2]
    text = "Hello, world! Ünïcödé 日本語 🙂 and\ttabs."
    ids = tokenizer.encode(text)
    assert ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "Hi"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_default_model_matches_transformers_gguf(default_model, hf_default_model) -> None:
    model_config, model, tokenizer = default_model
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):\n    ", "Hi")]
    next_tokens = [tokenizer.encode(" Paris")[0], 1, 2]
    prefill, decode = run_prefill_and_decode(model, model_config, prompts, next_tokens)
    for i, prompt in enumerate(prompts):
        ref = hf_logits(hf_default_model, prompt + [next_tokens[i]])
        torch.testing.assert_close(prefill[i], ref[:-1], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(decode[i], ref[-1], atol=1e-3, rtol=1e-3)
    assert tokenizer.decode(prefill[0][-1].argmax()) == " Paris"


def test_gguf_names_and_dequantized_weights(default_model) -> None:
    gguf_file = read_gguf(default_model[0].gguf_file)
    assert gguf_name_to_hf("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_name_to_hf("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.gate_proj.weight"  # stacked
    with pytest.raises(ValueError, match="no counterpart"):
        gguf_name_to_hf("blk.0.ffn_no_such_part.weight")
    names = {gguf_name_to_hf(n) for n in gguf_file.tensors}
    assert "model.layers.29.mlp.down_proj.weight" in names and "lm_head.weight" not in names  # tied
    name, tensor = next(iter_gguf_weights(gguf_file, packed=False))
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.float32 and tensor.shape == (49152, 576)
    name, packed = next(iter_gguf_weights(gguf_file))
    assert isinstance(packed, PackedTensor) and packed.fmt.name == "Q8_0" and packed.shape == (49152, 576)
    torch.testing.assert_close(packed.dequantize(), tensor, rtol=0, atol=0)


def test_default_model_greedy_generation_equals_transformers(hf_default_model) -> None:
    """The engine end to end (paged cache, continuous batching) against HF generate on the same GGUF."""
    from conftest import assert_no_leaks

    from pagedllm import LLM, SamplingParams

    llm = LLM(kv_cache_memory="256MiB", block_size=16, int8_activations=False)
    tokenizer = llm.get_tokenizer()
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Hi",
        "Once upon a time, in a land far away, there lived a",
        "List three colours:",
        "Translate to French: I like cheese.",
        "The PagedAttention algorithm stores keys and values in",
        "1, 2, 3, 4,",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hf_default_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        for ids, got in zip(prompts, ours):
            out = hf_default_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32, do_sample=False, pad_token_id=2,
            )
            assert got == out[0, len(ids):].tolist()
    assert_no_leaks(llm)
