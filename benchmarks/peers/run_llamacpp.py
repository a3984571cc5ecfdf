"""llama.cpp peer of benchmarks/peers.py (a venv with ``llama-cpp-python``; see _protocol.py).

``llama_cpp.server`` serves one request at a time and takes text only, so this drives the
low-level API (ctypes) as llama.cpp's own ``batched`` example does: every sequence gets its own
``seq_id`` in one unified KV cache, each ``llama_decode`` carries one token per running sequence
plus prompt tokens while the batch has room (continuous batching: all requests arrive at once),
greedy = argmax of the logits (EOS ignored: never checked, never banned), a finished sequence's
KV cells are freed at once. float32 = the f32 GGUF and an f32 KV cache (llama.cpp's default f16 KV
is what made its ids differ in PEERS.md); bfloat16 = the bf16 GGUF and a bf16 KV cache.

Conversion: ``convert_hf_to_gguf.py`` of the llama.cpp vendored in the llama-cpp-python sdist
(setup_peers.sh links it as VENV/llama.cpp; LLAMA_CPP_DIR overrides).
"""

from __future__ import annotations

import os
import subprocess
import sys

from _protocol import main

BATCH_TOKENS = 2048  # tokens per llama_decode call (n_batch); llama.cpp splits it into n_ubatch pieces


def probe() -> dict:
    import llama_cpp

    return {"engine": "llamacpp", "version": llama_cpp.__version__}


def _set(params, **values) -> None:
    """Set the fields this build's struct has (llama.cpp renames and adds fields between releases)."""
    fields = {name for name, _ in type(params)._fields_}
    for name, value in values.items():
        if name in fields:
            setattr(params, name, value)


def load(model: str, dtype: str, threads: int, options: dict, workloads: dict):
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    load_model = getattr(lc, "llama_model_load_from_file", None) or lc.llama_load_model_from_file
    llama_model = load_model(model.encode(), lc.llama_model_default_params())
    if not llama_model:
        raise RuntimeError(f"llama.cpp could not load {model}")
    if hasattr(lc, "llama_vocab_n_tokens"):
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llama_model))
    else:
        n_vocab = lc.llama_n_vocab(llama_model)

    # One unified KV cache big enough for every request of the largest workload at once.
    max_seqs = max(len(w["prompts"]) for w in workloads.values())
    cells = max(sum(len(p) + n for p, n in zip(w["prompts"], w["max_tokens"])) for w in workloads.values())
    kv_type = lc.GGML_TYPE_F32 if dtype == "float32" else getattr(lc, "GGML_TYPE_BF16", 30)
    params = lc.llama_context_default_params()
    _set(params, n_ctx=(cells + 255) // 256 * 256, n_batch=BATCH_TOKENS, n_ubatch=512, n_seq_max=max_seqs,
         n_threads=threads, n_threads_batch=threads, type_k=kv_type, type_v=kv_type, kv_unified=True,
         no_perf=True, embeddings=False)
    make_context = getattr(lc, "llama_init_from_model", None) or lc.llama_new_context_with_model
    ctx = make_context(llama_model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create the context (KV cache too large? n_seq_max over its limit?)")
    batch = lc.llama_batch_init(BATCH_TOKENS + max_seqs, 0, 1)

    def clear_all() -> None:
        if hasattr(lc, "llama_get_memory"):
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        elif hasattr(lc, "llama_kv_self_clear"):
            lc.llama_kv_self_clear(ctx)
        else:
            lc.llama_kv_cache_clear(ctx)

    def free_sequence(seq: int) -> None:
        if hasattr(lc, "llama_get_memory"):
            lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), seq, -1, -1)
        elif hasattr(lc, "llama_kv_self_seq_rm"):
            lc.llama_kv_self_seq_rm(ctx, seq, -1, -1)
        else:
            lc.llama_kv_cache_seq_rm(ctx, seq, -1, -1)

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        clear_all()
        outputs: list[list[int]] = [[] for _ in prompts]
        running: dict[int, int] = {}  # seq -> the token to feed next
        waiting = list(range(len(prompts)))  # arrival order
        prefilled = 0  # prompt tokens of waiting[0] already decoded (a prompt may span batches)
        while running or waiting:
            slots: list[tuple[int, int, int, bool]] = []  # (token, position, seq, wants logits)
            for seq, token in running.items():
                slots.append((token, len(prompts[seq]) + len(outputs[seq]) - 1, seq, True))
            while waiting and len(slots) < BATCH_TOKENS:
                seq = waiting[0]
                prompt = prompts[seq]
                take = min(len(prompt) - prefilled, BATCH_TOKENS - len(slots))
                slots += [(prompt[pos], pos, seq, pos == len(prompt) - 1) for pos in range(prefilled, prefilled + take)]
                prefilled += take
                if prefilled == len(prompt):
                    waiting.pop(0)
                    prefilled = 0
            sample_at: list[tuple[int, int]] = []  # (batch index, seq) whose logits pick the next token
            for n, (token, pos, seq, want_logits) in enumerate(slots):
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = want_logits
                if want_logits:
                    sample_at.append((n, seq))
            batch.n_tokens = len(slots)
            status = lc.llama_decode(ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            for index, seq in sample_at:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(n_vocab,))
                token = int(logits.argmax())
                outputs[seq].append(token)
                if len(outputs[seq]) >= max_tokens[seq]:
                    running.pop(seq, None)
                    free_sequence(seq)
                else:
                    running[seq] = token
        return outputs

    return generate


def convert(hf_dir: str, out: str, dtype: str) -> None:
    llama_cpp_dir = os.environ.get("LLAMA_CPP_DIR") or os.path.join(
        os.path.dirname(os.path.dirname(sys.executable)), "llama.cpp")
    script = os.path.join(llama_cpp_dir, "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        raise SystemExit(f"{script} not found: run benchmarks/setup_peers.sh DIR llamacpp, or set LLAMA_CPP_DIR")
    outtype = "bf16" if dtype == "bfloat16" else "f32"
    subprocess.run([sys.executable, script, hf_dir, "--outfile", out, "--outtype", outtype], check=True)


if __name__ == "__main__":
    raise SystemExit(main(probe, load, convert))
