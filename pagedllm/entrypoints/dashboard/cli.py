"""`pagedllm dashboard --simulate ...`: the live dashboard over the simulator, at paper scale.

    pagedllm dashboard --simulate --model-config opt-13b --hardware a100-40gb --trace sharegpt --rate 1.5
    # then open http://127.0.0.1:8001/dashboard

The real scheduler and block manager serve a synthetic trace with a cost model in place of the
forward pass (labelled SIMULATED on the page); a new trace starts whenever one is used up. For
a real model, run ``pagedllm serve`` and open its /dashboard.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

logger = logging.getLogger("pagedllm.dashboard")


def add_dashboard_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagedllm.config import KV_CACHE_DTYPES
    from pagedllm.simulator import HARDWARE_PRESETS, MODEL_SHAPES, POLICIES

    parser = subparsers.add_parser("dashboard", help="the live KV-cache dashboard over the simulator",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true",
                        help="serve the simulator (required: a real model's dashboard is /dashboard of pagedllm serve)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--api-key", default=None, help="require this key (or set PAGEDLLM_API_KEY); "
                        "open the page as /dashboard?key=KEY")
    parser.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall-clock second")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between dashboard updates")
    sim = parser.add_argument_group("simulation (as `pagedllm simulate`)")
    sim.add_argument("--model-config", default="opt-13b", help=f"{', '.join(MODEL_SHAPES)} or a HF config.json")
    sim.add_argument("--hardware", default="a100-40gb", help=f"{', '.join(HARDWARE_PRESETS)} or cpu-measured")
    sim.add_argument("--trace", default="sharegpt", help="sharegpt, alpaca (synthetic) or a ShareGPT JSON file")
    sim.add_argument("--rate", type=float, default=1.5, help="request rate (req/s), Poisson")
    sim.add_argument("--num-requests", type=int, default=500, help="requests per trace round")
    sim.add_argument("--policy", default="paged", choices=list(POLICIES))
    sim.add_argument("--n", type=int, default=1, help="parallel samples per request")
    sim.add_argument("--shared-prefix-len", type=int, default=0,
                     help="tokens every prompt starts with (a system prompt for the prefix cache)")
    sim.add_argument("--no-prefix-caching", action="store_true")
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--num-gpu-blocks", type=int, default=None, help="override the paper's pool sizing")
    sim.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                     help="KV cache storage (auto = the model dtype): the pool's blocks and the KV reads' cost")
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2560)
    sim.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    sim.add_argument("--swap-blocks", type=int, default=0, help="CPU swap pool, in blocks")
    sim.add_argument("--cost-model", default=None, help="a calibrated cost-model JSON (paper_calibrate.py)")
    sim.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run_dashboard)
    return parser


def build_simulated_app(args: argparse.Namespace, api_key: str | None = None) -> Any:
    """The dashboard app over a SteppedSimulation built from parsed flags (app.state.dashboard_source)."""
    from fastapi import FastAPI
    from fastapi.responses import RedirectResponse

    from pagedllm.entrypoints.dashboard.hub import DashboardHub
    from pagedllm.entrypoints.dashboard.routes import add_dashboard_routes
    from pagedllm.entrypoints.dashboard.simulated import SimulatedSource, SteppedSimulation
    from pagedllm.entrypoints.openai.guard import GuardMiddleware
    from pagedllm.simulator import CostModel, SimConfig, get_hardware, get_model_shape, kv_pool_blocks, make_trace

    shape = get_model_shape(args.model_config, args.kv_cache_dtype)
    hw = get_hardware(args.hardware)
    cost_model = CostModel.from_json(args.cost_model) if args.cost_model else CostModel.from_hardware(shape, hw)
    num_blocks = args.num_gpu_blocks or kv_pool_blocks(shape, hw, args.block_size, args.max_num_batched_tokens)
    config = SimConfig(
        policy=args.policy, block_size=args.block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=args.swap_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=shape.max_model_len, preemption_mode=args.preemption_mode,
        enable_prefix_caching=not args.no_prefix_caching, track_kv_waste=False,
    )

    def trace_round(round_index: int) -> list:
        return make_trace(args.trace, args.num_requests, args.rate, args.seed + round_index, n=args.n)

    simulation = SteppedSimulation(trace_round, cost_model, config, shared_prefix_len=args.shared_prefix_len)
    source = SimulatedSource(simulation, speed=args.speed)
    hub = DashboardHub(source, interval_s=args.interval)
    source.attach(hub)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import asyncio

        task = asyncio.get_running_loop().create_task(source.run(), name="pagedllm-simulation")
        try:
            yield
        finally:
            source.stopped = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="pagedllm dashboard (simulated)", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GuardMiddleware, api_key=api_key, log_requests=False)
    kv = "" if shape.kv_cache_dtype == "auto" else f", KV {shape.kv_cache_dtype}"
    title = f"{shape.name} on {hw.name}{kv}, {args.trace} at {args.rate:g} req/s, {args.policy}"
    add_dashboard_routes(app, hub, title)
    app.state.dashboard_source = source

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard")

    logger.info("SIMULATED: %s, %d KV blocks of %d tokens; cost model: %s", title, num_blocks, args.block_size,
                cost_model.source)
    return app


def run_dashboard(args: argparse.Namespace) -> int:
    if not args.simulate:
        print("error: `pagedllm dashboard` needs --simulate; for a real model run `pagedllm serve` "
              "and open http://HOST:PORT/dashboard", flush=True)
        return 2
    import uvicorn

    logging.getLogger("pagedllm").setLevel(logging.INFO)
    api_key = args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None
    app = build_simulated_app(args, api_key)
    query = "?key=KEY" if api_key else ""
    source = app.state.dashboard_source

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[Any] | None = None) -> None:
            source.stopped = True  # ends the event streams: open pages must not hold up Ctrl-C
            await super().shutdown(sockets)

    print(f"Dashboard (SIMULATED) on http://{args.host}:{args.port}/dashboard{query}", flush=True)
    Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                          timeout_graceful_shutdown=5)).run()
    return 0
