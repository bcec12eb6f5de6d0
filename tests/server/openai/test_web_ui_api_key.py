"""The page behind --api-key: it asks for the key once, then both sockets and the chat work."""

from __future__ import annotations

import shutil

import pytest
from openai_helpers import API_KEY
from server_harness import RunningServer

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_page_asks_for_the_key_once_and_then_chats(keyed_server: RunningServer) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            prompts: list[str] = []

            def answer(dialog: object) -> None:
                prompts.append(dialog.message)  # type: ignore[attr-defined]
                dialog.accept(API_KEY)  # type: ignore[attr-defined]

            page.on("dialog", answer)
            page.goto(keyed_server.http_url + "/")
            page.wait_for_selector("#stats-conn[data-state=open]", timeout=30_000)
            page.wait_for_selector("#chat-conn[data-state=open]", timeout=30_000)
            page.evaluate("() => { document.querySelector('#set-max-tokens').value = '8'; }")  # max_model_len is 256
            page.fill("#chat-input", "Hello!")
            page.click("#send")
            page.wait_for_selector(".msg.assistant.done", timeout=120_000)
            reason = page.get_attribute(".msg.assistant", "data-finish-reason")
            assert reason in ("stop", "length"), page.inner_text(".msg.assistant")
            assert len(prompts) == 1 and "API key" in prompts[0], prompts
            assert page.evaluate("() => sessionStorage.getItem('streamkv.apiKey')") == API_KEY
            status = page.evaluate("async () => (await fetch('/api/stats')).status")
            assert status == 200  # the page's own polls carry the key too
        finally:
            browser.close()
