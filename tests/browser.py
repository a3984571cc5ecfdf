"""Headless Chromium (Debian's chromium + chromium-driver) driven through Selenium, for the browser tests.

Chromium starts with a fresh profile and without the background networking this machine's closed network
refuses, so a page loads only what the test serves it.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1300"]


@contextlib.contextmanager
def chromium_driver(webdriver: Any, chromium: str, chromedriver: str) -> Iterator[Any]:
    """A Selenium driver of headless Chromium with a throwaway profile, quit on exit."""
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
