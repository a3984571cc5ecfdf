"""The memory-bandwidth roofline of single-stream decode (issue 11: know the distance).

One decode step of one stream reads every weight the forward pass uses once, so its speed is
bounded by read bandwidth / bytes of weights per token. The bandwidth is measured here as the
median rate of ``torch.sum`` over a float32 array far larger than the caches, at the thread count
the engines use. The weights per token are the packed GGUF tensors' bytes minus the token
embedding (one row is read per token) — but a tied embedding is also the LM head, read whole.
KV-cache reads are left out: at a 256-token context they are <1% of a 1B model's weights.

    .venv/bin/python benchmarks/bandwidth.py [--gib 1] [--threads 2] [MODEL.gguf ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def measure_read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes/s that ``threads`` threads stream through a ``gib``-GiB float32 array (median of repeats)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)  # ones: every page really allocated
        data.sum()  # fault in, warm up the thread pool
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            rates.append(data.numel() * 4 / (time.perf_counter() - start))
        return statistics.median(rates)
    finally:
        torch.set_num_threads(previous)


def weight_bytes_per_token(gguf_path: str) -> int:
    """Bytes of weights one decode step reads: every tensor but the input embedding, which counts
    only when it doubles as the LM head (no ``output.weight``)."""
    from pagedllm.models.gguf_loader import read_gguf

    tensors = read_gguf(gguf_path).tensors
    tied = "output.weight" not in tensors
    return sum(t.nbytes for name, t in tensors.items() if name != "token_embd.weight" or tied)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    rate = measure_read_bandwidth(args.threads, args.gib)
    print(f"read bandwidth ({args.threads} threads, {args.gib} GiB array): {rate / 1e9:.1f} GB/s")
    for path in args.models:
        per_token = weight_bytes_per_token(path)
        print(f"{os.path.basename(path)}: {per_token / 1e6:.0f} MB of weights per token -> roofline "
              f"{rate / per_token:.1f} tok/s")


if __name__ == "__main__":
    main()
