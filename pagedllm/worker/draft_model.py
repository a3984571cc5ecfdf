"""The draft model's side of speculative decoding: it runs in the worker, inside the step that verifies
its drafts, before the target's forward pass.

Its KV lives in the same paged pool as the target's and is addressed through the target's block
tables (a block holds both models' layers), so the scheduler's allocation, copy-on-write, swapping
and prefix caching cover it with no bookkeeping of its own. The draft's KV is kept valid wherever
the target's is: every step, the draft first computes the tokens the target computes this step
(prompt chunks, decodes), so one batched forward serves both catching up and the first draft. The
one gap is the last draft of a step whose drafts were all accepted: the target computed it during
verification, the draft never saw it. Each decode therefore recomputes the token before its
first (``previous_token_id``), which costs one token a sequence and closes that gap.

Drafts are the draft's greedy tokens. A draft given as one token (its proposal distribution a
point mass) is verified exactly by the target's own sampling (scheduler._verify_drafts), at any
temperature, so the draft's probabilities are never needed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.config import ModelConfig
from pagedllm.models.loader import load_model_config, load_tokenizer
from pagedllm.sampling import SamplingRow
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner, SeqStepInput, StepInput

# The runner produces a logits row for a sequence with a sampling row; the draft never samples.
_LOGITS_ROW = SamplingRow(SamplingParams(), [], [], None)

KVCaches = list[tuple[torch.Tensor, ...]]


def load_draft_model_config(
    model: str, target: ModelConfig, target_tokenizer: Any, download_dir: str | None = None
) -> ModelConfig:
    """The draft model's config (a path or hub id), checked against the target: the same tokenizer
    (a draft token means the same text to both), a context as long, and the target's dtype (the
    pool holds both models' KV in one dtype)."""
    config = load_model_config(model, target.dtype, None, download_dir=download_dir)
    if config.max_model_len < target.max_model_len:
        raise ValueError(
            f"The draft model {model!r} takes {config.max_model_len} tokens of context, the target "
            f"{target.max_model_len}: set max_model_len <= {config.max_model_len}."
        )
    config.max_model_len = target.max_model_len
    if load_tokenizer(config).get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"The draft model {model!r} has another tokenizer than the target model; speculative "
                         "decoding needs the same vocabulary.")
    return config


class DraftModelProposer:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device, vocab_size: int) -> None:
        self.runner = ModelRunner(model, block_size, device, sampler=None)
        # The target's vocabulary: a draft outside it could never be accepted.
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def propose(self, step: StepInput, kv_caches: KVCaches) -> None:
        """Catch the draft's KV up with this step's tokens and give every sequence that asks
        (``num_model_drafts``) its drafts, appended to its token_ids and draft_token_ids."""
        catch_up = []
        for seq in step.seqs:
            previous = [] if seq.previous_token_id is None else [seq.previous_token_id]
            catch_up.append(SeqStepInput(
                seq_id=seq.seq_id,
                token_ids=previous + seq.token_ids,
                start_pos=seq.start_pos - len(previous),
                block_table=seq.block_table,
                sampling_row=_LOGITS_ROW if seq.num_model_drafts else None,
            ))
        proposing = [seq for seq in step.seqs if seq.num_model_drafts]
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in proposing}
        inputs = catch_up  # run even when no sequence proposes: the draft's KV must keep up
        position = 0
        while inputs:
            for seq, token in zip(proposing, self._greedy_tokens(StepInput(inputs), kv_caches)):
                drafts[seq.seq_id].append(token)
            position += 1
            proposing = [seq for seq in proposing if seq.num_model_drafts > position]
            # The next forward feeds each draft back at the position after the sequence's tokens
            # and the drafts before it: lookahead slots the scheduler booked for their verification.
            inputs = [
                SeqStepInput(
                    seq_id=seq.seq_id,
                    token_ids=drafts[seq.seq_id][-1:],
                    start_pos=seq.start_pos + len(seq.token_ids) + position - 1,
                    block_table=seq.block_table,
                    sampling_row=_LOGITS_ROW,
                )
                for seq in proposing
            ]
        for seq in step.seqs:
            if seq.num_model_drafts:
                seq.draft_token_ids = drafts[seq.seq_id]
                seq.token_ids = seq.token_ids + seq.draft_token_ids

    def _greedy_tokens(self, step: StepInput, kv_caches: KVCaches) -> list[int]:
        """One forward of the draft over ``step``; the argmax token of each sequence that has a row."""
        input_ids, positions, meta, sample_indices = self.runner.prepare(step)
        model = self.runner.model
        hidden = model(input_ids, positions, kv_caches, meta)
        if not sample_indices.numel():
            return []
        logits = model.compute_logits(hidden.index_select(0, sample_indices))
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()
