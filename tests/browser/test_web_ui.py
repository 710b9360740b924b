"""The page at / in headless Chromium: a typed message streams its answer with TTFT and speed, its blocks
are drawn in use while it runs and cached after, a second turn is served from those cached blocks, two
requests with one prefix share blocks, the stop button aborts the request and frees its blocks, the page
asks for the API key, and a narrow screen stacks chat and pool.

What the page draws is read from its DOM (data- attributes on messages and block cells), while the
server's own accounting (/v1/kvserve/cache, /metrics) is the reference."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.browser.page_driver import send, settings, snapshot, wait_for
from tests.server.conftest import Server

pytestmark = pytest.mark.slow

LONG = "Write a very long story about a cat."  # greedy SmolLM2 writes until max_tokens
BLOCK_SIZE = 16


def live(driver) -> dict:
    return wait_for(driver, lambda s: s["conn"] == "live" and s["numCells"] > 0, "the live pool")


def test_an_answer_streams_with_its_ttft_and_its_blocks_turn_cached(page, idle: Server):
    num_blocks = idle.cache()["num_blocks"]
    assert live(page)["numCells"] == num_blocks
    settings(page, max_tokens=128)
    send(page, LONG)
    lengths = set()
    running = wait_for(
        page,
        lambda s: (
            lengths.add(len(s["text"]))
            or (s["state"] == "streaming" and s["blocks"] and set(s["blockStates"]) == {"used"})
        ),
        "the answer's blocks in use while it streams",
    )
    assert running["requestId"] in running["requests"]
    done = wait_for(
        page, lambda s: lengths.add(len(s["text"])) or s["state"] == "done", "the finished answer"
    )
    assert len(lengths - {0}) >= 2, f"the answer did not arrive in pieces: {lengths}"
    assert done["text"].strip()
    assert int(done["stats"]["ttftMs"]) > 0 and float(done["stats"]["tokS"]) > 0
    assert "TTFT" in done["statsText"] and "tok/s" in done["statsText"]
    # every full block of the finished request stays in the prefix cache; the last may be partial
    after = wait_for(page, lambda s: not s["requests"] and s["pool"]["used"] == "0", "the request gone")
    *full, last = after["blockStates"]
    assert full and set(full) == {"cached"} and last in ("cached", "free"), after
    assert int(after["pool"]["cached"]) >= len(full)
    assert idle.cache()["held_blocks"] == []


def test_a_second_turn_reuses_the_first_turns_cached_blocks(page, idle: Server):
    live(page)
    # a system prompt no earlier request had: every block of the first turn is its own
    settings(page, max_tokens=128, system=f"You tell stories. Session {uuid.uuid4().hex}.")
    send(page, LONG)
    first = wait_for(page, lambda s: s["state"] == "done" and s["blocks"], "the first answer")
    send(page, "Now make it shorter.")
    second = wait_for(
        page,
        lambda s: s["requestId"] != first["requestId"] and s["state"] == "done" and s["blocks"],
        "the second answer",
    )
    cached = int(second["stats"]["cachedTokens"])
    assert cached >= BLOCK_SIZE and f"({cached} cached)" in second["statsText"]
    # the conversation so far is a prefix of the second prompt: its blocks are the first turn's own
    num_hit_blocks = cached // BLOCK_SIZE
    # the first answer's last frame can predate its last block or two (a fast CPU finished the answer
    # between two frames): the blocks that frame shows are the second turn's first
    shown = min(num_hit_blocks, len(first["blocks"]))
    assert shown >= num_hit_blocks - 2 and second["blocks"][:shown] == first["blocks"][:shown]
    after = wait_for(page, lambda s: not s["requests"], "the requests gone")
    assert set(after["blockStates"][:num_hit_blocks]) == {"cached"}


def _stream_in_background(
    server: Server, prompt: str, stop: threading.Event, started: threading.Event
) -> None:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if '"content":"' in line and not line.endswith('"content":""}'):
                started.set()
            if stop.is_set():
                return  # closing the stream aborts the request


def test_blocks_shared_by_two_requests_are_drawn_shared(page, idle: Server):
    live(page)
    settings(page, max_tokens=400)
    stop, started = threading.Event(), threading.Event()
    other = threading.Thread(target=_stream_in_background, args=(idle, LONG, stop, started))
    other.start()
    try:
        assert started.wait(60), "the background request did not start"
        send(page, LONG)  # the same prompt: its full blocks are found in the other request's table
        shared = wait_for(
            page,
            lambda s: s["state"] == "streaming" and len(s["requests"]) == 2 and s["shared"] and s["blocks"],
            "blocks shared by both requests",
        )
        assert all(n == "2" for _, n in shared["shared"])
        shared_ids = {b for b, _ in shared["shared"]}
        assert set(shared["blocks"][: len(shared_ids)]) == shared_ids  # the prompt's leading blocks
        assert shared["blockStates"][: len(shared_ids)] == ["shared"] * len(shared_ids)
        page.find_element(By.ID, "stop").click()
    finally:
        stop.set()
        other.join(60)
    after = wait_for(page, lambda s: not s["requests"] and not s["shared"], "no shared blocks left")
    assert after["pool"]["used"] == "0" and after["pool"]["shared"] == "0"


def test_the_stop_button_aborts_the_request_and_frees_its_blocks(page, idle: Server):
    aborted_key = 'kvserve_requests_total{finish_reason="abort",model="smollm2"}'
    aborted = idle.metrics().get(aborted_key, 0)
    live(page)
    settings(page, max_tokens=400)
    page.find_element(By.ID, "prompt").send_keys(LONG)
    page.find_element(By.ID, "send").click()
    running = wait_for(
        page,
        lambda s: s["state"] == "streaming" and s["blocks"] and int(s["pool"]["used"]) > 0,
        "blocks in use",
    )
    assert page.find_element(By.ID, "send").get_attribute("disabled")
    page.find_element(By.ID, "stop").click()
    stopped = wait_for(page, lambda s: s["state"] == "stopped", "the answer stopped")
    assert stopped["text"]  # what came before the stop stays
    assert not page.find_element(By.ID, "stop").is_enabled() and page.find_element(By.ID, "send").is_enabled()
    after = wait_for(page, lambda s: not s["requests"] and s["pool"]["used"] == "0", "the blocks freed")
    assert "used" not in after["blockStates"] and set(after["blockStates"]) <= {"cached", "free"}
    assert running["requestId"] not in after["requests"]
    snap = idle.cache()
    assert snap["held_blocks"] == [] and snap["requests"] == {}
    assert idle.metrics()[aborted_key] == aborted + 1  # aborted, not run to its 400 tokens


def test_the_page_asks_for_the_api_key(driver, idle: Server):
    driver.get(idle.url + "/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    dialog = driver.find_element(By.ID, "key-dialog")
    key = driver.find_element(By.ID, "key")
    wait_for(driver, lambda s: dialog.get_attribute("open") is not None, "the key dialog")
    assert snapshot(driver)["conn"] != "live"
    key.send_keys("wrong-key", Keys.ENTER)
    wait_for(driver, lambda s: "refused" in driver.find_element(By.ID, "key-error").text, "the refused key")
    assert dialog.get_attribute("open") is not None
    key.send_keys(idle.api_key, Keys.ENTER)
    s = live(driver)
    assert dialog.get_attribute("open") is None and s["numCells"] == idle.cache()["num_blocks"]
    assert driver.execute_script("return localStorage.getItem('kvserve.apiKey')") == idle.api_key
    driver.get_log("browser")  # the refused requests logged their 401s


def test_a_narrow_screen_stacks_chat_and_pool(page):
    live(page)
    layout = """
    const box = (id) => document.getElementById(id).getBoundingClientRect();
    return {chat: box('chat').toJSON(), pool: box('pool').toJSON(), width: window.innerWidth,
            scrollWidth: document.documentElement.scrollWidth};
    """
    wide = page.execute_script(layout)
    assert wide["pool"]["left"] >= wide["chat"]["right"]  # side by side
    page.set_window_size(390, 844)
    narrow = page.execute_script(layout)
    assert narrow["pool"]["top"] >= narrow["chat"]["bottom"], json.dumps(narrow)  # stacked, chat first
    assert narrow["scrollWidth"] <= narrow["width"]  # nothing sticks out sideways
    for box in (narrow["chat"], narrow["pool"]):
        assert box["width"] > 0.8 * narrow["width"]
