"""Turns one scheduled step into batch tensors, runs the model, and samples.

The batch is flattened (no padding): all tokens computed this step, one after another, with
their positions and KV slots; attention finds each sequence's tokens through query_start_loc
and its cached context through the block table. A batch mixes decodes (one token) and prompt
chunks (many tokens, after a context already in the cache); only sequences whose last token is
computed this step sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from pagedllm.attention import AttentionMetadata
from pagedllm.sampling import Sampler, SamplerOutput, SamplingRow
from pagedllm.sampling.prompt_logprobs import prompt_logprobs, prompt_row_chunks
from pagedllm.step_timing import StepTimer
from pagedllm.worker.pooler import PooledChunk, pool_chunks


@dataclass
class SeqStepInput:
    """What the worker needs about one sequence for one step (plain data, sendable to ranks)."""

    seq_id: int
    token_ids: list[int]  # the tokens computed this step (a decode's one token, or a prompt chunk)
    start_pos: int  # absolute position of token_ids[0] (= tokens already cached)
    block_table: list[int]
    sampling_row: SamplingRow | None  # None: compute only, do not sample (a chunk mid-prompt)
    num_samples: int = 1  # > 1 on the prompt step of best_of / parallel sampling: rows share the logits
    # Top-k of the logprobs of the prompt tokens this step computes (prompt_logprobs); None: not asked.
    prompt_logprobs: int | None = None
    # With prompt_logprobs on a chunk that does not end the prompt: the prompt token after the chunk,
    # which the chunk's last position predicts.
    next_prompt_token: int | None = None
    # Speculative decoding: token_ids ends with these drafts, and every position from the last real
    # token on samples a row (the row at draft j sees the drafts before it as generated tokens).
    draft_token_ids: list[int] = field(default_factory=list)
    # With a draft model: how many drafts the worker's draft model proposes for this sequence before
    # the target's forward (then appended to token_ids and draft_token_ids), and the token before
    # token_ids, which the draft recomputes: its own KV lags the target's by that token when every
    # draft of the previous step was accepted (the last draft was never fed to the draft model).
    num_model_drafts: int = 0
    previous_token_id: int | None = None
    # A pooling request's chunk: "LAST", "MEAN" or "CLS"; its final hidden states are reduced
    # (worker/pooler.py) instead of sampled. None: a generation sequence.
    pooling_type: str | None = None

    def sampling_rows(self) -> list[SamplingRow]:
        """This sequence's sampler rows, in order."""
        row = self.sampling_row
        if row is None:
            return []
        if not self.draft_token_ids:
            return [row] * self.num_samples
        drafts = self.draft_token_ids
        # A constrained sequence's row carries one bitmask per row, [drafts + 1, words]: row j's is
        # its grammar's state after drafts[:j] (the engine's _grammar_bitmasks).
        masks = row.token_bitmask
        per_row = masks is not None and masks.dim() == 2
        return [replace(row, output_token_ids=row.output_token_ids + drafts[:j], keep_generator_state=True,
                        token_bitmask=masks[j] if per_row else masks)
                for j in range(len(drafts) + 1)]

    @property
    def prompt_logprob_targets(self) -> list[int]:
        """The prompt tokens this step's positions predict (prompt_logprobs)."""
        extra = [] if self.next_prompt_token is None else [self.next_prompt_token]
        return self.token_ids[1:] + extra


@dataclass
class StepInput:
    seqs: list[SeqStepInput]
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device, sampler: Sampler) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.step_timer = StepTimer()  # the engine's own timer replaces it when in the same process

    def prepare(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        cached: list[int] = []
        sample_indices: list[int] = []
        for seq in step.seqs:
            n = len(seq.token_ids)
            start = seq.start_pos
            input_ids.extend(seq.token_ids)
            seq_positions = range(start, start + n)
            positions.extend(seq_positions)
            table = seq.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in seq_positions)
            query_start_loc.append(query_start_loc[-1] + n)
            context_lens.append(start + n)
            cached.append(start)
            if seq.sampling_row is not None:
                end = query_start_loc[-1]
                if seq.draft_token_ids:
                    sample_indices.extend(range(end - len(seq.draft_token_ids) - 1, end))
                else:
                    sample_indices.extend([end - 1] * seq.num_samples)
        max_context_len = max(context_lens)
        max_blocks = -(-max_context_len // block_size)
        tables = [_pad(seq.block_table[:max_blocks], max_blocks) for seq in step.seqs]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens=[len(seq.token_ids) for seq in step.seqs],
            query_start_loc=query_start_loc,
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
            num_cached_tokens=cached,
            max_context_len=max_context_len,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
            torch.tensor(sample_indices, dtype=torch.long, device=device),
        )

    @torch.inference_mode()
    def execute(self, step: StepInput, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], generator: torch.Generator):
        timer = self.step_timer
        with timer.phase("prepare_inputs"):
            input_ids, positions, meta, sample_indices = self.prepare(step)
            rows = [row for seq in step.seqs for row in seq.sampling_rows()]
        with timer.phase("forward"):
            hidden = self.model(input_ids, positions, kv_caches, meta)
        with timer.phase("logits"):
            prompt = {
                seq.seq_id: prompt_logprobs(self.model.compute_logits, hidden, start, seq.prompt_logprob_targets,
                                            seq.prompt_logprobs, self.sampler.vocab_size)
                for seq, start in self.prompt_logprob_seqs(step)
            }
            if not rows:  # prompt chunks only
                output = SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
                output.prompt_logprobs = prompt
                output.pooled = self.pool(step, hidden)
                return output
            logits = self.model.compute_logits(hidden.index_select(0, sample_indices))
        with timer.phase("sample"):
            output = self.sampler(logits, rows, generator)
        output.prompt_logprobs = prompt
        output.pooled = self.pool(step, hidden)
        return output

    @staticmethod
    def pool(step: StepInput, hidden: torch.Tensor) -> dict[int, PooledChunk]:
        """Each pooling sequence's chunk reduced (by seq_id); its K/V are in the cache like any prompt's."""
        chunks, seq_ids = [], []
        start = 0
        for seq in step.seqs:
            if seq.pooling_type is not None:
                chunks.append((start, len(seq.token_ids), seq.start_pos, seq.pooling_type))
                seq_ids.append(seq.seq_id)
            start += len(seq.token_ids)
        return dict(zip(seq_ids, pool_chunks(hidden, chunks)))

    @staticmethod
    def prompt_logprob_seqs(step: StepInput) -> list[tuple[SeqStepInput, int]]:
        """The sequences asking for prompt logprobs, each with the flattened row of its first token."""
        found = []
        start = 0
        for seq in step.seqs:
            if seq.prompt_logprobs is not None:
                found.append((seq, start))
            start += len(seq.token_ids)
        return found

    def compute_prompt_logits_shard(self, step: StepInput, hidden: torch.Tensor) -> None:
        """A tensor-parallel rank's part of the prompt logprobs: the same logits calls as rank 0's."""
        for seq, start in self.prompt_logprob_seqs(step):
            for rows in prompt_row_chunks(start, len(seq.prompt_logprob_targets)):
                self.model.compute_logits(hidden[rows.start : rows.stop])

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A forward pass as large as the biggest step, without a cache, to measure peak memory."""
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, None, None)
        self.model.compute_logits(hidden[-1:])


def _pad(block_table: list[int], width: int) -> list[int]:
    # Unused entries point at block 0; attention never reads past a sequence's context length.
    return block_table + [0] * (width - len(block_table))
