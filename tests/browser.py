"""A real headless browser for the page tests: Debian's chromium and its driver (scripts/setup.sh)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def headless_chromium(profile: Path):
    """A selenium Chrome driver on headless chromium with its own profile folder; fails the test (not
    skips it) when chromium or chromedriver is missing. The caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not browser or not driver_path:
        pytest.fail("chromium and chromium-driver are not installed: run scripts/setup.sh (apt-get install "
                    "chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run",
                f"--user-data-dir={profile}", "--window-size=1280,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver_path), options=options)
