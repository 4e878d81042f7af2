"""The player page in real headless Chromium (Debian's package, driven by Playwright)."""

from __future__ import annotations

import shutil
import time

import pytest

from ..helpers import CHROMIUM, Daemon, http, launch_chromium

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")


@pytest.fixture
def daemon(plain_daemon):
    return plain_daemon  # the run's shared plain daemon, idle (tests/conftest.py)


def open_player(p, url: str):
    """Chromium on the player page, once it has read the model: (browser, page, console lines)."""
    browser = launch_chromium(p)
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
            sceneText: document.getElementById('scene').textContent,
            watch: document.getElementById('watch').hidden ? null
                : document.getElementById('watch-link').getAttribute('href')})""")
        page.screenshot(path=str(tmp_path / "player.png"))
        browser.close()
    assert advanced_while == "in_progress" or state["firstAdvanceAt"] < state["streamEndAt"], (advanced_while, state)
    assert state["firstAdvanceAt"] < state["streamEndAt"]
    assert state["mediaError"] is None and state["mediaErrors"] == [], (state, console)
    assert state["frames"] == 96 and state["scenes"] == 2
    # the watch link others open: the same video's LL-HLS playlist, VOD now it is done
    assert state["watch"] == f"/v1/videos/{video_id}/hls/index.m3u8"
    assert "#EXT-X-ENDLIST" in http.get(daemon.url + state["watch"], timeout=10).text
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


# ----------------------------------------------------------------------------- LL-HLS viewers

VIEWER = """<!doctype html><video id="v" muted playsinline></video>
<script src="/hls-viewer/hls.min.js"></script><script>
const v = document.getElementById('v'), hls = new Hls({lowLatencyMode: true});
window.viewer = {playing: false, edge: null, behind: null, errors: []};
hls.on(Hls.Events.ERROR, (e, d) => { if (d.fatal) window.viewer.errors.push(d.details); });
// the live edge when the viewer joined: the end of the newest part of the first playlist read
hls.on(Hls.Events.LEVEL_LOADED, (e, d) => { if (window.viewer.edge === null) window.viewer.edge = d.details.edge; });
v.addEventListener('playing', () => {
  if (window.viewer.playing) return;
  window.viewer.behind = window.viewer.edge - v.currentTime;  // where it started, behind that edge
  window.viewer.playing = true;
});
hls.loadSource(SRC); hls.attachMedia(v); v.play();
</script>"""


@pytest.fixture(scope="module")
def hls_js(tmp_path_factory) -> str:
    """hls.js from npm's registry (its own build, not kept in this repository)."""
    import subprocess

    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: hls.js comes from its registry")
    d = tmp_path_factory.mktemp("hlsjs")
    r = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(d), "hls.js@1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        pytest.skip(f"npm could not install hls.js: {r.stderr[-300:]}")
    return (d / "node_modules" / "hls.js" / "dist" / "hls.min.js").read_text()


def open_viewer(browser, url: str, video_id: str, hls_js: str):
    """A page of the daemon's origin (served by the browser itself) that plays the video's
    LL-HLS playlist with hls.js, as a watch page would."""
    page = browser.new_page()
    src = f"{url}/v1/videos/{video_id}/hls/index.m3u8"
    page.route(
        f"{url}/hls-viewer/page.html",
        lambda r: r.fulfill(body=VIEWER.replace("SRC", repr(src)), content_type="text/html"),
    )
    page.route(f"{url}/hls-viewer/hls.min.js", lambda r: r.fulfill(body=hls_js, content_type="text/javascript"))
    page.goto(f"{url}/hls-viewer/page.html")
    return page


@pytest.mark.timeout(300)
def test_hls_js_plays_a_live_video_and_a_late_viewer_starts_at_the_live_edge(daemon, hls_js):
    """Two viewers of one live video over LL-HLS in Chromium: the second joins 10 s after the
    first and starts playing within two blocks (1.5 s) of the newest part when it joined (the
    playlist's hold-back, not a clock: load only delays when it starts); both decode frames,
    neither meets a fatal error."""
    from playwright.sync_api import sync_playwright

    body = {"prompt": "a red ball moving right", "live": True, "seconds": 40, "size": "128x64", "seed": 2}
    vid = http.post(daemon.url + "/v1/videos", json=body, timeout=30).json()["id"]
    try:
        with sync_playwright() as p:
            browser = launch_chromium(p)
            first = open_viewer(browser, daemon.url, vid, hls_js)
            first.wait_for_function("window.viewer.playing || window.viewer.errors.length", timeout=60_000)
            first.wait_for_timeout(10_000)
            late = open_viewer(browser, daemon.url, vid, hls_js)
            late.wait_for_function("window.viewer.playing || window.viewer.errors.length", timeout=60_000)
            late.wait_for_timeout(2_000)
            seen = [
                pg.evaluate(
                    "({...window.viewer, frames: document.getElementById('v').getVideoPlaybackQuality()"
                    ".totalVideoFrames})"
                )
                for pg in (first, late)
            ]
            browser.close()
    finally:
        http.post(f"{daemon.url}/v1/videos/{vid}/stop", timeout=10)
    assert all(s["errors"] == [] and s["playing"] for s in seen), seen
    # the first played 12 s or more of a video made at 16 fps: 128x64 blocks take the tiny model
    # ~0.1 s each for 0.75 s of video, real time with room at twice the load
    assert seen[0]["frames"] > 10 * 16 * 0.8 and seen[1]["frames"] > 0, seen
    assert 0 <= seen[1]["behind"] <= 2 * 12 / 16 + 1 / 16, seen  # two blocks of 12 frames at 16 fps


# ----------------------------------------------------------------------------- WebRTC (WHEP)

WHEP_VIEWER = """<!doctype html><video id="v" muted playsinline></video><script>
window.acks = [];
(async () => {
  const pc = new RTCPeerConnection();
  pc.addTransceiver('video', {direction: 'recvonly'});
  const dc = pc.createDataChannel('control');
  dc.onmessage = e => window.acks.push(JSON.parse(e.data));
  window.steer = p => dc.send(JSON.stringify({type: 'session.prompt_update', prompt: p, transition: 'continue'}));
  window.dcOpen = () => dc.readyState === 'open';
  const v = document.getElementById('v');
  pc.ontrack = e => { v.srcObject = new MediaStream([e.track]); v.play(); };
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise(r => { if (pc.iceGatheringState === 'complete') r();
    pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === 'complete') r(); }; });
  const resp = await fetch(WHEP, {method: 'POST', headers: {'Content-Type': 'application/sdp'},
                                  body: pc.localDescription.sdp});
  const h = resp.headers;
  window.whep = {status: resp.status, location: h.get('Location'), start: h.get('X-Start-Frame')};
  window.answer = await resp.text();
  await pc.setRemoteDescription({type: 'answer', sdp: window.answer});
  window.stats = async () => {
    for (const r of (await pc.getStats()).values())
      if (r.type === 'inbound-rtp' && r.kind === 'video')
        return {received: r.framesReceived, frames: r.framesDecoded, dropped: r.framesDropped,
                width: r.frameWidth, height: r.frameHeight, keyframes: r.keyFramesDecoded};
    return null;
  };
})();
</script>"""


@pytest.mark.timeout(300)
def test_chromium_receives_a_live_video_over_whep_and_steers_it_on_the_data_channel(daemon):
    """WHEP in Chromium: the answer (201, a Location) brings the video's own H.264 (no second
    encode) at its size; every frame from the block it joined at to the end is decoded; a steer
    sent on the data channel is acknowledged with the frame where it lands; the video's end frees
    the viewer (its DELETE then finds nothing)."""
    from playwright.sync_api import sync_playwright

    url = daemon.url
    body = {"prompt": "a red ball moving right", "live": True, "seconds": 8, "size": "128x64", "seed": 5}
    vid = http.post(url + "/v1/videos", json=body, timeout=30).json()["id"]
    whep = f"{url}/v1/videos/{vid}/whep"
    with sync_playwright() as p:
        # Chromium's own ICE: its host addresses hidden behind mDNS names, which aiortc meets as
        # peer-reflexive candidates when the browser's checks arrive
        browser = launch_chromium(p)
        page = browser.new_page()
        page.route(
            f"{url}/whep-viewer.html",
            lambda r: r.fulfill(body=WHEP_VIEWER.replace("WHEP", repr(whep)), content_type="text/html"),
        )
        page.goto(f"{url}/whep-viewer.html")
        page.wait_for_function("window.whep !== undefined", timeout=60_000)
        signal = page.evaluate("window.whep")
        answer = page.evaluate("window.answer")
        page.wait_for_function("window.dcOpen && window.dcOpen()", timeout=60_000)
        page.evaluate("window.steer('a blue ball moving left')")
        page.wait_for_function("window.acks.length > 0", timeout=60_000)
        ack = page.evaluate("window.acks[0]")
        deadline = time.monotonic() + 120  # the video's end, then the last frames' arrival
        while http.get(f"{url}/v1/videos/{vid}", timeout=10).json()["status"] == "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.5)
        last, stats = None, None
        while stats is None or stats != last:  # until framesDecoded stops growing
            last, stats = stats, page.evaluate("window.stats()")
            page.wait_for_timeout(1500)
        gone = http.delete(url + signal["location"], timeout=10)
        browser.close()
    assert signal["status"] == 201 and signal["location"].startswith(f"/v1/videos/{vid}/whep/"), signal
    assert (stats["width"], stats["height"]) == (128, 64), repr(stats)
    # the encoder's own H.264, offered only in packetization mode 1: no VP8, nothing re-encoded
    assert "H264/90000" in answer and "VP8" not in answer and "packetization-mode=0" not in answer
    # every frame from the block it joined at to the end: received, and decoded but for those
    # the headless page's renderer dropped at their display deadline (framesDropped)
    expected = 8 * 16 - int(signal["start"])
    assert stats["received"] == stats["frames"] + stats["dropped"] == expected, repr((stats, signal))
    assert stats["frames"] >= expected * 0.8 and stats["keyframes"] >= 1, repr(stats)
    assert ack["type"] == "session.prompt_updated" and ack["scene"] == 1 and ack["start_frame"] > 0, ack
    assert gone.status_code == 404  # the video's end freed the viewer already: nothing left to DELETE


def test_whep_refuses_what_is_not_an_offer_for_a_live_video(daemon):
    url = daemon.url
    vid = http.post(url + "/v1/videos", json={"prompt": "x", "live": True, "seconds": 4, "size": "128x64"}).json()["id"]
    sdp = {"Content-Type": "application/sdp"}
    try:
        cases = [
            (http.post(f"{url}/v1/videos/{vid}/whep", content=b"hello", headers=sdp), 400, "invalid_sdp"),
            (
                http.post(
                    f"{url}/v1/videos/{vid}/whep", content=b"v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n", headers=sdp
                ),
                400,
                "invalid_sdp",
            ),
            (
                http.post(
                    f"{url}/v1/videos/{vid}/whep",
                    content=b"v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=rtpmap:96 VP8/90000\r\n",
                    headers=sdp,
                ),
                406,
                "unsupported_codec",
            ),
            (http.post(f"{url}/v1/videos/{vid}/whep", json={"sdp": "v=0"}), 415, None),
            (http.post(f"{url}/v1/videos/video_nope_local/whep", content=b"v=0", headers=sdp), 404, None),
            (http.delete(f"{url}/v1/videos/{vid}/whep/nosuch"), 404, None),
        ]
    finally:
        http.post(f"{url}/v1/videos/{vid}/stop", timeout=10)
    for r, status, code in cases:
        assert r.status_code == status and (code is None or r.json()["error"]["code"] == code), r.text
    deadline = time.monotonic() + 60
    while http.get(f"{url}/v1/videos/{vid}").json()["status"] == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    done = http.post(f"{url}/v1/videos/{vid}/whep", content=b"v=0\r\nm=video 9\r\n", headers=sdp)
    assert done.status_code == 409 and daemon.health()["status"] == "ok"


@pytest.mark.timeout(300)
def test_page_low_latency_mode_plays_over_webrtc_and_steers_on_the_data_channel(daemon):
    """The page's low-latency mode, through its form: a live video watched over WHEP (Chromium's
    own ICE, mDNS-hidden host candidates and all), steered from the form over the data channel,
    acknowledged with the frame where the scene lands, then stopped."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser, page, console = open_player(p, daemon.url)
        page.fill("#size", "128x64")
        page.fill("#seconds", "20")
        page.check("#live")
        page.check("#lowlatency")
        page.click("#start")
        page.wait_for_function("window.player.rtc && window.player.rtc.frames > 16", timeout=60_000)
        page.fill("#steer-prompt", "a green ball moving left")
        page.click("#steer")
        page.wait_for_function("window.player.steers.length > 0", timeout=60_000)
        page.click("#stop")
        page.wait_for_function("window.player.state === 'complete'", timeout=120_000)
        state = page.evaluate(
            "({...window.player, rtc: null, scenes: null, steerText: document.getElementById('steers').textContent})"
        )
        browser.close()
    ack = state["steers"][0]
    assert ack["type"] == "session.prompt_updated" and ack["scene"] == 1 and ack["start_frame"] > 0, ack
    assert "a green ball moving left" in state["steerText"] and state["frames"] > 16, state
    assert state["mediaErrors"] == [] and state["firstFrameMs"] is not None, (state, console)
