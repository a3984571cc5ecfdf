"""OpenVINO GenAI peer of benchmarks/peers.py (a venv with ``openvino-genai`` + ``optimum-intel[openvino]``).

``ContinuousBatchingPipeline`` on the model exported by ``optimum-cli export openvino`` (fp32 weights).
Precision comes from properties: float32 = ``INFERENCE_PRECISION_HINT=f32`` + ``KV_CACHE_PRECISION=f32``
(exact, comparable with transformers), bfloat16 = bf16 compute and KV cache, native = OpenVINO's own
defaults (bf16 compute, u8 KV cache on CPUs with bf16). Token-id inputs as ``ov.Tensor`` int64,
greedy, ``ignore_eos`` without ``min_new_tokens`` (which would ban EOS instead of ignoring it).
"""

from __future__ import annotations

import subprocess

from _protocol import bin_path, main

PRECISION = {
    "float32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"},
    "bfloat16": {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16"},
    "native": {},
}


def probe() -> dict:
    import openvino_genai

    return {"engine": "openvino", "version": openvino_genai.__version__}


def load(model: str, dtype: str, threads: int, options: dict, workloads: dict):
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = 2  # GB, as the other engines' KV pools
    scheduler.max_num_seqs = 256
    scheduler.enable_prefix_caching = bool(options.get("prefix_caching", False))
    properties = {"INFERENCE_NUM_THREADS": threads, **PRECISION[dtype]}
    pipeline = ov_genai.ContinuousBatchingPipeline(model, scheduler, "CPU", properties)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        inputs = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in prompts]
        configs = []
        for n in max_tokens:
            config = ov_genai.GenerationConfig()
            config.max_new_tokens = n
            config.ignore_eos = True
            config.do_sample = False
            configs.append(config)
        results = pipeline.generate(inputs, configs)
        return [list(r.m_generation_ids[0]) for r in results]

    return generate


def convert(hf_dir: str, out: str, dtype: str) -> None:
    # fp32 weights: one export serves every precision (the hint decides the compute type at load time).
    subprocess.run([bin_path("optimum-cli"), "export", "openvino", "--model", hf_dir,
                    "--task", "text-generation-with-past", "--weight-format", "fp32", out], check=True)


if __name__ == "__main__":
    raise SystemExit(main(probe, load, convert))
