"""llama.cpp runner of benchmarks/quantized.py (protocol: _child.py), in the llama-cpp-python peer venv.

One stream: llama-cpp-python's ``Llama`` (the model llama.cpp mmaps, its default f16 KV cache),
prompt through ``Llama.eval``, then one ``eval`` per new token, greedy = argmax of the last logits,
EOS never checked: exactly n tokens. Timed around the calls, so decode_s is llama.cpp's per-token
decode plus a few microseconds of ctypes.

Many streams (``batch``), for when llama.cpp's own ``llama-server`` is not built: a second context
on the same loaded model (weights shared, not mapped twice) with one sequence per stream in a
unified KV cache, driven through the low-level batched ``llama_decode`` as llama.cpp's ``batched``
example and benchmarks/peers/run_llamacpp.py do: every step carries one token per running stream;
prompts enter while the batch has room.

Options (JSON): ``n_ctx`` of the single-stream context (default 512), ``kv_tokens`` / ``max_seqs``
of the batched one (the largest concurrent load of the run).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _child import main  # noqa: E402

N_BATCH = 2048  # tokens per llama_decode call; llama.cpp splits it into n_ubatch pieces


def _set(params: Any, **values: Any) -> None:
    """Set the fields this build's struct has (llama.cpp renames and adds fields between releases)."""
    fields = {name for name, _ in type(params)._fields_}
    for name, value in values.items():
        if name in fields:
            setattr(params, name, value)


class LlamaCppRunner:
    def __init__(self, model: str, threads: int, options: dict[str, Any]) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        self.threads = threads
        self.options = options
        self.llm = lc.Llama(model_path=model, n_ctx=int(options.get("n_ctx", 512)), n_batch=512, n_threads=threads,
                            n_threads_batch=threads, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.batched: tuple[Any, Any] | None = None  # (context, batch), made on first use

    def _last_logits(self, ctx: Any, index: int = -1) -> Any:
        return self.np.ctypeslib.as_array(self.lc.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))

    def single(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(self._last_logits(llm.ctx).argmax())
        first = time.perf_counter()
        out = [token]
        while len(out) < max_tokens:
            llm.eval([token])
            token = int(self._last_logits(llm.ctx).argmax())
            out.append(token)
        end = time.perf_counter()
        return {"prefill_s": first - start, "decode_s": end - first, "tokens": len(out)}

    def _batched_context(self) -> tuple[Any, Any]:
        if self.batched is None:
            lc = self.lc
            max_seqs = int(self.options.get("max_seqs", 64))
            cells = int(self.options.get("kv_tokens", 64 * 256))
            params = lc.llama_context_default_params()
            _set(params, n_ctx=(cells + 255) // 256 * 256, n_batch=N_BATCH, n_ubatch=512, n_seq_max=max_seqs,
                 n_threads=self.threads, n_threads_batch=self.threads, kv_unified=True, no_perf=True)
            make = getattr(lc, "llama_init_from_model", None) or lc.llama_new_context_with_model
            ctx = make(self.llm.model, params)
            if not ctx:
                raise RuntimeError("llama.cpp could not create the batched context")
            self.batched = (ctx, lc.llama_batch_init(N_BATCH + max_seqs, 0, 1))
        return self.batched

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        lc = self.lc
        ctx, batch = self._batched_context()
        memory = lc.llama_get_memory(ctx)
        lc.llama_memory_clear(memory, True)
        start = time.perf_counter()
        produced = [0] * len(prompts)
        running: dict[int, int] = {}  # seq -> the token to feed next
        waiting = list(range(len(prompts)))
        while running or waiting:
            slots: list[tuple[int, int, int, bool]] = []  # (token, position, seq, wants logits)
            for seq, token in running.items():
                slots.append((token, len(prompts[seq]) + produced[seq] - 1, seq, True))
            while waiting and len(slots) + len(prompts[waiting[0]]) <= N_BATCH:
                seq = waiting.pop(0)
                n = len(prompts[seq])
                slots += [(t, pos, seq, pos == n - 1) for pos, t in enumerate(prompts[seq])]
            if not slots:
                raise RuntimeError(f"a prompt longer than {N_BATCH} tokens")
            sample_at = []
            for i, (token, pos, seq, want) in enumerate(slots):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, want
                if want:
                    sample_at.append((i, seq))
            batch.n_tokens = len(slots)
            status = lc.llama_decode(ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            for i, seq in sample_at:
                token = int(self._last_logits(ctx, i).argmax())
                produced[seq] += 1
                if produced[seq] >= max_tokens:
                    running.pop(seq, None)
                    lc.llama_memory_seq_rm(memory, seq, -1, -1)
                else:
                    running[seq] = token
        return {"elapsed": time.perf_counter() - start, "tokens": sum(produced)}

    def memory(self) -> dict[str, Any]:
        return {}


def preload() -> None:
    import llama_cpp  # noqa: F401  (loads libllama: not the model's load time)


if __name__ == "__main__":
    raise SystemExit(main(LlamaCppRunner, preload))
