"""A screenshot of the web page under load, for docs/server-guide.md: ``docs/web-ui.png``.

    .venv/bin/python bench/web_screenshot.py [--model smollm2] [--out docs/web-ui.png]

Starts a server (f16 KV, 10 sequences of 1,024 tokens: a pool of 640 blocks), answers a few requests so
that the prefix cache holds something, then keeps 8 streaming requests running (four share a long system
prompt, so their prompt blocks are shared by 4) while the page's own chat streams an answer, and saves
the page as headless Chromium (Debian's chromium and chromium-driver) draws it.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

import httpx
from local_server import local_server
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

SYSTEM = (
    "You are a patient storyteller for a library's evening reading hour. Tell stories in plain words, with a "
    "clear beginning, middle and end, and give every character a name and a reason for what they do."
)
TOPICS = ["a lighthouse", "a bakery", "a comet", "a chess club", "a river", "an old map", "a robot",
          "a garden"]
CHAT = "Tell me a story about a fox who keeps a lighthouse."


def chat(url: str, messages: list[dict], max_tokens: int, stop: threading.Event | None = None) -> None:
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url, timeout=300) as c, c.stream("POST", "/v1/chat/completions",
                                                                json=body) as r:
        for _ in r.iter_lines():
            if stop is not None and stop.is_set():
                return


def messages(i: int) -> list[dict]:
    user = {"role": "user", "content": f"Tell a story about {TOPICS[i]}."}
    return [{"role": "system", "content": SYSTEM}, user] if i < 4 else [user]


def browser(width: int, height: int) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "web-ui.png")
    p.add_argument("--size", default="1400x900", help="window size, WIDTHxHEIGHT")
    args = p.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with local_server(args.model, "-c", "1024", "--max-num-seqs", "10", "--cache-type", "f16") as (url, _):
        for i in (4, 5, 6):  # finished answers: their blocks stay in the prefix cache
            chat(url, messages(i + 1), 40)
        driver = browser(width, height)
        stop = threading.Event()
        load = [threading.Thread(target=chat, args=(url, messages(i), 900, stop)) for i in range(8)]
        try:
            driver.get(url + "/")
            for thread in load:
                thread.start()
            time.sleep(3)  # the 8 requests prefill and decode for a while
            driver.find_element(By.ID, "prompt").send_keys(CHAT, Keys.ENTER)
            time.sleep(5)  # the chat's answer streams beside the 8 others
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
            print(f"wrote {args.out}")
        finally:
            stop.set()
            driver.quit()
            for thread in load:
                thread.join(60)


if __name__ == "__main__":
    main()
