"""CTranslate2 peer of benchmarks/peers.py (runs in a venv with ``ctranslate2``; see _protocol.py).

Static batching (``Generator.generate_batch``), like transformers: requests in arrival order, each
batch runs to its longest requested output and the extra tokens are dropped. Inputs are vocabulary
strings (the converted model's vocabulary), outputs are ids. EOS is ignored without being banned
(``end_token=[]``: no stop token at all), so greedy picks what every other engine picks.
"""

from __future__ import annotations

import json
import os
import subprocess

from _protocol import bin_path, main

COMPUTE_TYPES = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8_float32"}


def probe() -> dict:
    import ctranslate2

    return {"engine": "ctranslate2", "version": ctranslate2.__version__,
            "compute_types": sorted(ctranslate2.get_supported_compute_types("cpu"))}


def read_vocabulary(model_dir: str) -> list[str]:
    json_path = os.path.join(model_dir, "vocabulary.json")
    if os.path.isfile(json_path):
        with open(json_path, encoding="utf-8") as f:
            return json.load(f)
    with open(os.path.join(model_dir, "vocabulary.txt"), encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def load(model: str, dtype: str, threads: int, options: dict, workloads: dict):
    import ctranslate2

    compute_type = COMPUTE_TYPES[dtype]
    supported = ctranslate2.get_supported_compute_types("cpu")
    if compute_type not in supported:
        raise ValueError(f"compute type {compute_type} is not supported on this CPU build ({sorted(supported)})")
    generator = ctranslate2.Generator(model, device="cpu", compute_type=compute_type, intra_threads=threads,
                                      inter_threads=1)
    vocabulary = read_vocabulary(model)
    batch_size = int(options.get("batch_size") or 0)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        size = batch_size or len(prompts)
        results: list[list[int]] = []
        for start in range(0, len(prompts), size):
            batch, outs = prompts[start:start + size], max_tokens[start:start + size]
            length = max(outs)
            generated = generator.generate_batch(
                [[vocabulary[t] for t in ids] for ids in batch], max_length=length, min_length=0,
                sampling_topk=1, beam_size=1, end_token=[], include_prompt_in_result=False,
            )
            results += [list(r.sequences_ids[0][:n]) for r, n in zip(generated, outs)]
        return results

    return generate


def convert(hf_dir: str, out: str, dtype: str) -> None:
    # Weights stay float32; int8 is chosen at load time (compute_type), so one conversion serves all.
    subprocess.run([bin_path("ct2-transformers-converter"), "--model", hf_dir, "--output_dir", out], check=True)


if __name__ == "__main__":
    raise SystemExit(main(probe, load, convert))
