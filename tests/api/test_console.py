"""The web console in a real headless browser (Debian's chromium and chromium-driver, driven by
Selenium): a 2-node mesh's nodes and layer ranges drawn, a chat message answered as it
streams, a killed node shown down within 5 s; and a server that wants an API key shows why it
shows nothing, never a blank page."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from seamline.app import LocalModel
from seamline.runtime.backend import LocalBackend
from seamline.server.api_options import ApiLimits
from tests.support.api import NAME
from tests.support.mesh import start_mesh

REPEAT = "Repeat this list exactly, twice: apples, pears, plums, cherries, figs, dates."

BROWSER, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture()
def browser() -> Iterator[webdriver.Chrome]:
    assert BROWSER and DRIVER, "install.sh --test installs Debian's chromium and chromium-driver"
    options = Options()
    options.binary_location = BROWSER
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _row(browser: webdriver.Chrome, node: str) -> str:
    """A node's row in the table, read at once (the page redraws it every second)."""
    script = (
        "const r = document.querySelector(`#nodes tr[data-node='${arguments[0]}']`); "
        "return r ? [...r.cells].map((c) => c.textContent).join(' ') : '';"
    )
    return str(browser.execute_script(script, node))


def _drawn(browser: webdriver.Chrome, node: str, down: bool = False) -> bool:
    selector = f"#drawing g.node{'.down' if down else ''}[data-node='{node}']"
    return bool(
        browser.execute_script("return document.querySelector(arguments[0]) !== null;", selector)
    )


def test_the_console_draws_the_mesh_chats_and_shows_a_lost_node(
    tmp_path: Path, browser: webdriver.Chrome
) -> None:
    mesh = start_mesh(tmp_path, 2)
    try:
        stages = mesh.wait_ready()["stages"]
        browser.get(mesh.base_url + "/")
        for stage in stages:
            node, (start, end) = stage["node_id"], stage["layers"]
            WebDriverWait(browser, 10).until(
                lambda b, n=node, s=start, e=end: f"[{s}, {e})" in _row(b, n)
            )
            assert "up" in _row(browser, node).split()
            assert _drawn(browser, node)
        browser.find_element(By.ID, "prompt").send_keys("What is the capital of France?")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 120).until(lambda b: len(b.find_element(By.ID, "answer").text) > 20)
        assert not browser.find_element(By.ID, "error").text
        # a greedy answer that repeats its question: the mesh drafts from it; the header says how it went
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": REPEAT}],
            "max_tokens": 64,
            "temperature": 0,
            "ignore_eos": True,
        }
        assert (
            httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=120).status_code
            == 200
        )
        WebDriverWait(browser, 15).until(
            lambda b: b.find_element(By.ID, "acceptance").text.endswith("%")
        )
        assert float(browser.find_element(By.ID, "per-window").text) >= 1
        lost = stages[1]["node_id"]
        mesh.node_procs[int(lost.removeprefix("node"))].kill()
        WebDriverWait(browser, 5).until(lambda b: "down" in _row(b, lost).split())
        assert _drawn(browser, lost, down=True)
    finally:
        mesh.stop()


def test_a_server_that_wants_a_key_shows_why(browser: webdriver.Chrome) -> None:
    from tests.support.api import serve

    model = LocalModel.load()
    with serve(
        LocalBackend(model.engine, model.codec, NAME), limits=ApiLimits(keys=("sesame",))
    ) as url:
        browser.get(url + "/")
        WebDriverWait(browser, 10).until(
            lambda b: "key" in b.find_element(By.ID, "error").text.lower()
        )
        browser.find_element(By.ID, "key").send_keys("sesame")
        WebDriverWait(browser, 10).until(lambda b: not b.find_element(By.ID, "error").text)
        WebDriverWait(browser, 10).until(lambda b: "up" in _row(b, "local").split())
