"""The player page in real headless Chromium (Debian's package, driven by Playwright)."""

from __future__ import annotations

import shutil

import pytest

from ..helpers import Daemon, http

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")

FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--autoplay-policy=no-user-gesture-required",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture
def daemon(plain_daemon):
    return plain_daemon  # the run's shared plain daemon, idle (tests/conftest.py)


def open_player(p, url: str):
    """Chromium on the player page, once it has read the model: (browser, page, console lines)."""
    browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
    page = browser.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(m.text))
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('fps')")
    return browser, page, console


@pytest.mark.timeout(300)
def test_page_plays_a_two_scene_stream_while_it_is_generated(daemon, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page, console = open_player(p, daemon.url)
        # Through the form, as a person would: a two-scene storyboard, the second a cut.
        page.click("#tab-story")
        page.locator(".scene button").nth(2).click()  # remove the third default scene
        page.locator(".scene textarea").nth(1).fill("a city street at night")
        page.locator(".scene select").nth(1).select_option("cut")
        page.fill("#seed", "11")
        page.click("#start")
        page.wait_for_function("window.player.firstAdvanceAt !== null", timeout=120_000)
        video_id = page.evaluate("window.player.videoId")
        # currentTime advanced while the server was still generating the video.
        job = http.get(f"{daemon.url}/v1/videos/{video_id}", timeout=10).json()
        advanced_while = job["status"]
        page.wait_for_function("window.player.state === 'complete'", timeout=120_000)
        page.wait_for_function("window.player.sceneChanges >= 2", timeout=60_000)
        state = page.evaluate("""() => ({...window.player, scenes: window.player.scenes.length,
            currentTime: document.getElementById('video').currentTime,
            mediaError: document.getElementById('video').error,
            sceneText: document.getElementById('scene').textContent})""")
        page.screenshot(path=str(tmp_path / "player.png"))
        browser.close()
    assert advanced_while == "in_progress" or state["firstAdvanceAt"] < state["streamEndAt"], (advanced_while, state)
    assert state["firstAdvanceAt"] < state["streamEndAt"]
    assert state["mediaError"] is None and state["mediaErrors"] == [], (state, console)
    assert state["frames"] == 96 and state["scenes"] == 2
    assert state["sceneChanges"] >= 2 and "city street" in state["sceneText"]
    assert state["firstFrameMs"] is not None and state["firstFrameMs"] < 30_000


@pytest.mark.timeout(300)
def test_page_steers_a_live_video_while_it_plays_and_stops_it(daemon, tmp_path):
    """A live video from the form, steered mid-play from the page: the scene indicator changes to
    the new prompt when playback reaches the acknowledged frame, no media error, currentTime keeps
    advancing; the stop button ends it cleanly (the stream completes)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page, console = open_player(p, daemon.url)
        page.fill("#prompt", "a red ball")
        page.fill("#seconds", "60")
        page.check("#live")
        page.fill("#size", "128x64")
        page.click("#start")
        page.wait_for_function("window.player.firstAdvanceAt !== null", timeout=120_000)
        page.fill("#steer-prompt", "a blue square on a white background")
        page.select_option("#steer-transition", "cut")
        page.check("#steer-recache")  # ignored with a cut: the page sends it only with continue
        page.click("#steer")
        page.wait_for_function("window.player.steers.length === 1", timeout=30_000)
        landed = page.evaluate("window.player.steers[0]")
        page.wait_for_function("document.getElementById('scene').textContent.includes('blue square')", timeout=60_000)
        at_change = page.evaluate("document.getElementById('video').currentTime")
        page.wait_for_timeout(1500)
        later = page.evaluate("document.getElementById('video').currentTime")
        page.click("#stop")
        page.wait_for_function("window.player.state === 'complete'", timeout=60_000)
        state = page.evaluate("""() => ({mediaErrors: window.player.mediaErrors, frames: window.player.frames,
            mediaError: document.getElementById('video').error, videoId: window.player.videoId})""")
        page.screenshot(path=str(tmp_path / "live.png"))
        browser.close()
    assert at_change >= landed["start_seconds"] - 0.1  # the indicator moved when playback got there
    assert later > at_change  # and playback went on
    assert state["mediaError"] is None and state["mediaErrors"] == [], (state, console)
    video = http.get(f"{daemon.url}/v1/videos/{state['videoId']}", timeout=10).json()
    assert video["status"] == "completed" and video["live"] is True and state["frames"] == video["num_frames"]
    assert [s["start_frame"] for s in video["scenes"]] == [0, landed["start_frame"]]


@pytest.mark.timeout(300)
def test_page_plays_an_image_to_video_stream_decoded_by_taehv(tmp_path):
    """The embedded default decoded by TAEHV (`--decoder taehv`), a video started from the page's
    image picker: it plays to the end in the browser with every frame and no media error, and
    the job says it used the image."""
    import io

    import numpy as np
    from PIL import Image
    from playwright.sync_api import sync_playwright

    png = tmp_path / "first.png"
    ramp = np.linspace(0, 255, 256 * 144 * 3).reshape(144, 256, 3).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG")
    png.write_bytes(buf.getvalue())
    d = Daemon("--decoder", "taehv")
    try:
        assert http.get(d.url + "/v1/models", timeout=10).json()["data"][0]["decoder"] == "taehv"
        with sync_playwright() as p:
            browser, page, console = open_player(p, d.url)
            page.wait_for_selector("#image-row:not([hidden])")
            page.fill("#prompt", "a red ball moving left")
            page.fill("#seconds", "2")
            page.set_input_files("#image", str(png))
            page.wait_for_timeout(300)  # the page reads the file when it is picked
            page.click("#start")
            page.wait_for_function("window.player.state === 'complete'", timeout=120_000)
            state = page.evaluate("""() => ({mediaErrors: window.player.mediaErrors, frames: window.player.frames,
                mediaError: document.getElementById('video').error, videoId: window.player.videoId})""")
            browser.close()
        video = http.get(f"{d.url}/v1/videos/{state['videoId']}", timeout=10).json()
    finally:
        d.stop()
    assert state["mediaError"] is None and state["mediaErrors"] == [], (state, console)
    assert state["frames"] == 32 == video["num_frames"] and video["status"] == "completed"
    assert video["input_reference"]["width"] == 256 and video["input_reference"]["height"] == 144
