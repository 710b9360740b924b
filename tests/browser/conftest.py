"""Headless Chromium driven by Selenium against the live test server (``tests/server/conftest.py``).

Debian's ``chromium`` and ``chromium-driver`` (``make test`` installs them where it can); Selenium is
handed that chromedriver, so Selenium Manager never downloads a browser or a driver. Without them
every test here is skipped with the reason.
"""

from __future__ import annotations

import shutil

import pytest

from tests.server.conftest import Server, idle, server  # noqa: F401 - the same live server, with its API key

WINDOW = (1300, 900)


def _browser_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        missing = " and ".join(n for n, p in (("chromium", browser), ("chromedriver", driver)) if p is None)
        pytest.skip(f"no {missing} on PATH: install Debian's chromium and chromium-driver (make test does)")
    return browser, driver


@pytest.fixture(scope="session")
def driver():
    browser, chromedriver = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


@pytest.fixture
def page(driver, idle: Server):  # noqa: F811
    """The page, opened afresh with the API key in its storage and the pool stream live. Fails the test
    on any error in the browser's console (a script error, a refused request)."""
    driver.set_window_size(*WINDOW)
    driver.get(idle.url + "/")
    driver.execute_script("localStorage.setItem('kvserve.apiKey', arguments[0])", idle.api_key)
    driver.refresh()
    driver.get_log("browser")  # what the first load logged without the key (its 401) is not this test's
    yield driver
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
