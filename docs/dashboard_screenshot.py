"""Make docs/dashboard.png: the dashboard of a live server during a beam-search + shared-prefix workload.

    .venv/bin/python docs/dashboard_screenshot.py [--model PATH] [--seconds 40] [--out docs/dashboard.png]

Serves the model (default: the embedded SmolLM2-135M-Instruct) with a small pool so the map is
readable and preemption by swapping shows, keeps a mix of requests in flight (chats sharing one
long system prompt, beam-search completions with 4 beams, parallel samples), opens /dashboard in
headless Chromium and saves a screenshot once the charts have some history.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import tempfile
import threading
import time

import httpx
import uvicorn

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app

SYSTEM = ("You are a patient tutor for an operating-systems course. Explain each idea with a concrete example, "
          "name the data structure involved, say what it costs in memory and time, and end with a one-line "
          "summary. Topics include virtual memory, page tables, translation lookaside buffers, copy-on-write "
          "fork, demand paging, swapping, fragmentation (internal and external), buddy allocators and slab "
          "allocators. Keep answers short enough to read in a minute, and never invent citations. ") * 2
QUESTIONS = ["What is a page table?", "Why does copy-on-write make fork cheap?", "What is internal fragmentation?",
             "How does swapping work?", "What does a TLB cache?", "What is a buddy allocator?"]
BEAM_PROMPTS = ["The key idea of paged attention is", "A block table maps", "Beam search keeps the"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def workload(url: str, model: str, stop: threading.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def chats(index: int) -> None:
            while not stop.is_set():
                question = QUESTIONS[index % len(QUESTIONS)]
                await client.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 160, "temperature": 0.8, "seed": index,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
                index += len(QUESTIONS)

        async def beams(index: int) -> None:
            while not stop.is_set():
                await client.post("/v1/completions", json={
                    "model": model, "prompt": BEAM_PROMPTS[index % len(BEAM_PROMPTS)], "max_tokens": 96,
                    "use_beam_search": True, "best_of": 4, "n": 1, "temperature": 0.0, "ignore_eos": True})
                index += 1

        async def samples(index: int) -> None:
            while not stop.is_set():
                await client.post("/v1/completions", json={
                    "model": model, "prompt": "Three facts about memory paging:", "max_tokens": 120, "n": 3,
                    "temperature": 1.0, "seed": index, "ignore_eos": True})
                index += 1

        await asyncio.gather(*(chats(i) for i in range(6)), *(beams(i) for i in range(3)), samples(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--seconds", type=float, default=40.0, help="workload time before the screenshot")
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--num-kv-blocks", type=int, default=320)
    args = parser.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    engine_args = EngineArgs(model=args.model, num_kv_blocks=args.num_kv_blocks, max_num_seqs=48,
                             swap_space=96 << 20, preemption_mode="swap")
    app = build_app(engine_args, served_model_name="SmolLM2-135M-Instruct", log_requests=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=3))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    threading.Thread(target=lambda: asyncio.run(workload(url, "SmolLM2-135M-Instruct", stop)), daemon=True).start()

    profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1250", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
                              options=options)
    try:
        driver.get(url + "/dashboard")
        time.sleep(args.seconds)
        driver.save_screenshot(args.out)
        counts = driver.execute_script("return window.dashboard.counts")
        print(f"saved {args.out}: {counts}")
        driver.get("about:blank")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
        stop.set()
        server.should_exit = True


if __name__ == "__main__":
    main()
