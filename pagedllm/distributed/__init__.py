"""Tensor parallelism over torch.distributed: process groups, the per-step message, the executor.

See executor.py for how ranks start (spawned here, or torchrun) and fail; the parallel layers
live in pagedllm/models/parallel_layers.py.
"""

from pagedllm.distributed.parallel_state import (
    CommStats,
    get_comm_stats,
    get_tp_rank,
    get_tp_state,
    get_tp_world_size,
)

__all__ = ["CommStats", "get_comm_stats", "get_tp_rank", "get_tp_state", "get_tp_world_size"]
