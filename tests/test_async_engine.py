"""AsyncLLMEngine against a scripted fake engine: streaming, aborts, failures, one engine thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.request import EngineRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import CompletionOutput, RequestMetrics, RequestOutput


class FakeEngine:
    """Emits one token ("a", "b", ...) per step per request; refuses overlapping calls."""

    def __init__(self, step_delay: float = 0.002) -> None:
        self.requests: dict[str, list] = {}
        self.aborted: list[str] = []
        self.step_delay = step_delay
        self.fail_on_step = False
        self.num_steps = 0
        self._guard = threading.Lock()
        self.threads: set[int] = set()

    def _enter(self) -> None:
        assert self._guard.acquire(blocking=False), "two engine calls overlapped"
        self.threads.add(threading.get_ident())

    def add(self, request: EngineRequest) -> None:
        self._enter()
        try:
            if not request.prompt:
                raise ValueError("The prompt is empty.")
            self.requests[request.request_id] = [request.prompt, request.params.max_tokens, [], request.arrival_time]
        finally:
            self._guard.release()

    def abort_request(self, request_ids) -> None:
        self._enter()
        try:
            for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
                if self.requests.pop(request_id, None) is not None:
                    self.aborted.append(request_id)
        finally:
            self._guard.release()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._enter()
        try:
            time.sleep(self.step_delay)
            self.num_steps += 1
            if self.fail_on_step:
                raise RuntimeError("boom in step")
            outputs = []
            for request_id, (prompt, max_tokens, tokens, arrival) in list(self.requests.items()):
                tokens.append(len(tokens))
                finished = len(tokens) >= max_tokens
                text = "".join(chr(ord("a") + t % 26) for t in tokens)
                completion = CompletionOutput(0, text, list(tokens), 0.0, None, "length" if finished else None)
                outputs.append(
                    RequestOutput(request_id, prompt, [1, 2, 3], [completion], finished, RequestMetrics(arrival))
                )
                if finished:
                    del self.requests[request_id]
            return outputs
        finally:
            self._guard.release()

    def get_stats(self) -> dict:
        return {"num_running": len(self.requests), "num_gpu_blocks": 8, "gpu_blocks_used": len(self.requests)}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def collect(engine: AsyncLLMEngine, request_id: str, max_tokens: int, prompt: str = "hi") -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens), request_id)]


def test_streams_until_finished_and_engine_runs_on_one_thread() -> None:
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        outputs = await collect(engine, "r1", 5)
        assert outputs[-1].finished and outputs[-1].outputs[0].text == "abcde"
        assert all(not o.finished for o in outputs[:-1])
        # Texts are cumulative and only grow.
        texts = [o.outputs[0].text for o in outputs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert engine.num_requests_in_flight == 0
        await engine.shutdown()

    run(main())
    assert len(fake.threads) == 1 and threading.get_ident() not in fake.threads


def test_from_engine_args_builds_the_engine_on_its_step_thread(monkeypatch) -> None:
    """The engine is built on the thread that steps it (torch keeps one OpenMP team per thread)."""
    from pagedllm.engine import llm_engine

    fake = FakeEngine()
    built_on: list[int] = []

    def build(args):
        built_on.append(threading.get_ident())
        return fake

    monkeypatch.setattr(llm_engine.LLMEngine, "from_engine_args", staticmethod(build))

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(object())
        engine.start()
        assert (await collect(engine, "r1", 3))[-1].finished
        await engine.shutdown()

    run(main())
    assert fake.threads == set(built_on) and threading.get_ident() not in built_on


def test_many_concurrent_requests_all_complete() -> None:
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        results = await asyncio.gather(*(collect(engine, f"r{i}", 3 + i % 7) for i in range(24)))
        for i, outputs in enumerate(results):
            assert outputs[-1].finished
            assert len(outputs[-1].outputs[0].token_ids) == 3 + i % 7
        await engine.shutdown()

    run(main())
    assert not fake.requests


def test_bad_request_raises_and_leaves_nothing_behind() -> None:
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        good = asyncio.ensure_future(collect(engine, "good", 20))
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, "bad", 5, prompt="")
        assert not engine.is_in_flight("bad")
        assert (await good)[-1].finished
        await engine.shutdown()

    run(main())


def test_closing_the_stream_aborts_the_request() -> None:
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        stream = engine.generate("hi", SamplingParams(max_tokens=1000), "long")
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()
        for _ in range(200):
            if not fake.requests:
                break
            await asyncio.sleep(0.005)
        assert fake.aborted == ["long"] and not fake.requests
        await engine.shutdown()

    run(main())


def test_cancelled_consumer_aborts_the_request() -> None:
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        task = asyncio.ensure_future(collect(engine, "long", 1000))
        while fake.num_steps < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not fake.requests:
                break
            await asyncio.sleep(0.005)
        assert fake.aborted == ["long"]
        # The loop goes idle instead of spinning.
        steps = fake.num_steps
        await asyncio.sleep(0.05)
        assert fake.num_steps == steps
        await engine.shutdown()

    run(main())


def test_step_exception_fails_requests_in_flight_and_marks_unhealthy() -> None:
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        tasks = [asyncio.ensure_future(collect(engine, f"r{i}", 1000)) for i in range(3)]
        while fake.num_steps < 2:
            await asyncio.sleep(0.005)
        fake.fail_on_step = True
        for task in tasks:
            with pytest.raises(EngineDeadError, match="boom in step"):
                await task
        assert not engine.is_healthy and isinstance(engine.dead_error, RuntimeError)
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", 3)
        await engine.shutdown()

    run(main())


def test_engine_failing_between_add_and_read_fails_the_read() -> None:
    """A request added just before the engine fails gets EngineDeadError on its first read, not a KeyError."""
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        fake.fail_on_step = True
        await engine.add(EngineRequest("r", "hi", SamplingParams(max_tokens=5)))
        while engine.is_healthy:
            await asyncio.sleep(0.005)
        with pytest.raises(EngineDeadError, match="boom in step"):
            async for _ in engine.stream_outputs("r"):
                pass
        await engine.shutdown()

    run(main())


def test_shutdown_fails_requests_in_flight() -> None:
    fake = FakeEngine()

    async def main() -> None:
        engine = AsyncLLMEngine(fake)
        engine.start()
        task = asyncio.ensure_future(collect(engine, "r", 1000))
        while fake.num_steps < 2:
            await asyncio.sleep(0.005)
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await task
        assert not fake.requests  # aborted on the way out

    run(main())
