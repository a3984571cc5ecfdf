"""Paper-scale serving without the hardware: the real core/ scheduler and block manager, a cost-model clock.

Everything here is labelled *simulated*; benchmarks/paper_*.py use it for the paper's A100 set-ups.
"""

from pagedllm.simulator.cost_model import CostModel, StepFeatures
from pagedllm.simulator.hardware import HARDWARE_PRESETS, HardwareSpec, get_hardware
from pagedllm.simulator.model_shapes import MODEL_SHAPES, ModelShape, get_model_shape, shape_from_hf_config
from pagedllm.simulator.serving import POLICIES, SimConfig, SimResult, kv_pool_blocks, simulate, sustained_rate
from pagedllm.simulator.traces import TraceRequest, load_sharegpt, make_trace, synthetic_trace

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_SHAPES",
    "POLICIES",
    "CostModel",
    "HardwareSpec",
    "ModelShape",
    "SimConfig",
    "SimResult",
    "StepFeatures",
    "TraceRequest",
    "get_hardware",
    "get_model_shape",
    "kv_pool_blocks",
    "load_sharegpt",
    "make_trace",
    "shape_from_hf_config",
    "simulate",
    "sustained_rate",
    "synthetic_trace",
]
