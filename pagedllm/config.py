"""Typed settings of the engine, grouped as the paper's components are: cache, scheduler, model."""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pagedllm.json_setting import json_object_setting
from pagedllm.kv_cache_format import KV_CACHE_DTYPES, KVCacheFormat, parse_kv_cache_dtype
from pagedllm.model_reference import is_missing_local_path
from pagedllm.pooler_config import CONVERTS, RUNNERS, TASKS, PoolerConfig, check_runner_settings

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(value: int | float | str | None) -> int | None:
    """Accept 2147483648, "2GiB", "512MiB", "1.5GB"."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read a memory size from {value!r}; use bytes or e.g. '2GiB', '512MiB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(slots=True)
class CacheConfig:
    """The KV block pool.

    ``num_kv_blocks`` wins over ``kv_cache_memory`` (bytes); with neither, the pool takes a
    fraction of measured free memory after a warm-up pass (see worker/cache_engine.py).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    swap_space: int = 0  # bytes of CPU memory for swapped-out blocks (used by preemption by swap)
    num_cpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    # "auto" (the model dtype) or a quantized format (attention/kv_quant.py): "fp8" / "fp8_e4m3",
    # "fp8_e5m2", "int8", "int4".
    kv_cache_dtype: str = "auto"
    # The window every attention layer stays within: blocks wholly before it are released as a
    # sequence grows (None: some layer attends to everything).
    sliding_window: int | None = None
    # kv_cache_dtype parsed (kv_cache_format.py): what the pool, the attention backend and the metrics read.
    kv_cache_format: KVCacheFormat = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}.")
        self.kv_cache_format = parse_kv_cache_dtype(self.kv_cache_dtype)
        self.kv_cache_dtype = self.kv_cache_format.name


KV_ALLOCATIONS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")


# How tensor-parallel ranks start: child processes of the engine's (or torchrun's), or Ray actors.
EXECUTOR_BACKENDS = ("mp", "ray")
# Ray placement group strategies for a tensor-parallel group's ranks (executor/ray_ranks.py).
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
# The most tokens a proposer may guess per step. vLLM sets no upper bound; past a few dozen a draft
# is almost never accepted whole, and each guess costs a verified position per sequence per step.
MAX_SPECULATIVE_TOKENS = 64


def _check_field_types(instance: Any, setting_name: str) -> None:
    """ValueError naming the first field whose value is not of its annotated type (JSON has no
    typed schema: ``"3"`` for 3 must fail here, not as a TypeError deep in a comparison). An int is
    a float too; a bool is not an int."""
    hints = typing.get_type_hints(type(instance))
    for spec in fields(instance):
        value, hint = getattr(instance, spec.name), hints[spec.name]
        allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if value is None and type(None) in allowed:
            continue
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            setattr(instance, spec.name, float(value))
            continue
        if not any(isinstance(value, t) and not (t is int and isinstance(value, bool))
                   for t in allowed if isinstance(t, type) and t is not type(None)):
            names = " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t)) for t in allowed)
            raise ValueError(f"{setting_name} {spec.name} must be {names}, got {value!r} "
                             f"({type(value).__name__}).")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` names): a proposer guesses the next tokens
    of a decoding sequence, and one forward pass verifies them all (core/speculator.py).

    ``ngram``: prompt lookup, the tokens after the latest earlier occurrence of the sequence's last
    n tokens (n from prompt_lookup_max down to prompt_lookup_min). ``suffix``: a suffix tree over the
    request's tokens and recent requests' outputs, its proposal as long as the match supports
    (suffix_decoding_*; num_speculative_tokens caps it). ``draft_model``: a smaller model with the same
    tokenizer (``model``: a path or hub id) proposes num_speculative_tokens tokens greedily; its KV
    lives in the same paged pool, under the target's block tables (each block holds both models'
    layers), so copy-on-write, swapping and prefix caching move the draft's KV with the target's.
    """

    method: str = "ngram"
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Speculate only while fewer requests than this run (None: always): a full batch already
    # reads each weight once for many tokens, and verifying drafts would add work.
    disable_by_batch_size: int | None = None
    # A request stops speculating once, after min_request_drafts draft tokens, fewer than this
    # share of them were accepted.
    min_request_acceptance: float = 0.1
    min_request_drafts: int = 32
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        _check_field_types(self, "speculative_config")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}."
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: 'model' (the draft model) is required with method 'draft_model' "
                             f"and only with it (method {self.method!r}, model {self.model!r}).")
        if self.model is not None and is_missing_local_path(self.model):
            raise ValueError(f"speculative_config model: the draft model path {self.model!r} does not exist; pass a "
                             "Hugging Face folder (config.json + weights), a .gguf file, or a hub id ORG/NAME.")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError("speculative_config draft_tensor_parallel_size must be 1 (the draft runs whole on the "
                             f"first rank), got {self.draft_tensor_parallel_size}.")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}.")
        if not 0.0 <= self.min_request_acceptance <= 1.0:
            raise ValueError(f"min_request_acceptance must be in [0, 1], got {self.min_request_acceptance}.")
        for name in ("min_request_drafts", "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"speculative_config {name} must be >= 0, got {getattr(self, name)}.")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("speculative_config suffix_decoding_max_tree_depth must be >= 1, "
                             f"got {self.suffix_decoding_max_tree_depth}.")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("speculative_config suffix_decoding_min_token_prob must be in [0, 1], "
                             f"got {self.suffix_decoding_min_token_prob}.")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (``--speculative-config '{"method": "ngram", ...}'``)."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object_setting(value, "speculative_config")
        # One bound given: the other default moves so that min <= max still holds.
        defaults = {name: field.default for name, field in cls.__dataclass_fields__.items()}
        # (Only for integers: a bound of another type is refused by name in __post_init__.)
        if isinstance(value.get("prompt_lookup_max"), int) and "prompt_lookup_min" not in value:
            value = {**value, "prompt_lookup_min": min(value["prompt_lookup_max"], defaults["prompt_lookup_min"])}
        if isinstance(value.get("prompt_lookup_min"), int) and "prompt_lookup_max" not in value:
            value = {**value, "prompt_lookup_max": max(value["prompt_lookup_min"], defaults["prompt_lookup_max"])}
        if "model" in value and "method" not in value:
            value = {**value, "method": "draft_model"}  # vLLM's reading: a model alone names a draft model
        return cls(**json_object_setting(value, "speculative_config", set(cls.__dataclass_fields__)))


# Scheduling defaults shared by EngineArgs (what a user sets) and SchedulerConfig (what the scheduler
# reads), so a scheduler built directly (tests, the simulator) schedules as the engine's does.
# Chunked: a step's budget bounds how long running streams wait for a prompt (on a CPU a few hundred
# tokens take a fraction of a second); typical prompts fit it whole, longer ones advance
# DEFAULT_LONG_PROMPT_CHUNK_TOKENS a step. Unchunked: whole prompts must fit the budget.
DEFAULT_CHUNKED_BATCHED_TOKENS = 512
DEFAULT_LONG_PROMPT_CHUNK_TOKENS = 256


def default_max_num_batched_tokens(enable_chunked_prefill: bool, max_model_len: int) -> int:
    """A step's token budget when none is set."""
    return DEFAULT_CHUNKED_BATCHED_TOKENS if enable_chunked_prefill else max(max_model_len, 8192)


@dataclass(slots=True)
class SchedulerConfig:
    """Budgets of one step and the preemption policy."""

    max_num_seqs: int = 256
    # None: default_max_num_batched_tokens (512 with chunked prefill, else max(max_model_len, 8192)).
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    # Admission keeps this fraction of the pool free so running sequences can grow.
    watermark: float = 0.01
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    # The paper's baselines as policies of this scheduler (see core/policies.py): "paged" (ours)
    # or a contiguous reservation per sequence; and iteration-level vs request-level batching.
    kv_allocation: Literal["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"] = "paged"
    batching: Literal["iteration", "request"] = "iteration"
    # Account every KV slot each step as token / reserved / fragmented / free (core/waste.py).
    track_kv_waste: bool = False
    # One token budget per step shared by decodes and prompt chunks (a prompt may span steps).
    # Off: a step is all prefill (whole prompts) or all decode, as in the paper and vLLM v0.2.
    enable_chunked_prefill: bool = True
    # With chunking: the most prompt tokens one request computes in a step (0: the budget's
    # rest). Several prompts then share a large budget, while a long one still advances a bounded
    # chunk per step and so holds up the running streams for a bounded time.
    long_prefill_token_threshold: int = 0
    # With chunking: a prompt too long for one step's budget (its group's tokens exceed
    # max_num_batched_tokens) computes at most this many tokens per step (0: the budget's rest).
    # Prompts that fit the budget still run whole, so the budget can be sized for typical prompts
    # (one step to their first token) while a long prompt advances in chunks that bound how long
    # it holds up the running streams.
    long_prompt_chunk_tokens: int = DEFAULT_LONG_PROMPT_CHUNK_TOKENS
    # With chunking: in a step that decodes, prompt chunks take at most this many tokens in all
    # (0: the budget's rest). A prompt that arrives while streams decode then holds each of them
    # up by a bounded chunk per step, while one that arrives at an idle engine gets the whole budget.
    max_prefill_tokens_while_decoding: int = 0
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation must be one of {', '.join(KV_ALLOCATIONS)}, got {self.kv_allocation!r}.")
        if self.batching not in ("iteration", "request"):
            raise ValueError(f"batching must be 'iteration' or 'request', got {self.batching!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_max_num_batched_tokens(
                self.enable_chunked_prefill, self.max_model_len
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: no limit), got {self.long_prefill_token_threshold}."
            )
        if self.long_prompt_chunk_tokens < 0:
            raise ValueError(
                f"long_prompt_chunk_tokens must be >= 0 (0: no limit), got {self.long_prompt_chunk_tokens}."
            )
        if self.max_prefill_tokens_while_decoding < 0:
            raise ValueError(
                "max_prefill_tokens_while_decoding must be >= 0 (0: no limit), "
                f"got {self.max_prefill_tokens_while_decoding}."
            )
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(
                f"preemption_mode must be 'recompute', 'swap' or 'auto', got {self.preemption_mode!r}."
            )


@dataclass(slots=True)
class ModelConfig:
    """What the loader found: the HF-style config (a transformers PretrainedConfig) and where from."""

    model: str  # path of the HF folder or GGUF file
    hf_config: Any
    dtype: Any  # torch.dtype, kept untyped so core/ never imports torch through this module
    max_model_len: int
    architecture: str
    tokenizer_path: str | None = None
    gguf_file: str | None = None
    # Load-time weight-only quantization of float checkpoints: None, "int8" or "int4" (groups of
    # quantization_group_size). GGUF files keep their own types packed unless gguf_dequantize.
    quantization: str | None = None
    quantization_group_size: int = 128
    gguf_dequantize: bool = False
    # Packed weights with int8 activations (integer dot products): None = wherever the CPU kernels
    # can, True = required, False = float activations (exact dequantized-model results).
    int8_activations: bool | None = None
    # The sliding window shared by every layer (the widest, where they differ); None when any
    # layer attends to the whole sequence.
    sliding_window: int | None = None

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "awq", "gptq", "gguf", "dequantize")
PREEMPTION_MODES = ("recompute", "swap", "auto")
BATCHING_MODES = ("iteration", "request")
# The command line's groups of EngineArgs fields, in --help order; a field declared without
# setting() lands in the last one.
ENGINE_ARG_GROUPS = (
    "model and loading",
    "quantization",
    "memory and KV cache",
    "scheduling",
    "parallelism and device",
    "speculative decoding",
    "other engine settings",
)
# `pagedllm serve`'s groups of ServerSettings and DataParallelConfig fields, in --help order; the
# first one's flags sit in the parser's own options list, next to MODEL.
SERVER_ARG_GROUPS = (
    "server",
    "limits (see docs/guides/server.md, Hardening)",
    "chat",
    "data-parallel replicas on Ray (see docs/guides/parallelism.md)",
)


def setting(
    default: Any,
    group: str,
    help: str,
    *,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    aliases: Sequence[str] = (),
    negative_aliases: Sequence[str] = (),
    byte_size: bool = False,
    metavar: str | None = None,
    positive: bool = False,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A settings field (EngineArgs', or the server's ServerSettings' and DataParallelConfig's) with what its
    command-line flag needs (entrypoints/engine_flags.py builds it).

    ``group``: one of ENGINE_ARG_GROUPS or SERVER_ARG_GROUPS; ``choices``: the values, or a function
    giving them when the flag is built (a registry this module must not import); ``aliases``: more
    option strings (``-q``); ``negative_aliases``: flags that set a bool False (``--no-prefix-caching``);
    ``byte_size``: the value may be a size text such as "2GiB"; ``positive``: the flag refuses an int
    below 1, a float not above 0 or infinite; ``parse``: how the flag's text becomes the value (str.lower).
    """
    if group not in ENGINE_ARG_GROUPS + SERVER_ARG_GROUPS:
        raise ValueError(f"group must be one of {', '.join(ENGINE_ARG_GROUPS + SERVER_ARG_GROUPS)}, got {group!r}.")
    metadata = {
        "help": help,
        "group": group,
        "choices": tuple(choices) if choices is not None and not callable(choices) else choices,
        "aliases": tuple(aliases),
        "negative_aliases": tuple(negative_aliases),
        "byte_size": byte_size,
        "metavar": metavar,
        "positive": positive,
        "parse": parse,
    }
    return field(default=default, metadata=metadata)


def check_setting_names(names: Iterable[str], owner: str) -> None:
    """A TypeError naming each of ``names`` that is no EngineArgs field, with the closest valid names."""
    valid = [spec.name for spec in fields(EngineArgs)]
    unknown = [name for name in names if name not in valid]
    if not unknown:
        return
    problems = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=3)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        problems.append(f"{name!r}{hint}")
    raise TypeError(
        f"{owner} got unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(problems)}; "
        "every setting is a field of EngineArgs (pagedllm/config.py)."
    )


@dataclass(slots=True)
class EngineArgs:
    """Everything a user can set, flat, as LLM(...) and the command line take them.

    The one place a setting is written: a field declared with setting() carries its help, group,
    choices and flag aliases, from which entrypoints/engine_flags.py makes the flags of `generate`,
    `chat` and `serve`; LLM(**kwargs) takes every field. A plain field gets a flag too, with a
    generic help. Byte sizes (kv_cache_memory, swap_space) may be texts such as "2GiB".
    """

    model: str | None = setting(
        None, "model and loading",
        "Hugging Face folder, GGUF file or hub id ORG/NAME[:QUANT] (default: the embedded SmolLM2-135M-Instruct).",
    )
    tokenizer: str | None = setting(
        None, "model and loading", "Tokenizer folder or hub id, when not the model's own."
    )
    revision: str | None = setting(None, "model and loading", "Hub id: branch, tag or commit (default: main).")
    download_dir: str | None = setting(
        None, "model and loading", "Hub id: the hub cache folder to download to and load from (default: HF_HOME's)."
    )
    gguf_file: str | None = setting(
        None, "model and loading", "GGUF repo (or folder): the .gguf file to load, when it holds several (or ID:QUANT)."
    )
    dtype: str = setting(
        "auto", "model and loading",
        "Weights and activations: auto (bfloat16 where the device multiplies it natively, else float32), float32, "
        "bfloat16 or float16.",
        choices=DTYPES,
    )
    quantization: str | None = setting(
        None, "quantization",
        "Weight-only quantization of a float checkpoint at load time (int4: groups of 128 unless -gNN). AWQ / GPTQ "
        "checkpoints and GGUF files keep their own packed types without it ('awq' / 'gptq' only confirm it); "
        "'dequantize' loads a GGUF as float32 instead.",
        choices=QUANTIZATIONS, aliases=("-q",),
    )
    int8_activations: bool | None = setting(
        None, "quantization",
        "Quantized weights: multiply with activations quantized to int8 (integer dot products; default: wherever "
        "the CPU has them). --no-int8-activations keeps float activations (exactly the dequantized model's results).",
    )
    block_size: int = setting(16, "memory and KV cache", "Token slots per KV block (a power of two).")
    kv_cache_memory: int | str | None = setting(
        None, "memory and KV cache",
        "Bytes for the KV pool, e.g. 2GiB or 512MiB (default: a share of the free memory measured after a warm-up).",
        byte_size=True,
    )
    num_kv_blocks: int | None = setting(
        None, "memory and KV cache", "KV pool size in blocks (wins over kv_cache_memory)."
    )
    kv_cache_dtype: str = setting(
        "auto", "memory and KV cache",
        "KV cache storage: auto (the model dtype), bfloat16 or float16 (16-bit values whatever the model computes "
        "in: half a float32 model's KV bytes), or quantized: fp8 (= fp8_e4m3), fp8_e5m2, int8 or int4, each with "
        "scales per token and KV head (int4: per 32 values); 8 bits hold ~1.94x the tokens of bfloat16 in the same "
        "memory, int4 ~3.2x.",
        choices=KV_CACHE_DTYPES,
    )
    swap_space: int | str = setting(
        0, "memory and KV cache", "CPU memory for swapped-out blocks, e.g. 4GiB (preemption by swap).", byte_size=True
    )
    max_num_seqs: int = setting(256, "scheduling", "Most sequences in one step.")
    # None: chosen by LLMEngine.from_engine_args once the model's length is known.
    max_num_batched_tokens: int | None = setting(
        None, "scheduling",
        f"Token budget of one step (default: {DEFAULT_CHUNKED_BATCHED_TOKENS} with chunked prefill, else "
        "max(max_model_len, 8192)).",
    )
    max_model_len: int | None = setting(None, "model and loading", "Context length (default: the model's).")
    seed: int = setting(0, "model and loading", "Seed of the engine's random generator (a request's own seed wins).")
    device: str = setting("auto", "parallelism and device", "auto (CUDA when torch sees a GPU), cpu or cuda[:N].")
    enable_prefix_caching: bool = setting(
        True, "memory and KV cache", "Share the KV blocks of common prompt prefixes.",
        negative_aliases=("--no-prefix-caching",),
    )
    preemption_mode: str = setting(
        "recompute", "scheduling", "How preempted sequences come back (auto: swap when the CPU pool has room).",
        choices=PREEMPTION_MODES,
    )
    num_threads: int | None = setting(
        None, "parallelism and device", "CPU threads for torch (default: every core the OS reports)."
    )
    kv_allocation: str = setting(
        "paged", "memory and KV cache",
        "Paged blocks (ours) or one of the paper's contiguous reservation baselines (core/policies.py).",
        choices=KV_ALLOCATIONS,
    )
    batching: str = setting(
        "iteration", "scheduling", "Iteration-level (continuous) or request-level (static) batching.",
        choices=BATCHING_MODES,
    )
    track_kv_waste: bool = setting(
        False, "memory and KV cache", "Account every KV slot each step as token / reserved / fragmented / free."
    )
    enable_chunked_prefill: bool = setting(
        True, "scheduling",
        "Share each step's token budget between decodes and prompt chunks (off: a step is all prefill or all "
        "decode, as in the paper).",
    )
    long_prefill_token_threshold: int = setting(
        0, "scheduling",
        "With chunked prefill: the most prompt tokens one request computes in a step (0: no limit but the budget).",
    )
    long_prompt_chunk_tokens: int = setting(
        DEFAULT_LONG_PROMPT_CHUNK_TOKENS, "scheduling",
        "With chunked prefill: the most tokens per step of a prompt longer than the step budget (prompts within "
        "the budget run whole; 0: no limit but the budget).",
    )
    max_prefill_tokens_while_decoding: int = setting(
        0, "scheduling",
        "With chunked prefill: the most prompt tokens in all of a step that also decodes, which bounds how long a "
        "prompt holds up running streams (0: no limit but the budget).",
    )
    tensor_parallel_size: int = setting(
        1, "parallelism and device",
        "Split the model over this many ranks, Megatron-style (worker processes, or torchrun's).",
        aliases=("-tp",),
    )
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = setting(
        None, "speculative decoding",
        "Speculative decoding in vLLM's JSON form, e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}', method \"suffix\", or "
        "'{\"method\": \"draft_model\", \"model\": PATH_OR_ID}' (a smaller model with the same tokenizer); "
        "num_speculative_tokens 1..64; greedy output stays the same, sampling the same distribution (default: off).",
        metavar="JSON",
    )
    distributed_executor_backend: str | None = setting(
        None, "parallelism and device",
        "Where tensor-parallel ranks 1..N-1 run: mp (child processes of this one, or torchrun's) or ray (Ray "
        "actors placed by a placement group, on this node or others; needs pagedllm[ray]) (default: mp; ray for "
        "data-parallel replicas).",
        choices=EXECUTOR_BACKENDS,
    )
    placement_group_strategy: str = setting(
        "STRICT_PACK", "parallelism and device",
        "With the ray backend: how Ray places a tensor-parallel group's ranks: STRICT_PACK (one node), PACK, "
        "SPREAD, or STRICT_SPREAD (one rank per node).",
        choices=PLACEMENT_STRATEGIES,
    )
    # Embeddings (pooler_config.py, vLLM's names).
    runner: str = setting(
        "auto", "model and loading",
        "generate, pooling (embeddings: LLM.embed, /v1/embeddings), or auto (pooling for a local "
        "sentence-transformers folder, else generate).",
        choices=RUNNERS,
    )
    convert: str = setting(
        "auto", "model and loading",
        "auto, none or embed: embed pools a generation model's final hidden states (implies --runner pooling).",
        choices=CONVERTS,
    )
    task: str | None = setting(
        None, "model and loading",
        "vLLM's older name for the runner: embed = --runner pooling, generate = --runner generate.",
        choices=TASKS,
    )
    pooler_config: PoolerConfig | dict[str, Any] | str | None = setting(
        None, "model and loading",
        "Embeddings: '{\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", \"normalize\": true}' (default: the "
        "checkpoint's sentence-transformers setting, else LAST, normalized).",
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        self.runner, self.convert = check_runner_settings(self.runner, self.convert, self.task)
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.swap_space = parse_bytes(self.swap_space) or 0
        parse_kv_cache_dtype(self.kv_cache_dtype)  # an early error; CacheConfig keeps the parsed format
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}.")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)} or None, "
                             f"got {backend!r}.")
        if self.placement_group_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_group_strategy must be one of {list(PLACEMENT_STRATEGIES)}, "
                             f"got {self.placement_group_strategy!r}.")
