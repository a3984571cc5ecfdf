"""The per-step control message rank 0 sends every worker, and its wire format.

Workers only compute (they never sample), so the message carries what the forward pass needs and
no more: per sequence the tokens computed this step (their count is the chunk length: one for a
decode, a prompt chunk's length otherwise), the start position, the change to its block table
since the last step, how many logit rows to produce (none for a chunk mid-prompt) and, for a
pooling request, its pooling type; plus the block moves. Prompts,
outputs, sampling settings and random generators stay on rank 0. It is pickled and broadcast
over the gloo control group: one collective of a fixed-size frame when it fits, a second one for
the rest when it does not.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.layers.parallel_state import TensorParallelState
from pagedllm.sampling import SamplingRow
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import SeqStepInput, StepInput

# Bytes of the first frame: a decode step of a few dozen sequences fits in one broadcast.
FRAME_BYTES = 16 << 10
_HEADER = 8  # message length, little-endian int64, in front of the first frame

# Workers need only "does this sequence produce logits"; this stands for rank 0's real row.
_REMOTE_ROW = SamplingRow(SamplingParams(), [], [], None)

STOP = None  # the message that ends a worker's loop


class StepEncoder:
    """Rank 0's side. Block tables are sent as changes against the table sent last step: a decode step
    usually appends nothing or one block id, so the message stays the same size however long the
    context grows. A sequence absent from a step is forgotten on both sides (sent whole on return).
    """

    def __init__(self) -> None:
        self.sent_tables: dict[int, list[int]] = {}

    def encode(self, step: StepInput | None) -> bytes:
        if step is None:
            return pickle.dumps(None, protocol=pickle.HIGHEST_PROTOCOL)
        previous, tables = self.sent_tables, {}
        seqs = []
        for seq in step.seqs:
            table = seq.block_table
            old = previous.get(seq.seq_id)
            keep = 0
            if old is not None:
                if table[: len(old)] == old:
                    keep = len(old)  # appended blocks only (or none)
                elif old and table[: len(old) - 1] == old[:-1]:
                    keep = len(old) - 1  # the last block was replaced (copy-on-write)
            tables[seq.seq_id] = table
            num_samples = seq.num_samples if seq.sampling_row is not None else 0
            seqs.append((seq.seq_id, seq.token_ids, seq.start_pos, keep, table[keep:], num_samples,
                         seq.prompt_logprobs, seq.next_prompt_token, seq.draft_token_ids, seq.pooling_type))
        self.sent_tables = tables
        payload = (seqs, step.blocks_to_swap_in, step.blocks_to_swap_out, step.blocks_to_copy)
        return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)


class StepDecoder:
    """A worker's side: rebuilds full block tables from the changes (mirror of StepEncoder)."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def decode(self, data: bytes) -> StepInput | None:
        payload: Any = pickle.loads(data)
        if payload is None:
            return None
        wire_seqs, swap_in, swap_out, copy = payload
        previous, tables = self.tables, {}
        seqs = []
        for (seq_id, token_ids, start_pos, keep, appended, num_samples, prompt_logprobs, next_prompt_token,
             draft_token_ids, pooling_type) in wire_seqs:
            table = previous[seq_id][:keep] + appended if keep else appended
            tables[seq_id] = table
            seqs.append(
                SeqStepInput(
                    seq_id=seq_id,
                    token_ids=token_ids,
                    start_pos=start_pos,
                    block_table=table,
                    sampling_row=_REMOTE_ROW if num_samples else None,
                    num_samples=max(num_samples, 1),
                    prompt_logprobs=prompt_logprobs,  # the ranks compute those logits together
                    next_prompt_token=next_prompt_token,
                    draft_token_ids=draft_token_ids,  # the ranks compute the drafts' logits together
                    # Rank 0 pools (the hidden states are whole on every rank); a rank sees which rows
                    # are pooling rows, which produce no logits.
                    pooling_type=pooling_type,
                )
            )
        self.tables = tables
        return StepInput(
            seqs=seqs,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=copy,
        )


def encode_step(step: StepInput | None) -> bytes:
    """A self-contained message (whole block tables): what a worker joining now would need."""
    return StepEncoder().encode(step)


def broadcast_bytes(state: TensorParallelState, data: bytes | None) -> bytes:
    """Rank 0 passes the message, the others pass None and get it back (timed)."""
    stats = state.stats
    start = time.perf_counter()
    frame = torch.zeros(_HEADER + FRAME_BYTES, dtype=torch.uint8)
    if state.rank == 0:
        assert data is not None
        frame[:_HEADER] = torch.frombuffer(bytearray(len(data).to_bytes(_HEADER, "little")), dtype=torch.uint8)
        head = data[:FRAME_BYTES]
        if head:
            frame[_HEADER : _HEADER + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    dist.broadcast(frame, src=0, group=state.control_group)
    length = int.from_bytes(frame[:_HEADER].numpy().tobytes(), "little")
    if length > FRAME_BYTES:
        rest = torch.empty(length - FRAME_BYTES, dtype=torch.uint8)
        if state.rank == 0:
            assert data is not None
            rest.copy_(torch.frombuffer(bytearray(data[FRAME_BYTES:]), dtype=torch.uint8))
        dist.broadcast(rest, src=0, group=state.control_group)
        stats.num_broadcast += 1
        data = frame[_HEADER:].numpy().tobytes() + rest.numpy().tobytes()
    elif state.rank != 0:
        data = frame[_HEADER : _HEADER + length].numpy().tobytes()
    stats.broadcast_s += time.perf_counter() - start
    stats.num_broadcast += 1
    stats.broadcast_bytes += length
    stats.last_message_bytes = length
    assert data is not None
    return data
