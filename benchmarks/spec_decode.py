"""Speculative decoding by prompt category: output tok/s with and without, acceptance, one run.

The prompts (benchmarks/data/spec_decode_prompts.jsonl, natural-language chat requests written for
this benchmark, 8 per ``category``) fall in five categories, from the case lookup speculation wins
most to the one it wins least:

- ``copy``: repeat a given paragraph verbatim (the output is in the prompt: the favourable case,
  reported on its own, never the headline);
- ``edit``: rewrite a given text with a change (tense, grammar, a renamed entity, units, a list);
- ``summary``: summarize a given passage in a few sentences;
- ``qa``: answer a question about a given passage, or a closed-book question;
- ``chat``: open requests with no input text (advice, a poem, a story).

They go through the embedded default model's chat template and decode greedily (EOS stops them) on
engines without speculation (``off``), with ``ngram`` and with ``suffix``, interleaved over --repeats
in a rotated order. Single stream (the default): one request at a time, each category its own run,
so every category has its own figures: output tok/s (the engine's own tokens / time, median over
repeats), the speedup over ``off``, drafts (verifications with at least one draft token), draft
tokens proposed and accepted, the acceptance rate, and the outputs identical to ``off``'s. Rows
"non-copy" (edit, summary, qa, chat: the headline) and "all" add the categories up.

    .venv/bin/python benchmarks/spec_decode.py --json benchmarks/results/spec_decode.json
    .venv/bin/python benchmarks/spec_decode.py --streams 16 --categories edit summary qa chat \
        --json benchmarks/results/spec_decode_16_streams.json   # the load case
    .venv/bin/python benchmarks/spec_decode.py --methods off draft-self   # the model as its own draft

With ``--streams N`` the selected categories' prompts are submitted at once to engines of
``max_num_seqs`` N (at most N decode together, continuous batching), each prompt once (a repeated
prompt would let ``suffix`` draft from its twin's finished output). ``--disable-by-batch-size``
(default 0: never) is the running-request count from which speculation switches off; at 0 it stays
on under load, so the loaded figure measures speculation (its draft counts are printed), not its
switch. A request still stops speculating on its own once its acceptance falls under
``--min-request-acceptance`` (pagedllm's default 0.1, after 32 draft tokens): part of the method.

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
a repeat would draft from the previous repeat's outputs). llama.cpp runs all selected prompts as one
run per repeat (no per-category split).

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
from pagedllm.core.speculator import make_proposer  # noqa: E402

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


def spec_counters(llm: LLM) -> dict:
    stats = llm.llm_engine.get_stats()
    return {"drafts": stats.get("spec_decode_num_drafts", 0), "proposed": stats.get("spec_decode_num_draft_tokens", 0),
            "accepted": stats.get("spec_decode_num_accepted_tokens", 0),
            "switched_off": stats.get("spec_decode_requests_switched_off", 0)}


def run_once(llm: LLM, requests: list[tuple[list[int], int]], streams: int,
             ignore_eos: bool = False) -> tuple[float, list[list[int]], dict]:
    """(seconds, outputs, speculation counters of this run) for the requests.

    One stream: one request at a time. More: all submitted at once, the engine's max_num_seqs
    deciding how many run together. A speculating engine starts each run with a fresh proposer:
    the suffix proposer's cache of finished outputs would otherwise hold the previous repeat's
    answers to these very prompts."""
    speculator = llm.llm_engine.scheduler.speculator
    if speculator is not None:
        speculator.proposer = make_proposer(speculator.config)
    before = spec_counters(llm)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(requests), 1 if streams == 1 else len(requests)):
        batch = requests[first : first + (1 if streams == 1 else len(requests))]
        prompts = [{"prompt_token_ids": ids} for ids, _ in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for _, n in batch]
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    after = spec_counters(llm)
    return seconds, outputs, {key: after[key] - before[key] for key in after}


def figures(name: str, label: str, times: list[float], tokens: int, counters: dict, base: dict | None,
            identical: int, num_requests: int) -> dict:
    """One row: median tok/s over repeats, its ratio to ``off``'s, the counters summed over repeats."""
    tok_s = tokens / statistics.median(times)
    drafts, proposed, accepted = counters["drafts"], counters["proposed"], counters["accepted"]
    return dict(method=name, category=label, requests=num_requests, output_tokens=tokens, tok_s=tok_s,
                speedup=tok_s / base["tok_s"] if base else 1.0, seconds=times, drafts=drafts, proposed=proposed,
                accepted=accepted, acceptance=accepted / proposed if proposed else None,
                tokens_per_verification=(accepted + drafts) / drafts if drafts else None,
                requests_switched_off=counters["switched_off"], identical_to_off=identical)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default=PROMPTS)
    parser.add_argument("--categories", nargs="+", default=None, help="default: every category in the file")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=1, help="requests in flight at once (1: single stream)")
    parser.add_argument("--disable-by-batch-size", type=int, default=0,
                        help="speculation off from this many running requests on (0: never, the default)")
    parser.add_argument("--min-request-acceptance", type=float, default=None,
                        help="a request stops speculating under this acceptance (default: pagedllm's, 0.1)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default=None)
    parser.add_argument("--llamacpp", action="store_true",
                        help="also run llama.cpp's llama-server on the same GGUF and prompt ids (ignore_eos on both)")
    parser.add_argument("--llamacpp-specs", nargs="+", default=list(LLAMACPP_SPECS), choices=list(LLAMACPP_SPECS))
    parser.add_argument("--llama-server", default=LLAMA_SERVER)
    parser.add_argument("--threads", type=int, default=None,
                        help="pagedllm num_threads and llama-server -t / -tb (default: the CPU count, both)")
    args = parser.parse_args()
    if args.methods[0] != "off":
        raise SystemExit("the first method is the baseline: start --methods with off")

    engines = {}
    for name in args.methods:
        config = CONFIGS[name]
        if config is not None:
            config = dict(config, disable_by_batch_size=args.disable_by_batch_size or None)
            if args.min_request_acceptance is not None:
                config["min_request_acceptance"] = args.min_request_acceptance
            if config["method"] == "draft_model" and config["model"] is None:
                from pagedllm.models.loader import resolve_model_path
                config["model"] = resolve_model_path(None)
        engines[name] = LLM(dtype=args.dtype, speculative_config=config, num_threads=args.threads,
                            max_num_seqs=max(args.streams, 1))
    tokenizer_llm = next(iter(engines.values()))
    prompts = load_prompts(args.prompts)
    categories = args.categories or list(dict.fromkeys(p["category"] for p in prompts))
    by_category = {c: [(tokenizer_llm.render_chat(p["messages"])[1], p["max_tokens"]) for p in prompts
                       if p["category"] == c] for c in categories}
    if not all(by_category.values()):
        raise SystemExit(f"no prompts for {[c for c, r in by_category.items() if not r]} in {args.prompts}")
    # Single stream: one run per category. Loaded: the selected categories' prompts as one run.
    groups = by_category if args.streams == 1 else {"+".join(categories): sum(by_category.values(), [])}
    all_requests = sum(by_category.values(), [])
    if args.streams > 1 and len(all_requests) < 2 * args.streams:
        print(f"note: {len(all_requests)} requests for {args.streams} streams: the batch thins out as they finish")

    ignore_eos = args.llamacpp
    peers: dict[str, LlamaCpp] = {}
    if args.llamacpp:
        if args.streams != 1:
            raise SystemExit("--llamacpp runs single stream only")
        from pagedllm.models.loader import resolve_model_path
        sys.path.insert(0, HERE)
        gguf = resolve_model_path(None)
        ctx = max(len(ids) + n for ids, n in all_requests) + 64
        log_dir = tempfile.mkdtemp(prefix="spec_decode_llamacpp_")
        print(f"llama-server logs: {log_dir}")
        threads = args.threads or os.cpu_count() or 1
        for spec in args.llamacpp_specs:
            peers[spec] = LlamaCpp(spec, args.llama_server, gguf, threads, ctx, log_dir)

    # results[group][method] = {"times": [...], "tokens": int, "outputs": [...], "counters": {...}}
    results: dict[str, dict[str, dict]] = {g: {m: {"times": [], "counters": None} for m in engines} for g in groups}
    peer_times: dict[str, list[float]] = {spec: [] for spec in peers}
    peer_outputs: dict[str, list[list[int]]] = {}
    warmup = [(ids, 8) for ids, _ in all_requests[: args.streams]]
    for llm in engines.values():  # warm-up: kernels, thread pool, the batch shapes of the load case
        run_once(llm, warmup, args.streams, ignore_eos)
    for peer in peers.values():
        peer.run(all_requests[:1])
        peer.drafted = peer.accepted = 0
    names = list(engines)
    try:
        for repeat in range(args.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:  # no engine always first in a round
                for group, requests in groups.items():
                    seconds, outputs, counters = run_once(engines[name], requests, args.streams, ignore_eos)
                    entry = results[group][name]
                    entry["times"].append(seconds)
                    entry.setdefault("outputs", outputs)
                    entry["tokens"] = sum(map(len, entry["outputs"]))
                    if entry["counters"] is None:
                        entry["counters"] = counters
                    else:
                        entry["counters"] = {k: entry["counters"][k] + v for k, v in counters.items()}
                    print(f"  [{repeat}] pagedllm {name} {group}: {seconds:.1f} s, {sum(map(len, outputs))} tokens, "
                          f"{counters['drafts']} drafts", file=sys.stderr, flush=True)
            for spec, peer in peers.items():
                seconds, outputs = peer.run(all_requests)
                peer_times[spec].append(seconds)
                print(f"  llama.cpp {spec}: {seconds:.1f} s", file=sys.stderr, flush=True)
                if peer_outputs.setdefault(spec, outputs) != outputs:
                    print(f"note: llama.cpp {spec}: output differs between repeats")
    finally:
        for peer in peers.values():
            peer.close()

    base_name = names[0]
    rows = []

    def add_rows(label: str, members: list[str]) -> None:
        base = None
        for name in names:
            entries = [results[g][name] for g in members]
            times = [sum(t) for t in zip(*(e["times"] for e in entries))]  # a repeat's time over the members
            counters = {k: sum(e["counters"][k] for e in entries) for k in entries[0]["counters"]}
            identical = sum(a == b for g in members for a, b in zip(results[g][name]["outputs"],
                                                                   results[g][base_name]["outputs"]))
            row = figures(name, label, times, sum(e["tokens"] for e in entries), counters, base, identical,
                          sum(len(groups[g]) for g in members))
            base = base or row
            rows.append(row)

    for group in groups:
        add_rows(group, [group])
    if len(groups) > 1:
        non_copy = [g for g in groups if g != "copy"]
        if "copy" in groups and non_copy:
            add_rows("non-copy", non_copy)
        add_rows("all", list(groups))

    print(f"\n{len(all_requests)} requests, {args.streams} stream(s), medians of {args.repeats} repeats; "
          f"counters summed over the repeats; speculation off by load from "
          f"{args.disable_by_batch_size or 'never'} running requests")
    print(f"{'category':22} {'method':8} {'tok/s':>7} {'vs off':>7} {'drafts':>7} {'proposed':>9} {'accepted':>9} "
          f"{'accept':>7} {'tok/verif':>9} {'off-switch':>10} {'same as off':>11}")
    for r in rows:
        rate = f"{r['acceptance']:7.2f}" if r["acceptance"] is not None else f"{'-':>7}"
        per = f"{r['tokens_per_verification']:9.2f}" if r["tokens_per_verification"] else f"{'-':>9}"
        print(f"{r['category']:22} {r['method']:8} {r['tok_s']:7.1f} {r['speedup']:6.2f}x {r['drafts']:7d} "
              f"{r['proposed']:9d} {r['accepted']:9d} {rate} {per} {r['requests_switched_off']:10d} "
              f"{r['identical_to_off']:>5}/{r['requests']:<5}")

    rows_peer: dict = {}
    if peers:
        reference = sum((results[g][base_name]["outputs"] for g in groups), [])
        pagedllm_all = {r["method"]: r for r in rows if r["category"] == ("all" if len(groups) > 1 else
                                                                             next(iter(groups)))}

        def agree(outputs: list[list[int]], other: list[list[int]]) -> dict:
            prefixes = [common_prefix(a, b) for a, b in zip(outputs, other)]
            return dict(identical=sum(a == b for a, b in zip(outputs, other)),
                        mean_prefix=statistics.mean(prefixes), prefixes=prefixes)

        base_spec = args.llamacpp_specs[0]
        mean_len = statistics.mean(map(len, reference))
        print(f"\nllama.cpp vs pagedllm ({base_name}) outputs, greedy, ignore_eos, same GGUF, "
              f"{len(all_requests)} requests of {mean_len:.1f} tokens on average:")
        peer_base = statistics.median(peer_times[base_spec])
        peer_rows = []
        for spec, peer in peers.items():
            outputs = peer_outputs[spec]
            median = statistics.median(peer_times[spec])
            rate = peer.accepted / peer.drafted if peer.drafted else None
            vs_paged, vs_none = agree(outputs, reference), agree(outputs, peer_outputs[base_spec])
            print(f"  llama.cpp {spec:13}: {vs_paged['identical']}/{len(all_requests)} identical to pagedllm, mean "
                  f"common prefix {vs_paged['mean_prefix']:.1f}; vs llama.cpp {base_spec}: "
                  f"{vs_none['identical']}/{len(all_requests)} identical, mean common prefix "
                  f"{vs_none['mean_prefix']:.1f}")
            peer_rows.append(dict(engine="llama.cpp", spec=spec, tok_s=sum(map(len, outputs)) / median,
                                  speedup=peer_base / median, proposed=peer.drafted, accepted=peer.accepted,
                                  acceptance=rate, server_args=LLAMACPP_SPECS[spec], vs_pagedllm=vs_paged,
                                  vs_llamacpp_none=vs_none, seconds=peer_times[spec]))
        print(f"\n{'engine':10} {'speculation':13} {'tok/s':>8} {'vs own off':>10} {'proposed':>9} {'accepted':>9}")
        for r in [dict(engine="pagedllm", spec=m, **{k: v for k, v in r.items() if k in ("tok_s", "speedup",
                                                                                          "proposed", "accepted")})
                  for m, r in pagedllm_all.items()] + peer_rows:
            print(f"{r['engine']:10} {r['spec']:13} {r['tok_s']:8.1f} {r['speedup']:9.2f}x {r['proposed']:9d} "
                  f"{r['accepted']:9d}")
        rows_peer = dict(llamacpp=peer_rows, llama_server=args.llama_server, threads=threads, ignore_eos=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), streams=args.streams, repeats=args.repeats, categories=categories,
                           requests=len(all_requests), rows=rows, **rows_peer), f, indent=1)


if __name__ == "__main__":
    main()
