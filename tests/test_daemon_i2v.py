"""Image-to-video end to end: streamdiffd serving the `causal-forcing-framewise` preset on a tiny
Wan release (diffusers layout) and a Causal Forcing checkpoint takes `input_reference` as a
multipart file, a JSON data URL and through the official `openai` SDK; the video has exactly the
frames asked for and starts from the image through the Wan VAE (encode, decode); bad images are
refused with 400s and the daemon goes on streaming."""

from __future__ import annotations

import base64
import io
import struct
import time
import warnings
import zlib

import numpy as np
import pytest
import torch

from .helpers import Daemon, decode, ffprobe, http

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from streamdiff.config import Config, LimitsConfig  # noqa: E402
from streamdiff.models.spec import preset_card  # noqa: E402
from streamdiff.server.api import APIError, parse_video_request, prepare_image  # noqa: E402

from .published import write_base, write_published  # noqa: E402

SIZE = (64, 64)


def picture(w: int = 96, h: int = 80) -> bytes:
    """A PNG with structure (gradients and a square), not the video's aspect: it is cropped."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // w, y * 255 // h, ((x // 8 + y // 8) % 2) * 200], axis=-1).astype(np.uint8)
    img[20:50, 30:60] = (250, 30, 30)
    out = io.BytesIO()
    Image.fromarray(img).save(out, "PNG")
    return out.getvalue()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("i2v")
    base = write_base(root)
    return base, write_published("causal-forcing-framewise", root, base)


@pytest.fixture(scope="module")
def round_trip(release):
    """The prepared image through diffusers' VAE: encode (mean of the latent distribution), decode."""
    base, _ = release
    png, _ = prepare_image(picture(), *SIZE, LimitsConfig())
    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    vae = diffusers.AutoencoderKLWan.from_pretrained(str(base / "vae")).eval()
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    with torch.no_grad():
        mu = vae.encode(x).latent_dist.mean
        y = vae.decode(mu).sample.clamp(-1, 1)
    frame = ((y[0, :, 0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    return img, mu, vae, frame


def test_engines_first_frame_is_the_image_through_the_vae(release, round_trip):
    """In process, before H.264: the DiT engine's first block is the encoded image (diffusers'
    normalised mean), and the VAE engine decodes it to the round trip within 40 dB."""
    from streamdiff.models.engines import DiTEngine, VAEEngine
    from streamdiff.models.spec import ModelSpec

    base, pub = release
    spec = ModelSpec(preset="causal-forcing-framewise", path=str(base), dit_checkpoint=str(pub.files["checkpoint"]))
    dit, vae = DiTEngine(spec), VAEEngine(spec)
    img, mu, ref, frame = round_trip
    sess = dit.open_session(*SIZE, seed=3)
    # two blocks: the image, then one noise frame; the worker passes the F - 1 drawn (DiTStage.run_batch)
    dit.set_scene(sess, "a red square", new_shot=True, shot_left=1)
    assert sess.shot_noise.shape[1] == 1
    z = dit.start_image(sess, torch.from_numpy(img.copy()))
    mean = torch.tensor(ref.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(ref.config.latents_std).view(1, -1, 1, 1, 1)
    assert (z - (mu - mean) / std).abs().max().item() < 1e-5
    assert sess.state.next_frame == 1 and sess.shot_blocks == 0  # next: position 1, the first block's steps
    vs = vae.open_session()
    first = vae.decode_block(vs, z).numpy()
    assert first.shape == (1, SIZE[1], SIZE[0], 3)
    assert psnr(first[0], frame) >= 40
    nxt = dit.generate_block(sess, 1)
    assert nxt.shape == z.shape and sess.state.next_frame == 2
    assert vae.decode_block(vs, nxt).shape[0] == 4


@pytest.fixture(scope="module")
def daemon(release):
    _, pub = release
    d = Daemon(*pub.flags, "--size", "x".join(map(str, SIZE)))
    yield d
    assert d.stop() == 0, d.logs()


def stream_multipart(url: str, fields: dict, image: tuple) -> tuple[int, bytes]:
    form = {k: str(v) for k, v in {**fields, "stream": "true"}.items()}
    with http.stream("POST", url + "/v1/videos", data=form, files={"input_reference": image}, timeout=300) as r:
        return r.status_code, r.read()


def test_multipart_image_streams_exact_frames_from_the_image(daemon, round_trip):
    status, data = stream_multipart(
        daemon.url, {"prompt": "a red square", "num_frames": 9, "seed": 3}, ("in.png", picture(), "image/png")
    )
    assert status == 200, data[:500]
    probe = ffprobe(data)
    if probe is not None:
        assert probe["frames"] == 9
    info = decode(data)
    assert info["frames"] == 9 and (info["width"], info["height"]) == SIZE
    assert psnr(info["pixels"][0], round_trip[3]) >= 25  # after H.264: loosely


def test_json_data_url_and_the_video_object_says_it_was_used(daemon):
    url = "data:image/png;base64," + base64.b64encode(picture(64, 128)).decode()
    r = http.post(daemon.url + "/v1/videos", json={"prompt": "a tall picture", "num_frames": 5, "input_reference": url})
    assert r.status_code == 200, r.text
    ref = r.json()["input_reference"]
    assert ref["format"] == "png" and (ref["width"], ref["height"]) == (64, 128) and ref["crop"] == [0, 32, 64, 64]
    vid = r.json()["id"]
    for _ in range(600):
        v = http.get(f"{daemon.url}/v1/videos/{vid}").json()
        if v["status"] in ("completed", "failed"):
            break
        time.sleep(0.1)
    assert v["status"] == "completed", v
    assert decode(http.get(f"{daemon.url}/v1/videos/{vid}/content").content)["frames"] == 5


def test_openai_sdk_input_reference(daemon):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create_and_poll(
            prompt="a red square drifts",
            seconds="1",
            size="64x64",
            input_reference=("in.png", picture(), "image/png"),
            poll_interval_ms=100,
        )
        assert video.status == "completed", video
        content = client.videos.download_content(video.id, variant="video").read()
    assert decode(content)["frames"] == 16


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


ZERO_PNG = (
    b"\x89PNG\r\n\x1a\n"
    + _chunk(b"IHDR", struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0))
    + _chunk(b"IDAT", zlib.compress(b""))
    + _chunk(b"IEND", b"")
)
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><rect width="64" height="64"/></svg>'


@pytest.mark.parametrize(
    "name,body,ctype,code",
    [
        ("truncated", None, "image/png", "invalid_image"),
        ("zero", ZERO_PNG, "image/png", "invalid_image"),
        ("huge", b"\x89PNG\r\n\x1a\n" + bytes(50 * 2**20), "image/png", "image_too_large"),
        ("svg", SVG, "image/svg+xml", "invalid_image"),
    ],
)
def test_bad_images_get_400_and_the_next_request_streams(daemon, name, body, ctype, code):
    if body is None:
        whole = picture(256, 256)
        body = whole[: len(whole) // 2]
    status, data = stream_multipart(daemon.url, {"prompt": "x", "num_frames": 1}, (f"{name}.img", body, ctype))
    assert status == 400, data[:300]
    err = __import__("json").loads(data)["error"]
    assert err["param"] == "input_reference" and err["code"] == code, err
    status, data = stream_multipart(
        daemon.url, {"prompt": "after", "num_frames": 5}, ("ok.png", picture(), "image/png")
    )
    assert status == 200 and decode(data)["frames"] == 5


def test_a_model_without_image_conditioning_refuses_it():
    card = preset_card("self-forcing")
    with pytest.raises(APIError) as exc:
        parse_video_request({"prompt": "x", "input_reference": "data:image/png;base64,AAAA"}, Config(), card)
    assert exc.value.status == 400 and "does not condition on an image" in exc.value.message
