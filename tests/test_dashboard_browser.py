"""The dashboard in a real browser: headless Chromium (Debian's chromium + chromium-driver) via Selenium.

1. Against ``pagedllm serve`` (tiny model, an API key passed as ``?key=``) with requests frozen
   mid-flight: the block map drawn by the page shows exactly the used / shared / free blocks the
   allocator has, the charts keep updating, hovering a cell names the block.
2. Against ``pagedllm dashboard --simulate`` with 16,384 blocks: the page keeps up; the time to
   draw one update (block map + charts + table) is printed.
3. Against two replicas (block managers standing in, tests/test_dashboard_replicas.py): the
   replica selector switches the map between all replicas and one, and shows a dead one as dead.

Screenshots go to the test's tmp dir (printed), or to $PAGEDLLM_DASHBOARD_ARTIFACTS when set.
Fails where Chromium, chromedriver or Selenium is missing (``scripts/install.sh test`` installs
them), unless the run allows it: ``PAGEDLLM_TEST_WITHOUT=chromium`` (tests/requirements_here.py).
"""

from __future__ import annotations

import os
import pathlib
import time

import pytest
from browser import chromium_driver
from requirements_here import require

CHROMIUM, CHROMEDRIVER = require("chromium")
webdriver = require("selenium")

from test_dashboard import API_KEY, gated_server_running, run_sharing_workload  # noqa: E402
from test_dashboard_replicas import PoolsAsReplicas, forked_replica, prefix_replica, replicas_app  # noqa: E402
from test_server import ServerThread  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    with chromium_driver(webdriver, CHROMIUM, CHROMEDRIVER) as driver:
        yield driver


@pytest.fixture
def gated_server(tiny_model_factory):
    with gated_server_running(tiny_model_factory("llama")) as server:
        yield server


def artifact_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = pathlib.Path(os.environ.get("PAGEDLLM_DASHBOARD_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def dash(driver, expression: str):
    return driver.execute_script(f"return window.dashboard && ({expression});")


def wait_js(driver, expression: str, timeout: float = 20.0, what: str = ""):
    deadline = time.time() + timeout
    while True:
        value = dash(driver, expression)
        if value:
            return value
        if time.time() > deadline:
            state = dash(driver, "({updates: window.dashboard.updates, counts: window.dashboard.counts})")
            status = driver.execute_script("return document.getElementById('status').textContent")
            raise AssertionError(f"timed out waiting for {what or expression}; page: {state}, status {status!r}")
        time.sleep(0.05)


def dom_count(driver, name: str) -> int:
    return int(driver.find_element("id", f"count-{name}").get_attribute("data-count"))


def test_block_map_shows_the_pool_of_a_live_server(browser, gated_server, tmp_path):
    expected = run_sharing_workload(gated_server)
    browser.get(f"{gated_server.url}/dashboard?key={API_KEY}")
    # A snapshot taken after the last allowed step (the engine stands still from then on).
    wait_js(browser, "window.dashboard.snapshot && window.dashboard.snapshot.counters.steps === 5 "
                     "&& window.dashboard.updates >= 2", what="a live update after the workload")
    for name in ("used", "shared", "owned", "free", "cached", "swapped"):
        assert dom_count(browser, name) == expected[name], name
    assert dom_count(browser, "total") == 64
    # The pool's panel: its KV dtype (float32 weights, "auto"), bytes a token, block counts.
    kv_panel = browser.execute_script(
        "return ['kv-dtype', 'kv-bytes-per-token', 'kv-gpu-blocks', 'kv-cpu-blocks'].map((id) => {"
        "  const el = document.getElementById(id); return [el.textContent, el.dataset.value,"
        "  el.closest('.item').hidden]; });")
    assert kv_panel == [["auto (float32)", "auto", False], ["512", "512", False], ["64", "64", False],
                        ["0", "0", False]], kv_panel
    assert "auto (float32) KV" in browser.find_element("id", "pool-info").text
    assert browser.find_element("id", "status").text == "live"
    # Read in one go: the table is rebuilt on every update.
    cells = browser.execute_script(
        "return [...document.querySelectorAll('#requests tbody tr')]"
        ".map((row) => [...row.cells].slice(2, 8).map((cell) => cell.textContent));")
    # (state, sequences, prompt, output, blocks, shared blocks); the first two arrived together, in either order.
    # The first two decoded in all five steps but the first (the third's prefill shared a step with them).
    assert sorted(cells) == [["running", "1", "40", "2", "3", "2"], ["running", "1", "40", "5", "3", "2"],
                             ["running", "3", "40", "5", "5", "2"]]

    # The charts keep moving: new points arrive and are drawn (the series scroll left).
    chart_image = "document.getElementById('chart-memory').toDataURL()"
    before = browser.execute_script(f"return {chart_image};")
    points, drawn = dash(browser, "window.dashboard.chartPoints"), dash(browser, "window.dashboard.chartsDrawn")
    wait_js(browser, f"window.dashboard.chartPoints >= {points + 3} && window.dashboard.chartsDrawn > {drawn}",
            what="chart updates")
    assert browser.execute_script(f"return {chart_image};") != before, "the memory chart did not change"
    painted = browser.execute_script(
        "const c = document.getElementById('chart-memory');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n / (c.width * c.height);")
    assert painted > 0.02, "the memory chart's areas are not drawn"
    token_share = browser.find_element("id", "legend-memory").text
    assert "token states" in token_share and "token states 0.0%" not in token_share

    # Hovering a cell: the first prompt block of the n=3 request, shared by its 3 samples.
    group = next(g for g in gated_server.engine.scheduler.running if len(g.seqs) == 3)
    block_id = gated_server.engine.scheduler.block_manager.block_tables[group.seqs[0].seq_id][0].block_id
    tip = browser.execute_script(
        "const id = arguments[0], c = document.getElementById('gpu-map'), r = c.getBoundingClientRect();"
        "const l = window.dashboard.layout, scale = r.width / c.width;"
        "const x = r.left + ((id % l.cols) + 0.5) * l.cell * scale;"
        "const y = r.top + (Math.floor(id / l.cols) + 0.5) * l.cell * scale;"
        "c.dispatchEvent(new MouseEvent('mousemove', {clientX: x, clientY: y, bubbles: true}));"
        "return document.getElementById('tooltip').textContent;", block_id)
    assert f"device block #{block_id}: shared" in tip and "ref count 3" in tip and "fill 16/16" in tip, tip

    shot = artifact_dir(tmp_path) / "dashboard-server.png"
    browser.save_screenshot(str(shot))
    print(f"\ndashboard screenshot: {shot}")
    browser.get("about:blank")  # close the event stream before the server stops
    gated_server.gate.release()
    for thread in gated_server.threads:
        thread.join(60)
    assert gated_server.engine.scheduler.block_manager.all_free()


def test_ten_thousand_blocks_keep_the_page_fast(browser, tmp_path):
    from pagedllm.entrypoints.cli import build_parser
    from pagedllm.entrypoints.dashboard.cli import build_simulated_app

    num_blocks = 16384
    args = build_parser().parse_args([
        "dashboard", "--simulate", "--num-gpu-blocks", str(num_blocks), "--rate", "30", "--n", "2",
        "--shared-prefix-len", "64", "--speed", "4", "--swap-blocks", "2048", "--preemption-mode", "swap",
    ])
    app = build_simulated_app(args)
    with ServerThread(app) as server:
        browser.get(f"{server.url}/dashboard")
        wait_js(browser, "window.dashboard.updates >= 12 && window.dashboard.counts.used > 1000",
                timeout=40, what="a busy simulated pool")
        # One read of both: the simulation keeps rendering, and each render sets the two together.
        counts, summary = dash(browser, "[window.dashboard.counts, window.dashboard.snapshot.blocks]")
        assert counts["total"] == num_blocks
        gpu_blocks = browser.find_element("id", "kv-gpu-blocks").get_attribute("data-value")
        assert gpu_blocks == str(num_blocks)
        # The page's counts come from the cells it drew; the server's from the allocator.
        assert (counts["used"], counts["shared"], counts["free"], counts["cached"], counts["swapped"]) == \
            (summary["used"], summary["shared"], summary["free"], summary["cached"], summary["swapped"])
        # Frame pacing while updates stream in: intervals between animation frames over 2 s.
        frames = browser.execute_async_script(
            "const done = arguments[0], times = [];"
            "function tick(t) { times.push(t); if (t - times[0] < 2000) requestAnimationFrame(tick);"
            "  else done(times.slice(1).map((x, i) => x - times[i])); }"
            "requestAnimationFrame(tick);")
        stats = dash(browser, "({avg: window.dashboard.avgDrawMs, max: window.dashboard.maxDrawMs,"
                              " renders: window.dashboard.renders})")
        frames.sort()
        print(f"\n{num_blocks} blocks: one update drawn in {stats['avg']:.1f} ms on average "
              f"(max {stats['max']:.1f} ms, {stats['renders']} renders); animation frame interval "
              f"median {frames[len(frames) // 2]:.1f} ms, max {frames[-1]:.1f} ms")
        assert stats["avg"] < 250, "drawing one update of a 16k-block pool is too slow"
        shot = artifact_dir(tmp_path) / "dashboard-simulated-16k.png"
        browser.save_screenshot(str(shot))
        print(f"dashboard screenshot: {shot}")
        browser.get("about:blank")


def test_replica_selector_switches_the_view_and_shows_a_dead_replica(browser, tmp_path):
    from selenium.webdriver.support.ui import Select

    replicas = PoolsAsReplicas([forked_replica(), prefix_replica()])
    with ServerThread(replicas_app(replicas)) as server:
        browser.get(f"{server.url}/dashboard")
        # The default view: both pools side by side (16 blocks each), 3 + 4 blocks used.
        wait_js(browser, "window.dashboard.snapshot && window.dashboard.snapshot.view === 'all' "
                         "&& window.dashboard.counts.total === 32 && window.dashboard.updates >= 1",
                what="the all-replicas view")
        assert (dom_count(browser, "used"), dom_count(browser, "shared")) == (7, 5)
        select = Select(browser.find_element("id", "replica-select"))
        assert [o.text for o in select.options] == ["all (2 of 2 live)", "replica 0 (live)", "replica 1 (live)"]
        tags = browser.execute_script("return [...document.querySelectorAll('#requests .replica-tag')]"
                                      ".map((el) => el.textContent);")
        assert tags == ["r0", "r1", "r1", "r1"]
        # Hovering replica 1's first block (block 16 of the map): named as replica 1's block 0.
        tip = browser.execute_script(
            "const id = 16, c = document.getElementById('gpu-map'), r = c.getBoundingClientRect();"
            "const l = window.dashboard.layout, scale = r.width / c.width;"
            "const x = r.left + ((id % l.cols) + 0.5) * l.cell * scale;"
            "const y = r.top + (Math.floor(id / l.cols) + 0.5) * l.cell * scale;"
            "c.dispatchEvent(new MouseEvent('mousemove', {clientX: x, clientY: y, bubbles: true}));"
            "return document.getElementById('tooltip').textContent;")
        assert tip.startswith("replica 1: device block #0: shared") and "ref count 2" in tip, tip
        browser.save_screenshot(str(artifact_dir(tmp_path) / "dashboard-replicas-all.png"))

        select.select_by_value("1")
        wait_js(browser, "window.dashboard.snapshot.view === '1' && window.dashboard.counts.total === 16 "
                         "&& window.dashboard.updates >= 1", what="replica 1's view")
        assert (dom_count(browser, "used"), dom_count(browser, "shared")) == (4, 2)
        assert "replica=1" in browser.current_url  # a reload keeps the view
        assert browser.find_element("id", "status").text == "live"

        replicas.live[1] = False  # replica 1 dies: its view says so, the page stays up
        wait_js(browser, "window.dashboard.down", what="replica 1 shown as down")
        assert browser.find_element("id", "replica-down").is_displayed()
        assert "Replica 1 is down" in browser.find_element("id", "replica-down").text
        assert not browser.find_element("id", "gpu-map").is_displayed()
        assert [o.text for o in select.options][1:] == ["replica 0 (live)", "replica 1 (dead)"]
        assert browser.find_element("id", "status").text == "live"
        shot = artifact_dir(tmp_path) / "dashboard-replica-down.png"
        browser.save_screenshot(str(shot))
        print(f"\ndashboard screenshot: {shot}")

        select.select_by_value("all")  # the live replica alone
        wait_js(browser, "window.dashboard.snapshot.view === 'all' && !window.dashboard.down "
                         "&& window.dashboard.counts.total === 16", what="the all view without replica 1")
        assert dom_count(browser, "used") == 3
        replicas.live[1] = True  # back after its restart
        wait_js(browser, "window.dashboard.counts.total === 32", what="replica 1 back in the all view")
        browser.get("about:blank")
