"""Fuzzed request bodies (hypothesis): never a 500, never a crash, always OpenAI's envelope."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamdiff.server.api import KNOWN_FIELDS, SCENE_FIELDS

from ..helpers import Daemon, http

FIELDS = sorted(KNOWN_FIELDS)  # the API's own field names, so the fuzzer reaches every branch
SCENE_KEYS = sorted(SCENE_FIELDS)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.sampled_from(["128x64", "64x64", "0x0", "x", "cut", "continue", "tiny", "4", "-1", "1e9", "NaN", "true"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
scene = st.dictionaries(st.sampled_from(SCENE_KEYS + ["bogus"]), json_values, max_size=5)
bodies = st.dictionaries(
    st.sampled_from(FIELDS + ["", "colour", "prompt "]), st.one_of(json_values, st.lists(scene, max_size=5)), max_size=8
)


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("fuzz") / "c.toml"
    cfg.write_text(
        "[limits]\nmax_frames = 16\nmax_width = 128\nmax_height = 64\nmax_queue = 64\n"
        "max_scenes = 4\nmax_prompt_chars = 64\n"
    )
    daemon = Daemon("--config", str(cfg))
    yield daemon
    daemon.stop()


def check(d: Daemon, r: httpx.Response) -> None:
    assert r.status_code in (200, 400, 404, 408, 413, 415, 429), (r.status_code, r.text)
    if r.status_code == 200:
        http.delete(f"{d.url}/v1/videos/{r.json()['id']}", timeout=30)  # keep the machine free
    else:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_fuzzed_json_bodies(d, body):
    check(
        d,
        http.post(
            d.url + "/v1/videos",
            content=json.dumps(body, allow_nan=True),
            headers={"Content-Type": "application/json"},
            timeout=30,
        ),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    raw=st.binary(max_size=300),
    ctype=st.sampled_from(
        [
            "application/json",
            "text/plain",
            "application/xml",
            "multipart/form-data",
            "application/x-www-form-urlencoded",
            "",
            "application/json; charset=latin-1",
        ]
    ),
)
def test_fuzzed_raw_bodies_and_content_types(d, raw, ctype):
    check(d, http.post(d.url + "/v1/videos", content=raw, headers={"Content-Type": ctype} if ctype else {}, timeout=30))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(form=st.dictionaries(st.sampled_from(FIELDS), st.text(max_size=30), max_size=6))
def test_fuzzed_multipart_forms(d, form):
    check(
        d,
        http.post(d.url + "/v1/videos", files={k: (None, v) for k, v in form.items()} or {"x": (None, "")}, timeout=30),
    )


def test_no_server_errors_and_still_healthy(d):
    for size in (300_000, 2_000_000):
        r = http.post(
            d.url + "/v1/videos",
            content=b"{" + b" " * size + b"}",
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    metrics = http.get(d.url + "/metrics").text
    assert 'streamdiff_http_requests_total{status="5xx"}' not in metrics, metrics
    assert d.health()["status"] == "ok"
