"""Step time of a model on a device, from what the scheduler put in the step.

Features of a step (``StepFeatures``): prefill tokens, decode sequences, KV tokens the decode
attention reads (sum of context lengths), prefill attention pairs (query x key positions, the
quadratic part), and the blocks moved (swap over the host link, copies within the pool).

Two forms share one dataclass:
- ``from_hardware``: a roofline. A step streams the weights once and the decode KV it reads
  (memory time, at the KV bytes per token of the shape's ``kv_cache_dtype``) while computing
  2 FLOPs per parameter per token plus attention (compute time); it takes the larger of the two,
  plus a fixed per-step overhead. Achievable fractions of the peaks (``mfu``, ``mbu``) are
  typical of fp16 serving kernels of the paper's time.
- ``fit``: coefficients fitted by non-negative least squares to measured step times (the
  calibration against real pagedllm runs); such a model is linear (``roofline=False``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from pagedllm.simulator.hardware import HardwareSpec
from pagedllm.simulator.model_shapes import ModelShape

FIT_FEATURES = ("prefill_tokens", "decode_seqs", "kv_tokens_read", "prefill_attn_pairs")


@dataclass(slots=True)
class StepFeatures:
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens_read: int = 0
    prefill_attn_pairs: int = 0
    swap_blocks: int = 0
    swap_tokens: int = 0
    copy_tokens: int = 0

    def vector(self) -> list[float]:
        return [1.0] + [float(getattr(self, name)) for name in FIT_FEATURES]


@dataclass(slots=True)
class CostModel:
    """Seconds per step = fixed + per-feature coefficients (roofline: max of memory and compute)."""

    fixed_s: float  # memory-side fixed cost: the weights streamed once per step (+ overhead if linear)
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_read_s: float
    per_prefill_attn_pair_s: float
    overhead_s: float = 0.0  # per step, outside the roofline (scheduling, launches)
    per_swap_token_s: float = 0.0
    per_swap_block_s: float = 0.0  # one transfer per block: why small blocks swap slowly
    per_copy_token_s: float = 0.0
    roofline: bool = False
    source: str = "fit"

    @classmethod
    def from_hardware(
        cls, shape: ModelShape, hw: HardwareSpec, mfu: float = 0.5, mbu: float = 0.8, overhead_s: float = 1.5e-3,
        kv_cache_dtype: str | None = None,
    ) -> CostModel:
        """The roofline of ``shape`` on ``hw``; ``kv_cache_dtype`` (default: the shape's) sets the KV bytes
        per token that decode attention reads and that swaps and block copies move.

        Dequantizing a quantized KV cache is not costed: it is a multiply-add per value, fused into the
        attention kernel's loads, and decode attention does ~1 FLOP per byte it reads, far below the
        ridge point (~200 FLOP/byte on an A100), so the step stays memory bound on the smaller reads.
        Weights stay in the model dtype, so the fixed weight stream does not change.
        """
        if kv_cache_dtype is not None:
            shape = shape.with_kv_cache_dtype(kv_cache_dtype)
        devices = hw.num_devices
        flops = hw.peak_flops * mfu * devices
        bandwidth = hw.mem_bandwidth * mbu * devices
        per_token_flops = 2 * shape.num_params
        attn_pair_flops = 4 * shape.num_layers * shape.num_heads * shape.head_dim
        allreduce = 2 * shape.num_layers * hw.allreduce_latency_s if devices > 1 else 0.0
        kv_label = "" if shape.kv_cache_dtype == "auto" else f", kv {shape.kv_cache_dtype}"
        return cls(
            fixed_s=shape.weight_bytes / bandwidth,
            per_prefill_token_s=per_token_flops / flops,
            per_decode_seq_s=per_token_flops / flops,
            per_kv_token_read_s=shape.kv_bytes_per_token / bandwidth,
            per_prefill_attn_pair_s=attn_pair_flops / flops,
            overhead_s=overhead_s + allreduce,
            per_swap_token_s=shape.kv_bytes_per_token / (hw.interconnect_bandwidth * devices),
            per_swap_block_s=10e-6,
            per_copy_token_s=2 * shape.kv_bytes_per_token / bandwidth,
            roofline=True,
            source=f"roofline {shape.name} on {hw.name} (mfu={mfu}, mbu={mbu}{kv_label})",
        )

    def step_time(self, f: StepFeatures) -> float:
        memory = self.fixed_s + self.per_kv_token_read_s * f.kv_tokens_read
        compute = (
            self.per_prefill_token_s * f.prefill_tokens
            + self.per_decode_seq_s * f.decode_seqs
            + self.per_prefill_attn_pair_s * f.prefill_attn_pairs
        )
        core = max(memory, compute) if self.roofline else memory + compute
        moves = self.per_swap_token_s * f.swap_tokens + self.per_swap_block_s * f.swap_blocks
        return self.overhead_s + core + moves + self.per_copy_token_s * f.copy_tokens

    # -------------------------------------------------------------------------- calibration

    @classmethod
    def fit(cls, samples: list[tuple[StepFeatures, float]], source: str = "fit") -> CostModel:
        """Non-negative least squares of step seconds on [1, FIT_FEATURES] (needs >= 5 samples).

        Relative errors matter (a decode step is 100x shorter than a long prefill), so each row
        is weighted by 1 / measured time: the fit minimises squared *relative* error.
        """
        if len(samples) < len(FIT_FEATURES) + 1:
            raise ValueError(f"need at least {len(FIT_FEATURES) + 1} samples, got {len(samples)}")
        x = np.array([f.vector() for f, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        w = 1.0 / np.maximum(y, 1e-9)
        coef = _nnls(x * w[:, None], y * w)
        return cls(coef[0], coef[1], coef[2], coef[3], coef[4], roofline=False, source=source)

    def relative_errors(self, samples: list[tuple[StepFeatures, float]]) -> list[float]:
        return [abs(self.step_time(f) - t) / t for f, t in samples if t > 0]

    def to_json(self, path: str, **extra) -> None:
        with open(path, "w") as f:
            json.dump({**asdict(self), **extra}, f, indent=2)

    @classmethod
    def from_json(cls, path: str) -> CostModel:
        with open(path) as f:
            data = json.load(f)
        fields = {name for name in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in fields})


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative coefficient until none is left."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        # Scale columns: features span 1 to 1e7, and lstsq is better conditioned on unit columns.
        cols = a[:, active]
        scale = np.maximum(np.linalg.norm(cols, axis=0), 1e-30)
        solution = np.linalg.lstsq(cols / scale, b, rcond=None)[0] / scale
        if (solution >= 0).all():
            coef[:] = 0.0
            coef[active] = solution
            return coef
        del active[int(np.argmin(solution))]
    return coef
