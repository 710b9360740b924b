"""Driving the web page in the browser: waiting on what it shows, its settings, sending a message."""

from __future__ import annotations

import time

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

SNAPSHOT = """
const m = [...document.querySelectorAll('.msg[data-role=assistant]')].at(-1);
const cells = [...document.querySelectorAll('#blocks i')];
const blocks = m && m.dataset.blocks ? m.dataset.blocks.split(',').map(Number) : [];
return {
  state: m ? m.dataset.state : null,
  text: m ? m.querySelector('.content').textContent : '',
  requestId: m ? m.dataset.requestId : null,
  blocks,
  blockStates: blocks.map((b) => cells[b].dataset.state),
  stats: m ? {...m.querySelector('.stats').dataset} : {},
  statsText: m ? m.querySelector('.stats').textContent : '',
  pool: {...document.getElementById('pool').dataset},
  conn: document.getElementById('conn').dataset.state,
  numCells: cells.length,
  shared: cells.filter((c) => c.dataset.state === 'shared')
    .map((c) => [Number(c.dataset.block), c.dataset.n]),
  requests: [...document.querySelectorAll('#requests tbody tr')].map((r) => r.dataset.requestId),
};
"""


def snapshot(driver) -> dict:
    return driver.execute_script(SNAPSHOT)


def wait_for(driver, predicate, what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = snapshot(driver)
        if predicate(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {what}: {s}")
        time.sleep(0.05)


def settings(driver, max_tokens: int, temperature: float = 0, system: str = "") -> None:
    driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    for field, value in (("max-tokens", max_tokens), ("temperature", temperature), ("system", system)):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(str(value))


def send(driver, text: str) -> None:
    driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)  # Enter sends
