"""Request validation in-process (server/api.py `parse_video_request`): every bad body gets the
status and the parameter its OpenAI error envelope names. tests/test_daemon_stream.py sends the
same bodies over HTTP to a daemon."""

from __future__ import annotations

import pytest

from streamdiff.config import Config
from streamdiff.server.api import APIError, parse_video_request
from streamdiff.supervisor.topology import model_card

BAD_REQUESTS = [
    ({"prompt": "x", "size": "257x144"}, 400, "size"),
    ({"prompt": "x", "size": "4096x4096"}, 400, "size"),
    ({"prompt": "x", "size": "big"}, 400, "size"),
    ({"prompt": "x", "seconds": -1}, 400, "seconds"),
    ({"prompt": "x", "seconds": 1e9}, 400, "seconds"),
    ({"prompt": "x", "num_frames": 0}, 400, "num_frames"),
    ({"prompt": "x", "num_frames": 10**7}, 400, "num_frames"),
    ({"prompt": "   "}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x" * 5000}, 400, "prompt"),
    ({"scenes": [{"prompt": "s", "num_frames": 5}] * 40}, 400, "scenes"),
    ({"scenes": []}, 400, "scenes"),
    ({"scenes": [{"prompt": "a", "num_frames": 5, "transition": "dissolve"}]}, 400, "scenes[0].transition"),
    ({"prompt": "x", "fps": 0}, 400, "fps"),
    ({"prompt": "x", "fps": 1000}, 400, "fps"),
    ({"prompt": "x", "seed": -3}, 400, "seed"),
    ({"prompt": "x", "stream": "yes please"}, 400, "stream"),
    ({"prompt": "x", "colour": "red"}, 400, "colour"),
    ({"prompt": "x", "model": "sora-2"}, 404, "model"),
    ({"prompt": "x", "negative_prompt": "blurry"}, 400, "negative_prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_invalid_requests_are_refused_naming_the_parameter(body, status, param):
    cfg = Config()
    with pytest.raises(APIError) as exc:
        parse_video_request(body, cfg, model_card(cfg))
    err = exc.value.body()["error"]
    assert exc.value.status == status and err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"


def test_a_good_request_is_its_scenes_and_size():
    cfg = Config()
    req = parse_video_request({"prompt": "a red fox", "num_frames": 33, "size": "128x64"}, cfg, model_card(cfg))
    assert (req.frames, req.width, req.height, req.prompt) == (33, 128, 64, "a red fox")
