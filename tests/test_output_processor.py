"""The engine's output side stands apart from the scheduler: the output processor and the beam
searcher read what a step produced and return data; neither holds nor calls the scheduler.

Checked three ways: the two modules import nothing of the scheduler or the engine core; the
processor, run on a step's outputs with a scheduler that raises on any use, ends a sequence on a
stop string by itself (and hands it back to be freed); the searcher's decision leaves the request
exactly as it found it.
"""

from __future__ import annotations

import ast
import contextlib
import math
import pathlib

import pytest
import torch
from conftest import assert_no_leaks, train_tokenizer

from pagedllm import LLM
from pagedllm.core.beam_step import BeamChoice, BeamSearchState
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_output import NewTokens, RequestStepOutput
from pagedllm.engine.beam_search import BeamSearcher
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

ENGINE = pathlib.Path(__file__).resolve().parents[1] / "pagedllm" / "engine"
SCHEDULER_SIDE = ("pagedllm.core.scheduler", "pagedllm.engine.engine_core", "pagedllm.engine.llm_engine")


def imported_modules(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", ["output_processor.py", "beam_search.py"])
def test_the_output_side_imports_nothing_of_the_scheduler(module: str) -> None:
    imported = imported_modules(ENGINE / module)
    assert "pagedllm.core.step_output" in imported or "pagedllm.core.beam_step" in imported  # the plain data
    assert not [name for name in imported if name.startswith(SCHEDULER_SIDE)], imported


@contextlib.contextmanager
def scheduler_forbidden(scheduler: Scheduler):
    """Every method of ``scheduler`` raises while inside."""

    def forbidden(name: str):
        def call(*args, **kwargs):
            raise AssertionError(f"the output side called Scheduler.{name}")
        return call

    names = [name for name in dir(Scheduler) if not name.startswith("__") and callable(getattr(Scheduler, name))]
    for name in names:
        setattr(scheduler, name, forbidden(name))
    try:
        yield
    finally:
        for name in names:
            delattr(scheduler, name)


def test_processing_steps_never_calls_the_scheduler(tiny_model_factory) -> None:
    """Samples ending on stop strings and a beam search, each step's outputs processed while the
    engine's scheduler refuses every call: the requests still finish, with every block back."""
    llm = LLM(model=tiny_model_factory("llama"), num_kv_blocks=64, block_size=4, num_threads=1, device="cpu",
              dtype="float32")
    engine = llm.llm_engine
    process = engine.output_processor.process
    steps = []

    def guarded(requests, now):
        with scheduler_forbidden(engine.scheduler):
            steps.append(len(requests))
            return process(requests, now)

    engine.output_processor.process = guarded
    sampled = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, stop=["e", "o"])
    beams = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], [sampled, beams], use_tqdm=False)
    assert steps and all(output.finished for output in outputs)
    assert len(outputs[0].outputs) == 2 and len(outputs[1].outputs) == 2
    assert any(c.stop_reason in ("e", "o") for c in outputs[0].outputs)  # a stop string really ended one
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def running_group(tokenizer, params: SamplingParams, text: str) -> tuple[SequenceGroup, Sequence]:
    """A request whose one sequence has the tokens of ``text`` appended, as Scheduler.update leaves it."""
    seq = Sequence(0, tokenizer.encode("Hello"), block_size=4)
    seq.status = SequenceStatus.RUNNING
    for token_id in tokenizer.encode(text):
        seq.append_token(token_id, -0.25)
    return SequenceGroup("r", [seq], params), seq


def test_a_stop_string_inside_one_steps_tokens_ends_the_sequence_there(tokenizer) -> None:
    """A speculating sequence got several tokens in one step; the stop string completes in the middle:
    the processor cuts the text, drops the tokens after it, recomputes the logprob sum exactly and
    returns the sequence for the engine core to free."""
    params = SamplingParams(stop=["world"], max_tokens=50)
    group, seq = running_group(tokenizer, params, "")
    tokens = tokenizer.encode(" block world and more")
    stop_at = next(i for i in range(len(tokens)) if "world" in tokenizer.decode(tokens[: i + 1]))
    assert stop_at < len(tokens) - 1  # tokens follow the one that completes the stop string
    logprobs = [-0.5 - 0.125 * i for i in range(len(tokens))]
    for token_id, logprob in zip(tokens, logprobs):
        seq.append_token(token_id, logprob)
    step = RequestStepOutput(group, [NewTokens(seq, tokens, logprobs, 0.0)])
    processed = OutputProcessor(tokenizer).process([step], now=1.0)
    assert processed.stopped == [seq] and not processed.failed
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "world"
    assert seq.output_token_ids == tokens[: stop_at + 1]
    expected = 0.0
    for logprob in logprobs[: stop_at + 1]:
        expected += logprob
    assert seq.cumulative_logprob == expected
    [output] = processed.outputs
    assert output.finished and output.outputs[0].text == " block "
    assert output.outputs[0].finish_reason == "stop" and output.metrics.finished_time == 1.0


def test_a_stop_tokens_text_is_cut_and_nothing_is_handed_back(tokenizer) -> None:
    """EOS was found by the scheduler (status set): the processor only removes its text."""
    group, seq = running_group(tokenizer, SamplingParams(skip_special_tokens=False), " hi")
    first = seq.get_output_len()
    seq.append_token(tokenizer.eos_token_id, -0.1)
    seq.status = SequenceStatus.FINISHED_STOPPED
    new = [NewTokens(seq, list(seq.output_token_ids), [-0.25] * first + [-0.1], 0.0)]
    processed = OutputProcessor(tokenizer).process([RequestStepOutput(group, new)], now=2.0)
    assert processed.stopped == [] and processed.outputs[0].outputs[0].text == " hi"
    assert seq.output_token_ids[-1] == tokenizer.eos_token_id


def beam_group(width: int) -> tuple[SequenceGroup, list[Sequence]]:
    params = SamplingParams(use_beam_search=True, best_of=width, n=width, max_tokens=5, temperature=0.0)
    beams = []
    for seq_id in range(width):
        beam = Sequence(seq_id, [5, 6, 7], block_size=4)
        beam.status = SequenceStatus.RUNNING
        beam.append_token(10 + seq_id, -1.0)
        beams.append(beam)
    group = SequenceGroup("beams", list(beams), params)
    group.beam_state = BeamSearchState.for_request(params, 3, max_seq_len=64)
    group.beam_state.running_scores = {beam.seq_id: -1.0 - beam.seq_id for beam in beams}
    return group, beams


def test_the_beam_searcher_only_decides() -> None:
    """select() names parents by index and changes neither the sequences nor the search state; asked
    twice, it answers the same."""
    group, beams = beam_group(3)
    torch.manual_seed(0)
    raw = torch.log_softmax(torch.randn(3, 50), dim=-1)
    before = (list(group.seqs), dict(group.beam_state.running_scores), [list(b.output_token_ids) for b in beams])
    searcher = BeamSearcher(eos_token_id=2)
    first, second = searcher.select(group, beams, raw), searcher.select(group, beams, raw)
    assert first == second
    assert (list(group.seqs), dict(group.beam_state.running_scores), [list(b.output_token_ids) for b in beams]) \
        == before
    assert len(first.next_beams) == 3 and all(isinstance(c, BeamChoice) for c in first.next_beams)
    for choice in first.next_beams:
        assert 0 <= choice.parent < 3
        assert math.isclose(choice.logprob, raw[choice.parent, choice.token_id].item())
    assert not hasattr(searcher, "scheduler")
