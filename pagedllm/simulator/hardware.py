"""Hardware presets for the simulator: peak FLOP/s, memory bandwidth, memory size.

Peaks are the vendors' dense fp16/bf16 tensor-core numbers; the cost model applies achievable
fractions of them (``CostModel.from_hardware``). ``cpu-measured`` is this machine's CPU as the
calibration benchmark measured it (benchmarks/paper_calibrate.py writes the JSON it loads).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    peak_flops: float  # per device, FLOP/s
    mem_bandwidth: float  # per device, bytes/s
    mem_bytes: int  # per device
    num_devices: int = 1  # tensor-parallel devices: the model and its KV cache are split over them
    interconnect_bandwidth: float = 32e9  # bytes/s host<->device (swapping), PCIe 4 x16
    # Tensor-parallel all-reduce time per step (two per layer), a fixed cost here.
    allreduce_latency_s: float = 20e-6


HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-40gb": HardwareSpec("a100-40gb", 312e12, 1.555e12, 40 * GiB),
    "a100-80gb": HardwareSpec("a100-80gb", 312e12, 2.039e12, 80 * GiB),
    "h100-80gb": HardwareSpec("h100-80gb", 989e12, 3.35e12, 80 * GiB),
    # The paper's multi-GPU set-ups: OPT-66B on 4 x A100-40GB, OPT-175B on 8 x A100-80GB.
    "4xa100-40gb": HardwareSpec("4xa100-40gb", 312e12, 1.555e12, 40 * GiB, num_devices=4, interconnect_bandwidth=128e9),
    "8xa100-80gb": HardwareSpec("8xa100-80gb", 312e12, 2.039e12, 80 * GiB, num_devices=8, interconnect_bandwidth=256e9),
}

CPU_CALIBRATION_PATH = os.path.join(os.path.dirname(__file__), "cpu_calibration.json")


def get_hardware(name: str) -> HardwareSpec:
    """A preset, or ``cpu-measured`` (from the calibration JSON, when it has been written)."""
    key = name.lower()
    if key in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[key]
    if key == "cpu-measured":
        if not os.path.isfile(CPU_CALIBRATION_PATH):
            raise ValueError(f"no CPU calibration yet: run benchmarks/paper_calibrate.py ({CPU_CALIBRATION_PATH})")
        with open(CPU_CALIBRATION_PATH) as f:
            data = json.load(f)
        return HardwareSpec("cpu-measured", data["peak_flops"], data["mem_bandwidth"], int(data["mem_bytes"]))
    raise ValueError(f"unknown hardware {name!r}: use one of {', '.join([*HARDWARE_PRESETS, 'cpu-measured'])}")
