"""The documentation site: `pagedllm docs --build` runs `mkdocs build --strict` (a broken link, a missing
page or a nav entry without its file fails it), every page of the nav is in the output with the generated
reference pages and the benchmarks' plots, and headless Chromium shows the start page and a guide with
their navigation, the search box (which finds a word) and highlighted code blocks."""

from __future__ import annotations

import functools
import http.server
import pathlib
import threading

import pytest
from browser import chromium_driver
from requirements_here import require

from pagedllm.entrypoints.cli import main as cli_main

require("mkdocs")
CHROMIUM, CHROMEDRIVER = require("chromium")
webdriver = require("selenium")

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDES = sorted(p.stem for p in (ROOT / "docs" / "guides").glob("*.md"))
REFERENCE = ["settings", "requests", "metrics", "families", "api"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("site")
    assert cli_main(["docs", "--build", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def served_site(site):
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


def test_every_page_is_built(site):
    assert len(GUIDES) >= 12, GUIDES
    pages = ["index.html", "getting-started/index.html", "ARCHITECTURE/index.html", "CONTRACTS/index.html",
             "benchmarks/index.html"]
    pages += [f"guides/{name}/index.html" for name in GUIDES]
    pages += [f"reference/{name}/index.html" for name in REFERENCE]
    missing = [page for page in pages if not (site / page).is_file()]
    assert not missing, missing
    settings = (site / "reference/settings/index.html").read_text()
    assert "--kv-cache-dtype" in settings and "<table>" in settings
    api = (site / "reference/api/index.html").read_text()
    assert "SamplingParams" in api and "generate" in api
    # The plots benchmarks/ writes are on the benchmarks page, and their files are in the site.
    benchmarks = (site / "benchmarks/index.html").read_text()
    assert 'src="../results/paper_fig2_waste.png"' in benchmarks or "results/paper_fig2_waste.png" in benchmarks
    assert (site / "benchmarks/results/paper_fig2_waste.png").is_file()


def test_the_start_page_and_a_guide_in_a_browser(served_site):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    with chromium_driver(webdriver, CHROMIUM, CHROMEDRIVER) as driver:
        driver.get(served_site + "/")
        assert driver.find_element(By.TAG_NAME, "h1").text == "pagedllm"
        nav = driver.find_element(By.CSS_SELECTOR, "nav.md-nav--primary")
        titles = nav.get_attribute("textContent")
        for title in ("Getting started", "Guides", "Python API", "Benchmarks", "Settings", "Model families"):
            assert title in titles, title

        # The search box answers from the built index, in the page's own worker.
        # At this window's width the box sits in the header; narrower, a button opens it.
        box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
        if not box.is_displayed():
            driver.find_element(By.CSS_SELECTOR, "label.md-header__button[for='__search']").click()
        box = WebDriverWait(driver, 10).until(
            expected_conditions.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input")))
        box.click()
        box.send_keys("speculative")
        WebDriverWait(driver, 20).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item"))
        results = driver.find_element(By.CSS_SELECTOR, ".md-search-result").get_attribute("textContent")
        assert "Speculative decoding" in results

        driver.get(served_site + "/guides/python-api/")
        assert driver.find_element(By.TAG_NAME, "h1").text == "Python API"
        code = driver.find_element(By.CSS_SELECTOR, ".highlight pre code")
        assert "from pagedllm import LLM, SamplingParams" in code.get_attribute("textContent")
        # Highlighted: the keywords are spans the theme colours, not plain text.
        keyword = code.find_element(By.CSS_SELECTOR, "span.kn")
        assert keyword.text == "from" and keyword.value_of_css_property("color") != code.value_of_css_property("color")
        assert driver.find_element(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link--active").text == "Python API"
