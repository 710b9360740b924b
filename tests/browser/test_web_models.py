"""The page over a server of two models: its model menu lists both, a model not loaded has no pool until a
message loads it, then the page shows that model's pool, its load among the events, and the first model's
eviction (``--max-loaded-models 1``)."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.browser.page_driver import send, settings, wait_for
from tests.server.conftest import serve

pytestmark = pytest.mark.slow

MODELS = """
return {
  options: [...document.querySelectorAll('#model option')].map((o) => [o.value, o.dataset.state]),
  chosen: document.getElementById('model').value,
  strip: [...document.querySelectorAll('#models li:not(.event)')]
    .map((li) => [li.dataset.model, li.dataset.state]),
  events: [...document.querySelectorAll('#models li.event')].map((li) => li.textContent),
  conn: document.getElementById('conn').dataset.state,
  connText: document.getElementById('conn').textContent,
};
"""


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    yield from serve(tmp_path_factory, ["smollm2", "gemma3-270m"], "-c", "256", "--max-num-seqs", "2",
                     "--max-loaded-models", "1", "--weights", "q4")


def test_the_page_follows_the_chosen_model(driver, two):
    driver.get(two.url + "/")
    driver.execute_script("localStorage.setItem('kvserve.apiKey', arguments[0])", two.api_key)
    driver.refresh()

    def models(predicate, what: str) -> dict:
        return wait_for(driver, lambda _: predicate(driver.execute_script(MODELS)),
                        what) and driver.execute_script(
            MODELS)

    first = models(lambda m: m["conn"] == "live" and m["options"], "the first model's pool")
    assert wait_for(driver, lambda s: s["pool"]["model"] == "smollm2", "smollm2's pool")
    assert first["options"] == [["smollm2", "loaded"],
                                ["gemma3-270m", "unloaded"]] and first["chosen"] == "smollm2"
    assert first["strip"] == [["smollm2", "loaded"], ["gemma3-270m", "unloaded"]]
    Select(driver.find_element(By.ID, "model")).select_by_value("gemma3-270m")
    waiting = models(lambda m: m["conn"] == "idle", "the chosen model not loaded")
    assert "gemma3-270m is not loaded" in waiting["connText"]
    settings(driver, max_tokens=3)
    send(driver, "Hi")  # the chat names the chosen model: it loads, evicting smollm2
    loaded = models(lambda m: m["conn"] == "live" and ["gemma3-270m", "loaded"] in m["strip"], "gemma's pool")
    assert ["smollm2", "unloaded"] in loaded["strip"] and loaded["chosen"] == "gemma3-270m"
    assert any("smollm2 unloaded evicted" in e for e in loaded["events"])
    assert any("gemma3-270m loaded in" in e for e in loaded["events"])
    assert wait_for(driver, lambda s: s["state"] == "done", "the answer")["text"]
    with two.client() as c:
        gemma = c.get("/v1/kvserve/cache", params={"model": "gemma3-270m"}).json()
    # a frame from before the answer's blocks were freed may come first: the page settles on the free pool
    drawn = wait_for(driver, lambda s: s["pool"]["model"] == "gemma3-270m" and s["pool"]["used"] == "0",
                     "gemma's pool drawn, the answer's blocks freed")
    assert drawn["numCells"] == gemma["num_blocks"]
    errors = [
        e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE" and "409" not in e[
            "message"]
              and "401" not in e["message"]]
    assert not errors, errors
