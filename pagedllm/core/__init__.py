"""Memory and scheduling, the paper's core: pure Python, never imports torch."""

from pagedllm.core.allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens
from pagedllm.core.block import CPU, GPU, BlockTable, PhysicalBlock
from pagedllm.core.block_manager import AllocStatus, BlockSpaceManager
from pagedllm.core.scheduler import Scheduler, SchedulerOutputs

__all__ = [
    "CPU",
    "GPU",
    "AllocStatus",
    "BlockAllocator",
    "BlockSpaceManager",
    "BlockTable",
    "NoFreeBlocksError",
    "PhysicalBlock",
    "Scheduler",
    "SchedulerOutputs",
    "hash_block_tokens",
]
