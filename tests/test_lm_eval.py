"""lm-evaluation-harness's ``local-completions`` model against the server, on a tiny task defined in a
local YAML file over a local JSON dataset (nothing from a hub): the log-likelihood path (echo +
logprobs) and the generate_until path both run, and the log-likelihoods equal transformers'."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from requirements_here import require
from test_server import MODEL, ServerThread, build_tiny_model, engine_args, wait_idle

from pagedllm.entrypoints.openai.api_server import build_app

lm_eval = require("lm_eval")

DOCS = [
    {"context": "The quick brown fox", "continuation": " jumps over the lazy dog."},
    {"context": "Hello world, this is", "continuation": " a tiny test corpus"},
    {"context": "Once upon a time there was", "continuation": " a small model"},
    {"context": "0123456789 abcdefghij", "continuation": "klmnopqrstuvwxyz"},
    {"context": "The quick brown fox jumps over the lazy dog. The quick", "continuation": " brown fox"},
]
LOGLIKELIHOOD_TASK = """task: pagedllm_tiny_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
"""
GENERATE_TASK = """task: pagedllm_tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def hf_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """The pair as lm-eval tokenizes it (the context's tokens, then the whole string's tokens past as many),
    scored by transformers."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    ids = context_ids + whole[len(context_ids) :]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(logprobs[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids)))


def test_lm_eval_local_completions(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = str(tmp_path / "model")
    build_tiny_model(model_dir)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "loglikelihood.yaml").write_text(LOGLIKELIHOOD_TASK.format(data=data))
    (tasks / "generate.yaml").write_text(GENERATE_TASK.format(data=data))
    app = build_app(engine_args(model_dir, num_kv_blocks=64), served_model_name=MODEL)
    with ServerThread(app) as running:
        model_args = (f"base_url={running.url}/v1/completions,model={MODEL},tokenizer={model_dir},"
                      "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,"
                      "timeout=120")
        results = simple_evaluate(model="local-completions", model_args=model_args, batch_size=2,
                                  tasks=["pagedllm_tiny_loglikelihood", "pagedllm_tiny_generate"],
                                  task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                  bootstrap_iters=0)
        with httpx.Client(base_url=running.url, timeout=60) as http:
            generated = {}
            for doc in DOCS:  # what the generate_until requests must have got
                body = {"model": MODEL, "prompt": doc["context"], "max_tokens": 8, "temperature": 0,
                        "stop": ["\n"], "seed": 1234}
                generated[doc["context"]] = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            wait_idle(http)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = results["samples"]["pagedllm_tiny_loglikelihood"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        doc = sample["doc"]
        loglikelihood, _ = sample["resps"][0][0]
        assert loglikelihood == pytest.approx(hf_loglikelihood(model, tokenizer, doc["context"], doc["continuation"]),
                                              abs=1e-3)
    generations = results["samples"]["pagedllm_tiny_generate"]
    assert len(generations) == len(DOCS)
    for sample in generations:
        assert sample["resps"][0][0] == generated[sample["doc"]["context"]]
    assert "perplexity,none" in results["results"]["pagedllm_tiny_loglikelihood"]
