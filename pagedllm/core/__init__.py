"""Memory and scheduling, the paper's core: pure Python, never imports torch."""

from pagedllm.core.allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens
from pagedllm.core.block import CPU, GPU, BlockTable, PhysicalBlock
from pagedllm.core.block_manager import AllocationPlan, AllocStatus, BlockSpaceManager
from pagedllm.core.interface import BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerOutputs
from pagedllm.core.step_output import ModelOutput, StepOutputs

__all__ = [
    "CPU",
    "GPU",
    "AllocStatus",
    "AllocationPlan",
    "BlockAllocator",
    "BlockManager",
    "BlockSpaceManager",
    "BlockTable",
    "ModelOutput",
    "NoFreeBlocksError",
    "PhysicalBlock",
    "Scheduler",
    "SchedulerOutputs",
    "StepOutputs",
    "hash_block_tokens",
]
