"""Embeddings: the pooling runner, LLM.embed and POST /v1/embeddings against transformers.

The oracle is a tiny random Qwen3 loaded by transformers as ``Qwen3Model`` (AutoModel: the final
hidden states after the last norm), pooled the way Qwen3-Embedding's model card does (a left-padded
batch, the last token's state, whose tokenizer appends ``<|endoftext|>``), or by the mean over the
prompt's tokens; every embedding must match with cosine >= 0.9999, however the engine batched or
chunked the prompts, and every KV block must be back in the pool afterwards.
"""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_no_leaks

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.executor.messages import StepDecoder, StepEncoder
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import SeqStepInput, StepInput

MIN_COSINE = 0.9999
CORPUS = [
    "Retrieval augmented generation embeds documents and queries into one vector space.",
    "PagedAttention stores the KV cache in fixed-size blocks, like pages of virtual memory.",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "Embeddings of similar texts point in similar directions; cosine similarity compares them.",
] * 10
TEXTS = [
    "query: what is paged attention?",
    "A block table maps logical blocks to physical blocks anywhere in the pool, so a sequence's cache "
    "need not be contiguous in memory.",
    "dog",
    "Embeddings of similar texts point in similar directions.",
]
LONG_TEXT = " ".join(CORPUS[:6])  # well over one step's budget below: computed in chunks


def build_qwen3_embedding(path: str) -> str:
    """A tiny random Qwen3 with a Qwen3-Embedding-style tokenizer: <|endoftext|> appended to every input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                       special_tokens=[("<|endoftext|>", eot)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=0.2,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=eot,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_qwen3_embedding(str(tmp_path_factory.mktemp("tiny-qwen3-embedding")))


@pytest.fixture(scope="module")
def matryoshka_dir(model_dir, tmp_path_factory) -> str:
    """The same model, its config marking it as trained for Matryoshka embeddings of 16 and 32 values."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3-matryoshka") / "model")
    shutil.copytree(model_dir, path)
    with open(f"{path}/config.json") as file:
        config = json.load(file)
    config["matryoshka_dimensions"] = [16, 32]
    with open(f"{path}/config.json", "w") as file:
        json.dump(config, file)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def settings(model_dir: str, **overrides) -> dict:
    values = dict(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64, num_threads=2, runner="pooling")
    values.update(overrides)
    return values


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(**settings(model_dir))


def hf_last_token(hf_model, hf_tokenizer, texts: list[str]) -> torch.Tensor:
    """Qwen3-Embedding's recipe: a left-padded batch, the last position's final hidden state, L2-normalized."""
    batch = hf_tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    with torch.inference_mode():
        hidden = hf_model(**batch).last_hidden_state
    return F.normalize(hidden[:, -1], p=2, dim=-1)


def hf_hidden(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]


def assert_close(actual: list[float] | torch.Tensor, expected: torch.Tensor) -> None:
    actual = torch.as_tensor(actual, dtype=torch.float32)
    assert actual.shape == expected.shape
    cosine = F.cosine_similarity(actual, expected.float(), dim=0).item()
    assert cosine >= MIN_COSINE, cosine
    assert torch.allclose(actual.norm(), expected.float().norm(), rtol=1e-3)


# ------------------------------------------------------------------------------------ LLM.embed


def test_last_token_batch_matches_transformers(llm, hf_model, hf_tokenizer):
    outputs = llm.embed(TEXTS, use_tqdm=False)
    expected = hf_last_token(hf_model, hf_tokenizer, TEXTS)
    eot = hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for text, output, reference in zip(TEXTS, outputs, expected):
        assert output.prompt_token_ids == hf_tokenizer(text)["input_ids"]
        assert output.prompt_token_ids[-1] == eot  # the tokenizer's own EOS handling, as Qwen3-Embedding's
        assert output.finished and output.outputs.hidden_size == 64
        assert_close(output.outputs.embedding, reference)
        assert abs(np.linalg.norm(output.outputs.embedding) - 1) < 1e-5
    # Different lengths, one engine step: they were batched.
    assert len({len(o.prompt_token_ids) for o in outputs}) == len(TEXTS)
    assert_no_leaks(llm)


def test_chunked_long_prompt_matches_unchunked(model_dir, hf_model, hf_tokenizer):
    chunked = LLM(**settings(model_dir, max_num_batched_tokens=32, long_prompt_chunk_tokens=32))
    token_ids = hf_tokenizer(LONG_TEXT)["input_ids"]
    assert len(token_ids) > 3 * 32
    steps = chunked.llm_engine.num_steps
    [output] = chunked.embed(LONG_TEXT, use_tqdm=False)
    assert chunked.llm_engine.num_steps - steps >= 4  # the prompt really was chunked
    assert_close(output.outputs.embedding, hf_last_token(hf_model, hf_tokenizer, [LONG_TEXT])[0])
    # Mixed with short prompts in the same steps.
    outputs = chunked.embed([LONG_TEXT] + TEXTS, use_tqdm=False)
    expected = hf_last_token(hf_model, hf_tokenizer, [LONG_TEXT] + TEXTS)
    for output, reference in zip(outputs, expected):
        assert_close(output.outputs.embedding, reference)
    assert_no_leaks(chunked)
    # The paper's scheduling (a step is all prefill or all decode): whole prompts.
    whole = LLM(**settings(model_dir, enable_chunked_prefill=False))
    for output, reference in zip(whole.embed([LONG_TEXT] + TEXTS, use_tqdm=False), expected):
        assert_close(output.outputs.embedding, reference)
    assert_no_leaks(whole)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_match_transformers_chunked_or_not(model_dir, hf_model, pooling_type):
    for budget in (512, 24):  # whole prompts, then chunks of a few tokens
        llm = LLM(**settings(model_dir, pooler_config={"pooling_type": pooling_type}, max_num_batched_tokens=budget,
                             long_prompt_chunk_tokens=24))
        outputs = llm.embed([LONG_TEXT] + TEXTS, use_tqdm=False)
        for output in outputs:
            hidden = hf_hidden(hf_model, output.prompt_token_ids)
            pooled = hidden.mean(dim=0) if pooling_type == "MEAN" else hidden[0]
            assert_close(output.outputs.embedding, F.normalize(pooled, dim=-1))
        # Every position is needed: no prefix-cache hit, even for a prompt seen before.
        [repeat] = llm.encode(LONG_TEXT, use_tqdm=False)
        assert repeat.num_cached_tokens == 0
        assert torch.allclose(repeat.outputs.data, torch.tensor(outputs[0].outputs.embedding), atol=1e-5)
        assert_no_leaks(llm)


def test_last_token_pooling_shares_cached_prefixes(model_dir, hf_model, hf_tokenizer):
    llm = LLM(**settings(model_dir))
    [first] = llm.encode(LONG_TEXT, use_tqdm=False)
    [second] = llm.encode(LONG_TEXT, use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 16  # the freed blocks stayed cached
    assert torch.allclose(first.outputs.data, second.outputs.data, atol=1e-5)
    assert_no_leaks(llm)


def test_normalize_and_dimensions(llm, model_dir, matryoshka_dir, hf_model, hf_tokenizer):
    [raw] = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)
    ids = hf_tokenizer(TEXTS[0])["input_ids"]
    assert_close(raw.outputs.embedding, hf_hidden(hf_model, ids)[-1])
    assert abs(np.linalg.norm(raw.outputs.embedding) - 1) > 1e-3
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(ValueError, match="greater than 0"):
        PoolingParams(dimensions=0)
    matryoshka = LLM(**settings(matryoshka_dir))
    with pytest.raises(ValueError, match=r"only supports \[16, 32\]"):
        matryoshka.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    outputs = matryoshka.embed(TEXTS[:2], [PoolingParams(dimensions=16), PoolingParams(dimensions=32)],
                               use_tqdm=False)
    full = hf_last_token(hf_model, hf_tokenizer, TEXTS[:2])
    for output, reference, dims in zip(outputs, full, (16, 32)):
        assert output.outputs.hidden_size == dims
        assert_close(output.outputs.embedding, F.normalize(reference[:dims], dim=-1))  # truncated, renormalized
    assert_no_leaks(llm)
    assert_no_leaks(matryoshka)


def test_async_engine_encode(llm, hf_model, hf_tokenizer):
    import asyncio

    from pagedllm.engine.async_engine import AsyncLLMEngine

    async def run() -> list:
        front = AsyncLLMEngine(llm.llm_engine)
        try:
            streams = [front.encode(text, PoolingParams(), f"embed-{i}") for i, text in enumerate(TEXTS[:2])]
            return [[output async for output in stream] for stream in streams]
        finally:
            await front.shutdown()

    results = asyncio.run(run())
    for outputs, reference in zip(results, hf_last_token(hf_model, hf_tokenizer, TEXTS[:2])):
        [output] = outputs  # one output, when the prompt is done
        assert output.finished and output.error is None
        assert_close(output.outputs.data, reference)
    assert_no_leaks(llm)


def test_runner_settings_and_refusals(llm, model_dir):
    with pytest.raises(ValueError, match="serves embeddings only"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    generator = LLM(**settings(model_dir, runner="auto"))  # no sentence-transformers files: generate
    assert generator.llm_engine.supported_tasks == ("generate",)
    with pytest.raises(ValueError, match="runner='pooling'"):
        generator.embed("hello", use_tqdm=False)
    assert generator.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    assert EngineArgs(task="embed").runner == "pooling" and EngineArgs(convert="embed").runner == "pooling"
    for bad in (dict(runner="embed"), dict(task="classify"), dict(task="embed", runner="generate"),
                dict(runner="pooling", convert="none"), dict(pooler_config={"pooling_type": "MAX"}),
                dict(pooler_config='{"pooling": "MEAN"}')):
        with pytest.raises(ValueError):
            EngineArgs(**bad)
    with pytest.raises(ValueError, match="longer than the model's context"):
        LLM(**settings(model_dir, max_model_len=16)).embed(LONG_TEXT, use_tqdm=False)
    assert_no_leaks(llm)


def test_sentence_transformers_checkpoint_picks_pooling(model_dir, hf_model, tmp_path):
    """runner="auto" on a sentence-transformers folder: pooling, with its Pooling module's mode."""
    path = str(tmp_path / "st")
    shutil.copytree(model_dir, path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    with open(f"{path}/modules.json", "w") as file:
        json.dump(modules, file)
    (tmp_path / "st" / "1_Pooling").mkdir()
    with open(f"{path}/1_Pooling/config.json", "w") as file:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, file)
    llm = LLM(**settings(path, runner="auto"))
    assert llm.llm_engine.supported_tasks == ("embed",)
    assert llm.llm_engine.pooler_config.pooling_type == "MEAN"
    assert llm.llm_engine.pooler_config.normalize is False  # no Normalize module
    [output] = llm.embed(TEXTS[1], use_tqdm=False)
    assert_close(output.outputs.embedding, hf_hidden(hf_model, output.prompt_token_ids).mean(dim=0))
    with open(f"{path}/1_Pooling/config.json", "w") as file:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_max_tokens": True}, file)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens .* is not supported"):
        LLM(**settings(path, runner="auto"))
    # The generation runner never reads the checkpoint's pooling.
    assert LLM(**settings(path, runner="generate")).llm_engine.supported_tasks == ("generate",)


def test_pooling_type_travels_to_tensor_parallel_ranks():
    seq = SeqStepInput(seq_id=7, token_ids=[1, 2, 3], start_pos=0, block_table=[4], sampling_row=None,
                       pooling_type="MEAN")
    [decoded] = StepDecoder().decode(StepEncoder().encode(StepInput(seqs=[seq]))).seqs
    assert decoded.pooling_type == "MEAN" and decoded.sampling_row is None


# ------------------------------------------------------------------------------------ the scheduler


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_scheduler_runs_pooling_requests_as_prompts_only(chunked, preemption_mode):
    """Pooling groups among generation groups, in a pool tight enough to preempt: each computes its prompt
    (in chunks, or again after a preemption), samples no row, and finishes with its blocks freed."""
    from fake_engine import BS, FakeEngine, make_scheduler

    from pagedllm.core.scheduler import num_samples
    from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

    scheduler = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=24, max_num_batched_tokens=24 if chunked else 40,
                               enable_chunked_prefill=chunked, preemption_mode=preemption_mode,
                               long_prompt_chunk_tokens=8 if chunked else 0)
    engine = FakeEngine(scheduler)
    pooling = []
    for i in range(6):
        engine.add(f"gen-{i}", 5 + 3 * i, max_tokens=12)
        seq = Sequence(scheduler.next_seq_id(), list(range(200 + i, 220 + 3 * i)), BS)
        group = SequenceGroup(f"embed-{i}", [seq], SamplingParams(max_tokens=1),
                              pooling_params=PoolingParams(), pooling_type="MEAN" if i % 2 else "LAST")
        scheduler.add_seq_group(group)
        pooling.append(group)
    while scheduler.has_unfinished_seqs():
        out = engine.step()
        for group in out.scheduled_seq_groups:
            if group.is_pooling:
                for seq in group.seqs:
                    assert num_samples(group, seq, out.num_scheduled_tokens.get(seq.seq_id, 0)) == 0
    assert engine.bm.all_free()
    for group in pooling:
        [seq] = group.seqs
        assert seq.status == SequenceStatus.FINISHED_STOPPED and not seq.output_token_ids
        assert seq.num_computed_tokens == seq.prompt_len
        assert engine.finished[group.request_id] is group
    assert all(len(engine.finished[f"gen-{i}"].seqs[0].output_token_ids) == 12 for i in range(6))
    if chunked:  # a pooling group mid-prompt was preempted, and came back
        assert any(group.num_preemptions for group in pooling)


# ------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server(matryoshka_dir):
    from test_server import ServerThread

    app = build_app(EngineArgs(**settings(matryoshka_dir, max_model_len=128)), served_model_name="tiny-embed")
    with ServerThread(app) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with httpx.Client(base_url=running.url, timeout=60) as http:
            yield running, client, http, app.state.async_engine.engine


def test_openai_client_embeddings(server, hf_model, hf_tokenizer):
    _, client, _, engine = server
    expected = hf_last_token(hf_model, hf_tokenizer, TEXTS)
    response = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float", user="u-1")
    assert response.object == "list" and response.model == "tiny-embed"
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    for item, reference in zip(response.data, expected):
        assert item.object == "embedding"
        assert_close(item.embedding, reference)
    num_tokens = sum(len(hf_tokenizer(t)["input_ids"]) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    # One string; token ids; lists of token ids; base64 (the openai client's default encoding).
    single = client.embeddings.create(model="tiny-embed", input=TEXTS[0])
    assert_close(single.data[0].embedding, expected[0])
    ids = [hf_tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model="tiny-embed", input=ids[0], encoding_format="float")
    assert_close(by_ids.data[0].embedding, expected[0])
    by_id_lists = client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    for item, reference in zip(by_id_lists.data, expected[:2]):
        assert_close(item.embedding, reference)
    truncated = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=16, encoding_format="float")
    assert_close(truncated.data[0].embedding, F.normalize(expected[0][:16], dim=-1))
    # vLLM's truncate_prompt_tokens: the input's last k tokens.
    tail = client.embeddings.create(model="tiny-embed", input=TEXTS[1], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 5})
    assert tail.usage.prompt_tokens == 5
    assert_close(tail.data[0].embedding, F.normalize(hf_hidden(hf_model, hf_tokenizer(TEXTS[1])["input_ids"][-5:])[-1],
                                                     dim=-1))
    assert_no_leaks(engine)


def test_embeddings_base64_and_models(server, hf_model, hf_tokenizer):
    _, _, http, engine = server
    body = http.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype=np.float32)
    assert_close(torch.from_numpy(vector.copy()), hf_last_token(hf_model, hf_tokenizer, [TEXTS[1]])[0])
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny-embed" and card["supported_tasks"] == ["embed"]
    assert_no_leaks(engine)


def assert_error(response: httpx.Response, param: str | None, contains: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert contains in error["message"], error


def test_embeddings_errors(server):
    _, client, http, engine = server
    assert_error(http.post("/v1/embeddings", json={"input": ""}), "input", "empty")
    assert_error(http.post("/v1/embeddings", json={"input": []}), "input", "empty")
    assert_error(http.post("/v1/embeddings", json={"input": [[]]}), "input", "empty")
    assert_error(http.post("/v1/embeddings", json={"input": LONG_TEXT * 2}), "input", "maximum context length")
    assert_error(http.post("/v1/embeddings", json={"input": "a", "dimensions": 8}), "dimensions", "only supports")
    assert_error(http.post("/v1/embeddings", json={"input": "a", "dimensions": 0}), "dimensions", "greater than 0")
    assert_error(http.post("/v1/embeddings", json={"input": [10**6]}), "input", "vocabulary")
    assert_error(http.post("/v1/embeddings", json={"input": "a", "truncate_prompt_tokens": 0}),
                 "truncate_prompt_tokens", "")
    assert_error(http.post("/v1/embeddings", json={"input": "a", "encoding_format": "int8"}), "encoding_format", "")
    assert http.post("/v1/embeddings", json={"input": "a", "model": "other"}).status_code == 404
    # This server pools: generation endpoints answer 400 with what to do.
    with pytest.raises(openai.BadRequestError, match="embed"):
        client.completions.create(model="tiny-embed", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embed"):
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    assert_no_leaks(engine)


def test_generate_server_refuses_embeddings(model_dir):
    from test_server import ServerThread

    app = build_app(EngineArgs(**settings(model_dir, runner="generate")), served_model_name="tiny")
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        assert_error(http.post("/v1/embeddings", json={"input": "hello"}), None, "--runner pooling")
        assert http.get("/v1/models").json()["data"][0]["supported_tasks"] == ["generate"]


def test_tensor_parallel_embeddings_match(model_dir, hf_model, hf_tokenizer):
    """Two ranks: rank 0 pools the (whole, replicated) final hidden states; chunked prompts included."""
    llm = LLM(**settings(model_dir, tensor_parallel_size=2, max_num_batched_tokens=32, long_prompt_chunk_tokens=32))
    try:
        outputs = llm.embed([LONG_TEXT] + TEXTS, use_tqdm=False)
        for output, reference in zip(outputs, hf_last_token(hf_model, hf_tokenizer, [LONG_TEXT] + TEXTS)):
            assert_close(output.outputs.embedding, reference)
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
