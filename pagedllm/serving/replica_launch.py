"""Starting data-parallel replicas: join Ray, start the actors, wait for their engines.

The front end needs the tokenizer and the configs but no weights: the model's config and the
tokenizer load here, and a draft model's (a wrong path or draft fails before any actor starts); the
scheduler and cache configs and the pool's size come from the replicas themselves (their engines
computed them).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.serving.data_parallel import DataParallelConfig, DataParallelUnavailableError
from pagedllm.serving.ray_replicas import launch_replicas

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineShell:
    """What the server reads off ``async_engine.engine``: configs, tokenizer, grammar compiler, pool."""

    model_config: Any
    scheduler_config: Any
    cache_config: Any
    tokenizer: Any
    structured_outputs: Any
    kv_cache_info: dict[str, Any]
    max_seq_len: int
    # ("generate",) or ("embed",): what the replicas' runner serves.
    supported_tasks: tuple[str, ...] = ("generate",)
    # Where the first replica's layers run (the replicas load the same model the same way).
    layer_placement: str = ""


def start_replicas(
    engine_args: EngineArgs, config: DataParallelConfig
) -> tuple[EngineShell, list[Any], list[Any], bool]:
    """(the front end's EngineShell, the replicas' actor handles, their placement groups (tensor
    parallelism only), whether Ray was started here)."""
    import ray

    from pagedllm.models.loader import load_model_config, load_tokenizer, resolve_tokenizer_path
    from pagedllm.structured import StructuredOutputManager
    from pagedllm.worker.draft_model import load_draft_model_config
    from pagedllm.worker.worker import resolve_device

    model_config = load_model_config(
        engine_args.model, engine_args.dtype, engine_args.max_model_len, engine_args.quantization,
        revision=engine_args.revision, download_dir=engine_args.download_dir, gguf_file=engine_args.gguf_file,
    )
    if engine_args.tokenizer:
        model_config.tokenizer_path = resolve_tokenizer_path(engine_args.tokenizer, engine_args.download_dir)
    tokenizer = load_tokenizer(model_config)
    speculative = engine_args.speculative_config
    if isinstance(speculative, SpeculativeConfig) and speculative.method == "draft_model":
        # A draft that cannot work (its context, its tokenizer) is named here, not as a replica actor's death.
        load_draft_model_config(speculative.model, model_config, tokenizer, engine_args.download_dir)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        try:
            ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
        except (ConnectionError, RuntimeError) as exc:
            raise DataParallelUnavailableError(
                f"Cannot join the Ray cluster at {config.ray_address or 'RAY_ADDRESS / a new local one'}: {exc}"
            ) from exc
    # One CPU (and torch thread) per replica and rank unless --num-threads says otherwise: Ray then
    # places replicas by free cores. A replica's tensor-parallel ranks are Ray actors too.
    replica_args = dataclasses.replace(
        engine_args, num_threads=engine_args.num_threads or 1, distributed_executor_backend="ray"
    )
    use_gpu = resolve_device(engine_args.device).type == "cuda"
    groups: list[Any] = []
    actors: list[Any] = []
    try:
        if engine_args.tensor_parallel_size > 1:
            groups = replica_placement_groups(replica_args, config.data_parallel_size, use_gpu)
        actors = launch_replicas(replica_args, config.data_parallel_size, config.max_restarts,
                                 1.0 if use_gpu else 0.0, groups or None)
        described = ray.get([actor.describe.remote() for actor in actors])
    except Exception:
        release_replicas(actors, groups)
        if owns_ray:
            ray.shutdown()
        raise
    first = described[0]
    logger.info("%d engine replica(s) on Ray (pids %s), router %s", len(actors), [d["pid"] for d in described],
                config.router)
    if engine_args.tensor_parallel_size > 1:
        logger.info("tensor-parallel ranks by replica (%s): %s", engine_args.placement_group_strategy,
                    [{rank: where["node_id"][:8] for rank, where in d["tensor_parallel_placement"].items()}
                     for d in described])
    shell = EngineShell(
        model_config=model_config, scheduler_config=first["scheduler_config"], cache_config=first["cache_config"],
        tokenizer=tokenizer,
        structured_outputs=StructuredOutputManager(tokenizer, model_config.hf_config.vocab_size),
        kv_cache_info=first["kv_cache_info"], max_seq_len=min(d["max_seq_len"] for d in described),
        supported_tasks=tuple(first["supported_tasks"]),
        layer_placement=first["layer_placement"],
    )
    return shell, actors, groups, owns_ray


def replica_placement_groups(replica_args: EngineArgs, num_replicas: int, use_gpu: bool) -> list[Any]:
    """One placement group per replica: bundle 0 for the replica (rank 0), one more per other rank."""
    from pagedllm.executor.rank import collective_timeout_s
    from pagedllm.executor.ray_ranks import make_placement_group, rank_bundle

    groups: list[Any] = []
    try:
        for replica_id in range(num_replicas):
            bundles = [rank_bundle(replica_args.num_threads or 1, use_gpu)] * replica_args.tensor_parallel_size
            groups.append(make_placement_group(
                bundles, replica_args.placement_group_strategy, collective_timeout_s(),
                f"replica {replica_id}'s {replica_args.tensor_parallel_size} tensor-parallel ranks",
            ))
    except Exception:
        release_replicas([], groups)
        raise
    return groups


def release_replicas(actors: list[Any], groups: list[Any]) -> None:
    """Kill the replicas' actors (their ranks die with them) and free their placement groups."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            pass
