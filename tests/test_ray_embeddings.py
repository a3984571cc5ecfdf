"""Embeddings from data-parallel replicas on Ray: the pooling runner in every replica, one front end.

Two replicas of a tiny Qwen3 embedding model on a local two-node Ray cluster: /v1/models says the
server embeds, /v1/embeddings spreads its inputs over both replicas and answers as transformers'
pooled output does, and a generation endpoint is refused with the reason.
"""

from __future__ import annotations

import openai
import pytest
from test_embeddings import TEXTS, assert_close, build_qwen3_embedding, hf_last_token, settings
from test_ray_replicas import _metric
from test_server import ServerThread

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.serving.data_parallel import DataParallelConfig

MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_qwen3_embedding(str(tmp_path_factory.mktemp("tiny-qwen3-embedding")))


def test_replicas_serve_embeddings(ray_cluster, model_dir):
    import httpx
    from transformers import AutoModel, AutoTokenizer

    hf_model = AutoModel.from_pretrained(model_dir).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = DataParallelConfig(data_parallel_size=2, distributed_executor_backend="ray", router="round_robin")
    app = build_app(EngineArgs(**settings(model_dir, num_threads=1)), served_model_name=MODEL, data_parallel=config)
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=60) as http:
        assert http.get("/v1/models").json()["data"][0]["supported_tasks"] == ["embed"]
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=60)
        response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        for item, reference in zip(response.data, hf_last_token(hf_model, hf_tokenizer, TEXTS)):
            assert_close(item.embedding, reference)
        assert response.usage.prompt_tokens == sum(len(hf_tokenizer(text)["input_ids"]) for text in TEXTS)
        # Round robin: the inputs were spread over both replicas.
        assert set(_metric(http, "router_requests_total")) == {"0", "1"}
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 400 and "embeddings only" in refused.json()["error"]["message"]
