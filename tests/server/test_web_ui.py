"""The page as a person sees it: headless Chromium chats and watches the block map."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import RunningServer, make_server

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.metrics import EngineMetrics
from streamkv.model.loader import LoadedModel

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--no-sandbox",  # CI runs as root in a sandbox of its own
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture
def web_server(tiny_model_dir: str, tiny: LoadedModel) -> Iterator[RunningServer]:
    from streamkv.engine import AsyncEngine

    config = EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"),
        cache=CacheConfig(num_blocks=2048),
        scheduler=SchedulerConfig(max_model_len=1024),
    )
    metrics = EngineMetrics()
    with make_server(AsyncEngine(config, metrics, loaded=tiny), metrics=metrics) as srv:
        yield srv


NO_CHROMIUM = "browser test needs Debian's chromium at /usr/bin/chromium (apt-get install chromium; .ci/run does)"
VIEWPORTS = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_page_streams_an_answer_and_maps_its_blocks(web_server: RunningServer, output_dir: Path) -> None:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="browser test needs playwright (pip install -e .[dev])"
    )
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(web_server.http_url + "/")
            page.wait_for_selector("#stats-conn[data-state=open]", timeout=20_000)
            page.fill("#chat-input", "Tell me about paged attention in two sentences.")
            page.click("#send")
            # the answer streams in: text appears before the turn is done
            page.wait_for_function(
                "() => { const m = document.querySelector('.msg.assistant .body');"
                " return m && m.textContent.length > 0; }",
                timeout=60_000,
            )
            page.wait_for_selector(".msg.assistant.done", timeout=120_000)
            answer = page.inner_text(".msg.assistant .body")
            assert answer.strip(), "empty answer"
            assert page.get_attribute(".msg.assistant", "data-finish-reason") in ("stop", "length")
            # the block map shows non-free cells, and this conversation's blocks outlined
            page.wait_for_function(
                "() => { const c = document.getElementById('blockmap');"
                " return +c.dataset.nonfree > 0 && +c.dataset.ownBlocks > 0; }",
                timeout=20_000,
            )
            canvas = page.locator("#blockmap")
            assert int(canvas.get_attribute("data-num-blocks") or 0) == 2048
            # The turn is done, so the session's pinned blocks no longer change; the map shows them once the next
            # /ws/stats snapshot lands (one drawn before the last token's block was taken can show one fewer).
            session_id = page.evaluate("() => window.streamkvSessionId")
            pinned = len(web_server.engine.snapshot(session_id)["session_blocks"][session_id])
            page.wait_for_function(
                "(n) => +document.getElementById('blockmap').dataset.ownBlocks === n", arg=pinned, timeout=20_000
            )
            page.screenshot(path=str(output_dir / "web_ui.png"))
            assert not errors, errors
        finally:
            browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_page_fits_desktop_and_phone_without_sideways_scroll(web_server: RunningServer, output_dir: Path) -> None:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="browser test needs playwright (pip install -e .[dev])"
    )
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            for name, viewport in VIEWPORTS.items():
                page = browser.new_page(viewport=viewport)
                page.goto(web_server.http_url + "/")
                page.wait_for_selector("#stats-conn[data-state=open]", timeout=20_000)
                # the greedy default suits the default 135M model
                assert page.input_value("#set-temperature") == "0"
                page.fill("#chat-input", "Hi")
                page.click("#send")
                page.wait_for_selector(".msg.assistant.done", timeout=120_000)
                # the session pill now holds a real id, the widest thing in the header
                assert page.inner_text("#session-id") != "no session"
                widths = page.evaluate(
                    "() => ({scroll: document.documentElement.scrollWidth,"
                    " client: document.documentElement.clientWidth,"
                    " header: document.querySelector('.topbar').scrollWidth})"
                )
                page.screenshot(path=str(output_dir / f"web_ui_{name}.png"), full_page=False)
                assert widths["scroll"] <= widths["client"], (name, widths)
                assert widths["header"] <= widths["client"], (name, widths)
                page.close()
        finally:
            browser.close()
