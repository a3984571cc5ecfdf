"""Memory and scheduling, the paper's core: pure Python, never imports torch."""

from pagedllm.core.allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens
from pagedllm.core.block import CPU, GPU, BlockTable, PhysicalBlock
from pagedllm.core.block_manager import AllocationPlan, AllocStatus, BlockSpaceManager
from pagedllm.core.interface import BlockManager
from pagedllm.core.scheduler import Scheduler, SchedulerOutputs, StepResult
from pagedllm.core.token_sink import ScriptedTokens, TokenSink

__all__ = [
    "CPU",
    "GPU",
    "AllocStatus",
    "AllocationPlan",
    "BlockAllocator",
    "BlockManager",
    "BlockSpaceManager",
    "BlockTable",
    "NoFreeBlocksError",
    "PhysicalBlock",
    "Scheduler",
    "SchedulerOutputs",
    "ScriptedTokens",
    "StepResult",
    "TokenSink",
    "hash_block_tokens",
]
