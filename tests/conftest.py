"""Shared fixtures: tiny random models built on the spot, a tokenizer trained on the spot."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The oracle is transformers in float32: keep dtype="auto" at float32 on CPUs with native bfloat16 too
# (servers the tests start in subprocesses inherit it).
os.environ.setdefault("PAGEDLLM_CPU_BF16", "0")

from kernel_levels import NOT_ON_THIS_CPU, check_kernels_mark, enter_level, levels_here  # noqa: E402
from requirements_here import KERNELS_OFF, LEFT_OUT, allowed_missing, require  # noqa: E402

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "PagedAttention stores the KV cache in fixed-size blocks, like pages of virtual memory.",
    "A block table maps logical blocks to physical blocks anywhere in the pool.",
    "Copy-on-write lets beams and samples share blocks until they diverge.",
    "Hello, world! Bonjour le monde. Hallo Welt. こんにちは世界 🙂",
    "def main():\n    return 42\n",
] * 20


def train_tokenizer(path: str, vocab_size: int = 384):
    """A small byte-level BPE with BOS/EOS/PAD, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(path)
    return fast


def build_tiny_model(kind: str, path: str) -> str:
    """Save a tiny random model of one architecture (+ tokenizer) under path; return path."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GPT2Config,
        LlamaConfig,
        OPTConfig,
        Qwen2Config,
    )

    tokenizer = train_tokenizer(path)
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if kind == "llama":
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rope_theta=10000.0,
            tie_word_embeddings=False, **common,
        )
    elif kind == "llama-hd64":  # heads of 64: the kernels' vector rows, and room for int4 KV's groups of 32
        config = LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2, rope_theta=10000.0,
            tie_word_embeddings=False, **common,
        )
    elif kind == "qwen2":
        config = Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rope_theta=1000000.0,
            tie_word_embeddings=True, **common,
        )
    elif kind == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.2, **common)
    elif kind == "opt":
        config = OPTConfig(
            hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
            word_embed_proj_dim=64, init_std=0.2, **common,
        )
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if kind == "qwen2":
        # Random biases, so the qkv-bias path is really exercised.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = build_tiny_model(kind, str(tmp_path_factory.mktemp(f"tiny-{kind}")))
        return cache[kind]

    return get


def assert_no_leaks(llm) -> None:
    """Every block back in the free pool, every reference count zero."""
    engine = llm.llm_engine if hasattr(llm, "llm_engine") else llm
    assert not engine.has_unfinished_requests()
    block_manager = engine.scheduler.block_manager
    block_manager.check_invariants()
    assert block_manager.all_free()


@pytest.fixture(params=levels_here())
def kernel_level(request):
    """Runs the test once per instruction-set level this CPU executes (kernel_levels.py), building
    the level on first use: a failed build fails the test; kernels off skips it."""
    with enter_level(request.param) as level:
        yield level


def pytest_configure(config: pytest.Config) -> None:
    allowed_missing()  # a misspelt PAGEDLLM_TEST_WITHOUT name is an error before anything runs
    config.addinivalue_line(
        "markers", "kernels(level=None): needs the CPU kernels (at least at `level`); a failed build fails it"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    mark = item.get_closest_marker("kernels")
    if mark is not None:
        check_kernels_mark(mark.kwargs.get("level"))


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """What this run left out, so that a green run without the kernels or a tool says so: the
    kernels off, the tools PAGEDLLM_TEST_WITHOUT named, and skips for hardware not here."""
    from pagedllm.kernels import kernel_config
    from pagedllm.kernels.dispatch import build_error, loaded_levels

    counts: dict[str, dict[str, int]] = {"off": {}, "left out": {}, "hardware": {}, "other": {}}
    for report in terminalreporter.stats.get("skipped", []):
        reason = _skip_reason(report)
        group = ("off" if reason.startswith(KERNELS_OFF) else "left out" if reason.startswith(LEFT_OUT)
                 else "hardware" if reason.startswith(NOT_ON_THIS_CPU) else "other")
        counts[group][reason] = counts[group].get(reason, 0) + 1
    write = terminalreporter.write_line
    terminalreporter.section("what this run left out")
    if not kernel_config().cpu_kernels:
        write(f"CPU KERNELS WERE OFF (PAGEDLLM_CPU_KERNEL=0): {sum(counts['off'].values())} tests that need them "
              "skipped; the torch paths ran everywhere else")
    else:
        failed = [f"{level} ({build_error(level)})" for level in levels_here() if build_error(level)]
        write(f"CPU kernels: on; levels loaded: {', '.join(loaded_levels()) or 'none'}"
              + (f"; FAILED to build: {'; '.join(failed)}" if failed else ""))
    without = sorted(allowed_missing())
    if without:
        write(f"PAGEDLLM_TEST_WITHOUT={','.join(without)}: {sum(counts['left out'].values())} skips")
        for reason, n in sorted(counts["left out"].items()):
            write(f"  {n:4d}  {reason}")
    if counts["hardware"]:
        write(f"Not on this CPU: {sum(counts['hardware'].values())} skips")
        for reason, n in sorted(counts["hardware"].items()):
            write(f"  {n:4d}  {reason}")
    if counts["other"]:
        write(f"Other skips: {sum(counts['other'].values())}")
        for reason, n in sorted(counts["other"].items()):
            write(f"  {n:4d}  {reason}")


@pytest.fixture
def without_batch_invariance():
    """The kernels chosen by the step's row counts (SDPA, AMX prompt tiles, the chunked kernel for a
    mixed step's decodes): the paths batch invariance turns off, tested here as they still run."""
    from pagedllm.kernels import use_kernel_config

    with use_kernel_config(batch_invariant=False):
        yield


# For server test modules whose ``server`` fixture yields test_server.serving(...)'s namespace.
@pytest.fixture(scope="module")
def client(server):
    return server.client


@pytest.fixture(scope="module")
def http(server):
    return server.http


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of two simulated nodes of one CPU each (Ray's own test tool), per module."""
    ray = require("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
