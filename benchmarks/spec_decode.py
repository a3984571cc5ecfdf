"""Speculative decoding on input-grounded work: single-stream output tok/s with and without, one run.

The prompts (benchmarks/data/spec_decode_prompts.jsonl: edit a code file, repeat a text with one
change, quote sentences, extract fields; all real text from this repository) go through the
embedded default model's chat template and decode greedily, one request at a time, on engines
without speculation, with ``ngram`` and with ``suffix``, interleaved over --repeats. Outputs must
be identical token for token; figures are the median over repeats of total output tokens / total
time, and the acceptance counters.

    .venv/bin/python benchmarks/spec_decode.py
    .venv/bin/python benchmarks/spec_decode.py --streams 16     # all prompts at once, 16 in flight
    .venv/bin/python benchmarks/spec_decode.py --methods off draft-self   # the model as its own draft

With ``--streams N`` the prompts run N at a time (cycled to N x 2 requests): the load case, where
``disable_by_batch_size`` switches speculation off and the speculating engine must not be slower.

With ``--llamacpp`` the same prompt token ids also go, one at a time, to llama.cpp's ``llama-server``
(benchmarks/quant_engines.py's ``LlamaServerEngine``; ``-np 1``, ``--threads`` threads like pagedllm's)
on the same GGUF, once per --llamacpp-specs setting (``--spec-type none`` and n-gram types), interleaved
with pagedllm's engines. Greedy (temperature 0, top_k 1), ``cache_prompt`` false, ``n_predict`` =
max_tokens. EOS: both engines run with ignore_eos (pagedllm ``SamplingParams(ignore_eos=True)``,
llama-server ``"ignore_eos": true``), so every request produces exactly max_tokens tokens on both and
tok/s counts the same tokens; pagedllm's own figures in this mode are therefore on ignore_eos too.
llama.cpp's outputs are not required to equal pagedllm's (float32 torch vs ggml kernels may diverge):
the report gives each llama.cpp setting's share of requests identical to pagedllm's and the mean common
prefix, and the same against llama.cpp without speculation (its verification batches are not bit-exact
with one-token decoding, so its speculative outputs can drift from its own greedy ones).
llama.cpp's acceptance is its /completion ``timings.draft_n_accepted / draft_n``. ``ngram-mod`` keeps
one hash pool for the server's whole life, so its server is restarted before every repeat (otherwise
a repeat would draft from the previous repeat's outputs).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/spec_decode.py --repeats 2 --llamacpp \
        --json benchmarks/results/spec_decode_peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.spec_decode.speculator import make_proposer  # noqa: E402

PROMPTS = os.path.join(HERE, "data", "spec_decode_prompts.jsonl")
CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 16},
    # The default model as its own draft (its path filled in at start-up): a mechanics check of the
    # draft-model path, whose drafts the target should accept nearly always; never faster (the
    # draft costs as much as the target).
    "draft-self": {"method": "draft_model", "model": None, "num_speculative_tokens": 5},
}
DEFAULT_METHODS = ["off", "ngram", "suffix"]


def load_prompts(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# llama-server n-gram speculation, named as in the table; "none" is its baseline. ngram-simple with a
# 4-gram key and a 5-token draft is prompt lookup with pagedllm's ngram config (k=5, n 4; llama.cpp has
# no fallback to shorter n-grams). ngram-simple's draft length is its size-m (--spec-draft-n-max is for
# draft models).
LLAMACPP_SPECS = {
    "none": ["--spec-type", "none"],
    "ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                     "--spec-ngram-simple-size-m", "5", "--spec-draft-n-max", "5"],
    "ngram-mod": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "16", "--spec-ngram-mod-n-min", "2",
                  "--spec-ngram-mod-n-max", "16"],
}
LLAMA_SERVER = "/work/peers/llamacpp/bin/llama-server"


class LlamaCpp:
    """One llama-server (LlamaServerEngine, -np 1) with one speculation setting, single stream."""

    def __init__(self, spec: str, binary: str, model: str, threads: int, ctx: int, log_dir: str) -> None:
        self.spec, self.binary, self.model, self.threads, self.ctx = spec, binary, model, threads, ctx
        self.log_path = os.path.join(log_dir, f"llama-server-{spec}.log")
        self.drafted = self.accepted = self.steps = 0
        self.server = None
        self.start()

    def start(self) -> None:
        from quant_engines import LlamaServerEngine
        if self.server is not None:
            self.server.close()
        self.server = LlamaServerEngine(self.binary, self.model, self.threads, 1, self.ctx, self.log_path,
                                        extra_args=LLAMACPP_SPECS[self.spec])

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "cache_prompt": False,
                "temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "stream": False, "return_tokens": True}
        request = urllib.request.Request(self.server.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as r:
            return json.loads(r.read())

    def run(self, requests: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
        if self.spec == "ngram-mod":
            self.start()  # a fresh hash pool each repeat
            self.complete(requests[0][0][:16], 4)  # warm-up on the template's head only
        outputs = []
        start = time.perf_counter()
        for ids, n in requests:
            reply = self.complete(ids, n)
            outputs.append(list(reply["tokens"]))
            self.drafted += int(reply["timings"].get("draft_n", 0))
            self.accepted += int(reply["timings"].get("draft_n_accepted", 0))
        return time.perf_counter() - start, outputs

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_once(llm: LLM, requests: list[tuple[list[int], int]], streams: int,
             ignore_eos: bool = False) -> tuple[float, list[list[int]]]:
    """(seconds, outputs) for the requests, ``streams`` in flight at a time.

    A speculating engine starts each run with a fresh proposer: the suffix proposer's cache of
    finished outputs would otherwise hold the previous repeat's answers to these very prompts."""
    speculator = llm.llm_engine.scheduler.speculator
    if speculator is not None:
        speculator.proposer = make_proposer(speculator.config)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(requests), streams):
        batch = requests[first : first + streams]
        prompts = [{"prompt_token_ids": ids} for ids, _ in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for _, n in batch]
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default=PROMPTS)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=1, help="requests in flight at once (1: single stream)")
    parser.add_argument("--disable-by-batch-size", type=int, default=4,
                        help="speculation off from this many running requests on (the load case)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None)
    parser.add_argument("--llamacpp", action="store_true",
                        help="also run llama.cpp's llama-server on the same GGUF and prompt ids (ignore_eos on both)")
    parser.add_argument("--llamacpp-specs", nargs="+", default=list(LLAMACPP_SPECS), choices=list(LLAMACPP_SPECS))
    parser.add_argument("--llama-server", default=LLAMA_SERVER)
    parser.add_argument("--threads", type=int, default=None,
                        help="pagedllm num_threads and llama-server -t / -tb (default: the CPU count, both)")
    args = parser.parse_args()

    engines = {}
    for name in args.methods:
        config = CONFIGS[name]
        if config is not None:
            config = dict(config, disable_by_batch_size=args.disable_by_batch_size)
            if config["method"] == "draft_model" and config["model"] is None:
                from pagedllm.models.loader import resolve_model_path
                config["model"] = resolve_model_path(None)
        engines[name] = LLM(dtype=args.dtype, speculative_config=config, num_threads=args.threads)
    tokenizer_llm = next(iter(engines.values()))
    requests = [(tokenizer_llm.render_chat(p["messages"])[1], p["max_tokens"]) for p in load_prompts(args.prompts)]
    if args.streams > 1:
        requests = (requests * (2 * args.streams // len(requests) + 1))[: 2 * args.streams]

    ignore_eos = args.llamacpp
    peers: dict[str, LlamaCpp] = {}
    if args.llamacpp:
        if args.streams != 1:
            raise SystemExit("--llamacpp runs single stream only")
        from pagedllm.models.loader import resolve_model_path
        sys.path.insert(0, HERE)
        gguf = resolve_model_path(None)
        ctx = max(len(ids) + n for ids, n in requests) + 64
        log_dir = tempfile.mkdtemp(prefix="spec_decode_llamacpp_")
        print(f"llama-server logs: {log_dir}")
        threads = args.threads or os.cpu_count() or 1
        for spec in args.llamacpp_specs:
            peers[spec] = LlamaCpp(spec, args.llama_server, gguf, threads, ctx, log_dir)

    times: dict[str, list[float]] = {name: [] for name in engines}
    peer_times: dict[str, list[float]] = {spec: [] for spec in peers}
    peer_outputs: dict[str, list[list[int]]] = {}
    reference: list[list[int]] | None = None
    num_tokens = 0
    run_once(engines[args.methods[0]], requests[:1], 1, ignore_eos)  # warm-up: kernels, thread pool
    for peer in peers.values():
        peer.run(requests[:1])
        peer.drafted = peer.accepted = 0
    try:
        for _ in range(args.repeats):
            for name, llm in engines.items():
                seconds, outputs = run_once(llm, requests, args.streams, ignore_eos)
                times[name].append(seconds)
                print(f"  pagedllm {name}: {seconds:.1f} s", file=sys.stderr, flush=True)
                if reference is None:
                    reference, num_tokens = outputs, sum(map(len, outputs))
                elif outputs != reference:
                    raise SystemExit(f"{name}: output differs from {args.methods[0]}'s")
            for spec, peer in peers.items():
                seconds, outputs = peer.run(requests)
                peer_times[spec].append(seconds)
                print(f"  llama.cpp {spec}: {seconds:.1f} s", file=sys.stderr, flush=True)
                if peer_outputs.setdefault(spec, outputs) != outputs:
                    print(f"note: llama.cpp {spec}: output differs between repeats")
    finally:
        for peer in peers.values():
            peer.close()

    base = statistics.median(times[args.methods[0]])
    rows = []
    print(f"{len(requests)} requests, {num_tokens} output tokens per run, {args.streams} stream(s), "
          f"medians of {args.repeats}; outputs identical across engines")
    print(f"{'method':8} {'tok/s':>8} {'vs ' + args.methods[0]:>8} {'drafts':>7} {'proposed':>9} {'accepted':>9} "
          f"{'rate':>6} {'tokens/step':>11}")
    for name, llm in engines.items():
        median = statistics.median(times[name])
        stats = llm.llm_engine.get_stats()
        drafts = stats.get("spec_decode_num_drafts", 0)
        proposed = stats.get("spec_decode_num_draft_tokens", 0)
        accepted = stats.get("spec_decode_num_accepted_tokens", 0)
        rate = accepted / proposed if proposed else 0.0
        per_step = (accepted + drafts) / drafts if drafts else 1.0
        row = dict(method=name, tok_s=num_tokens / median, speedup=base / median, drafts=drafts, proposed=proposed,
                   accepted=accepted, acceptance=rate, tokens_per_verification=per_step,
                   accepted_per_pos=stats.get("spec_decode_num_accepted_tokens_per_pos"))
        rows.append(row)
        print(f"{name:8} {row['tok_s']:8.1f} {row['speedup']:7.2f}x {drafts:7d} {proposed:9d} {accepted:9d} "
              f"{rate:6.2f} {per_step:11.2f}")
    peer_rows = []
    if peers:
        def agree(outputs: list[list[int]], other: list[list[int]]) -> dict:
            prefixes = [common_prefix(a, b) for a, b in zip(outputs, other)]
            return dict(identical=sum(a == b for a, b in zip(outputs, other)),
                        mean_prefix=statistics.mean(prefixes), prefixes=prefixes)

        base_spec = args.llamacpp_specs[0]
        mean_len = statistics.mean(map(len, reference))
        print(f"\nllama.cpp vs pagedllm ({args.methods[0]}) outputs, greedy, ignore_eos, same GGUF, "
              f"{len(requests)} requests of {mean_len:.1f} tokens on average:")
        peer_base = statistics.median(peer_times[base_spec])
        for spec, peer in peers.items():
            outputs = peer_outputs[spec]
            median = statistics.median(peer_times[spec])
            rate = peer.accepted / peer.drafted if peer.drafted else None
            vs_paged, vs_none = agree(outputs, reference), agree(outputs, peer_outputs[base_spec])
            print(f"  llama.cpp {spec:13}: {vs_paged['identical']}/{len(requests)} identical to pagedllm, mean "
                  f"common prefix {vs_paged['mean_prefix']:.1f}; vs llama.cpp {base_spec}: "
                  f"{vs_none['identical']}/{len(requests)} identical, mean common prefix {vs_none['mean_prefix']:.1f}")
            peer_rows.append(dict(engine="llama.cpp", spec=spec, tok_s=sum(map(len, outputs)) / median,
                                  speedup=peer_base / median, proposed=peer.drafted, accepted=peer.accepted,
                                  acceptance=rate, server_args=LLAMACPP_SPECS[spec], vs_pagedllm=vs_paged,
                                  vs_llamacpp_none=vs_none, seconds=peer_times[spec]))
        print(f"\n{'engine':10} {'speculation':13} {'tok/s':>8} {'vs own off':>10} {'proposed':>9} {'accepted':>9} "
              f"{'acceptance':>10}")
        table = [dict(engine="pagedllm", spec=r["method"], tok_s=r["tok_s"], speedup=r["speedup"],
                      proposed=r["proposed"], accepted=r["accepted"],
                      acceptance=r["acceptance"] if r["proposed"] else None) for r in rows] + peer_rows
        for r in table:
            rate = f"{r['acceptance']:10.2f}" if r["acceptance"] is not None else f"{'-':>10}"
            print(f"{r['engine']:10} {r['spec']:13} {r['tok_s']:8.1f} {r['speedup']:9.2f}x {r['proposed']:9d} "
                  f"{r['accepted']:9d} {rate}")
        rows_peer = dict(llamacpp=peer_rows, llama_server=args.llama_server,
                         threads=threads, ignore_eos=True)
    else:
        rows_peer = {}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(streams=args.streams, repeats=args.repeats, requests=len(requests),
                           output_tokens=num_tokens, rows=rows, **rows_peer), f, indent=1)


if __name__ == "__main__":
    main()
