"""Size of the per-step control message of tensor parallelism, against batch size and context length.

Each step rank 0 broadcasts one message to every worker (pagedllm/executor/messages.py): per
sequence the tokens computed this step, the start position, its block table and a sample count,
plus the block moves. Whole block tables grow with the context (one id per 16 tokens), so they are
sent whole only when a sequence (re)enters the batch ("first"), and afterwards as the change since
the last step ("steady": usually nothing, one new id every 16 tokens). The paper's concern is that
this stays small next to the activations all-reduced every layer; this script prints both, and the
size a naive pickle of the engine's StepInput (prompts, outputs, sampling settings) would have.

    .venv/bin/python benchmarks/tp_message_size.py
    .venv/bin/python benchmarks/tp_message_size.py --time-broadcast   # also time the broadcast over gloo, 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagedllm.executor.messages import FRAME_BYTES, StepEncoder, encode_step  # noqa: E402
from pagedllm.sampling import SamplingRow  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.worker.model_runner import SeqStepInput, StepInput  # noqa: E402


def make_step(batch_size: int, context_len: int, is_prefill: bool, block_size: int, num_blocks: int) -> StepInput:
    rng = random.Random(batch_size * 1_000_003 + context_len)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=512)
    seqs = []
    for seq_id in range(batch_size):
        prompt = [rng.randrange(100, 50_000) for _ in range(context_len if is_prefill else context_len // 2)]
        output = [] if is_prefill else [rng.randrange(100, 50_000) for _ in range(context_len - len(prompt))]
        table = [rng.randrange(num_blocks) for _ in range(-(-context_len // block_size))]
        tokens = prompt if is_prefill else output[-1:]
        seqs.append(
            SeqStepInput(
                seq_id=seq_id,
                token_ids=tokens,
                start_pos=0 if is_prefill else context_len - 1,
                block_table=table,
                sampling_row=SamplingRow(params, prompt, output, None),
            )
        )
    return StepInput(seqs=seqs)


def naive_size(step: StepInput) -> int:
    """What pickling the engine's whole StepInput would send (sampling rows included, generators left out)."""
    return len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))


def time_broadcasts(sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of broadcast_bytes for each message size, 2 ranks over gloo on this machine."""
    import torch.multiprocessing as mp

    port = 29_000 + os.getpid() % 1000
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_bench_rank, args=(rank, port, sizes, repeats, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()
    return result


def _bench_rank(rank: int, port: int, sizes: list[int], repeats: int, queue) -> None:
    import statistics

    import torch

    from pagedllm.executor.messages import broadcast_bytes
    from pagedllm.layers.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    state = init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60.0)
    out: dict[int, float] = {}
    for size in sizes:
        payload = os.urandom(size) if rank == 0 else None
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            broadcast_bytes(state, payload)
            times.append(time.perf_counter() - start)
        out[size] = statistics.median(times)
    if rank == 0:
        queue.put(out)
    destroy_tensor_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[128, 512, 2048, 8192, 32768])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=100_000, help="pool size: block ids are drawn below it")
    parser.add_argument("--hidden-size", type=int, default=4096, help="for the all-reduce size comparison")
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--time-broadcast", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows = []
    print(f"decode steps (1 new token per sequence), block size {args.block_size}; sizes in bytes")
    print(f"{'batch':>6} {'context':>8} {'first':>10} {'steady':>8} {'steady/seq':>10} {'naive':>11} "
          f"{'all-reduce/step':>16}")
    for batch in args.batch_sizes:
        for context in args.context_lens:
            step = make_step(batch, context, False, args.block_size, args.num_blocks)
            size = len(encode_step(step))
            encoder = StepEncoder()
            encoder.encode(step)
            steady = len(encoder.encode(step))  # the next decode step: same tables
            naive = naive_size(step)
            # Two all-reduces per layer of [tokens, hidden] float16/bfloat16 activations.
            reduce_bytes = 2 * args.num_layers * batch * args.hidden_size * 2
            rows.append(dict(kind="decode", batch=batch, context=context, bytes=size, steady_bytes=steady,
                             naive_bytes=naive, all_reduce_bytes=reduce_bytes))
            print(f"{batch:>6} {context:>8} {size:>10} {steady:>8} {steady / batch:>10.1f} {naive:>11} "
                  f"{reduce_bytes:>16}")
    print("\nprefill steps (whole prompt computed; the token ids dominate)")
    print(f"{'batch':>6} {'context':>8} {'message':>10} {'per seq':>8} {'naive':>11}")
    for batch in (1, 8):
        for context in args.context_lens[:4]:
            step = make_step(batch, context, True, args.block_size, args.num_blocks)
            size = len(encode_step(step))
            naive = naive_size(step)
            rows.append(dict(kind="prefill", batch=batch, context=context, bytes=size, naive_bytes=naive))
            print(f"{batch:>6} {context:>8} {size:>10} {size / batch:>8.0f} {naive:>11}")
    print(f"\nmessages up to {FRAME_BYTES} bytes take one broadcast; larger ones a second for the rest")

    timings: dict[int, float] = {}
    if args.time_broadcast:
        sizes = sorted({100, 1_000, 10_000, 100_000, 1_000_000, 4_000_000})
        timings = time_broadcasts(sizes, args.repeats)
        print("\nbroadcast time over gloo, 2 ranks on this machine (median)")
        for size, seconds in timings.items():
            print(f"{size:>10} bytes  {seconds * 1e3:8.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "broadcast_s": timings}, f, indent=2)


if __name__ == "__main__":
    main()
