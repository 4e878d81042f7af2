"""WebRTC egress signalled by WHEP, for the one at the controls (supervisor process).

`POST /v1/videos/{id}/whep` takes an SDP offer and answers with an SDP answer (201, a Location
to DELETE when the viewer leaves): a peer connection (aiortc) that sends the video's H.264 as
the encoder made it, without a second encode, RTP packetization mode 1, from the newest block
(every block starts with an IDR, so a viewer joins at any block) at the video's frame rate. An
offer without H.264 in packetization mode 1 is refused (406): re-encoding to another codec is
not built. A data channel the viewer opens carries the WebSocket's steering events
(`session.prompt_update`, `session.interaction`) and their acknowledgements, so one connection
is enough. ICE uses host candidates; STUN and TURN servers come from `[server]` only, so
nothing reaches out by default. Like an HLS viewer, a WHEP viewer reads the job's bytes and
never paces the video.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from fractions import Fraction

from aiohttp import web

from ..media.cmaf import annexb_access_unit, fragment_samples, init_parameter_sets
from .api import APIError, bad
from .jobs import Job
from .realtime import STEERING

log = logging.getLogger("streamdiff.whep")
RTP_CLOCK = 90000
# How much faster than the frame rate a viewer behind its frames' times catches up (the frames due
# during its handshake). At once, the burst reads to the receiver's jitter buffer as a second of
# jitter: measured in Chromium, its delay then settled at 0.5-0.6 s for the rest of the stream.
CATCH_UP = 2.0


def make_track(job: Job, fps: int):
    """The video track: the job's access units from its newest fragment on, paced at `fps` from
    the time that fragment was here. Not from the first send: the handshake between the offer
    and the first packet (ICE, DTLS: about a second) would otherwise stay in every frame's
    latency for the life of the stream. The frames made meanwhile catch up at CATCH_UP x the
    frame rate, and from then on each leaves as its time comes (or as it is made, where
    generation falls behind)."""
    import av
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

    class FragmentTrack(MediaStreamTrack):
        kind = "video"

        def __init__(self) -> None:
            super().__init__()
            self.next = max(0, len(job.fragment_frames) - 1)  # the newest block: it starts with an IDR
            self.queue: list[bytes] = []
            self.sets: tuple[bytes, bytes] | None = None
            self.frame, self.t0, self.sent = 0, None, None

        async def recv(self):
            while not self.queue:
                if job.expired or self.readyState != "live":
                    raise MediaStreamError
                if self.next < len(job.fragment_frames):
                    self.sets = self.sets or init_parameter_sets(job.chunks[0])
                    samples = fragment_samples(job.fragment(self.next))
                    self.queue = [annexb_access_unit(s, *self.sets) for s in samples]
                    self.next += 1
                elif job.finished:
                    self.stop()
                    raise MediaStreamError
                else:
                    await job.changed()
            if self.t0 is None:  # the start block's arrival: frames are due at its pace from then
                self.t0 = job.fragment_times[self.next - 1] if job.fragment_times else time.monotonic()
            due = self.t0 + self.frame / fps
            if self.sent is not None:  # frames behind their time catch up at CATCH_UP x, not at once
                due = max(due, self.sent + 1 / (CATCH_UP * fps))
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.sent = time.monotonic()
            packet = av.Packet(self.queue.pop(0))
            packet.pts, packet.time_base = round(self.frame * RTP_CLOCK / fps), Fraction(1, RTP_CLOCK)
            self.frame += 1
            return packet

    return FragmentTrack()


class WHEP:
    """The handlers of /v1/videos/{id}/whep, given how to find a job and steer it."""

    def __init__(self, get_job, steer, ice_servers: tuple[str, ...]) -> None:
        self.get_job, self.steer, self.ice_servers = get_job, steer, ice_servers
        self.sessions: dict[str, tuple[str, object]] = {}  # resource id -> (video id, peer connection)

    def routes(self, prefix: str) -> list[web.RouteDef]:
        base = f"{prefix}/videos/{{video_id}}/whep"
        return [web.post(base, self.offer), web.delete(f"{base}/{{session}}", self.leave)]

    async def offer(self, request: web.Request) -> web.Response:
        from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
        from aiortc.rtcrtpsender import RTCRtpSender

        job = self.get_job(request)
        if job.finished or job.expired:
            raise APIError(409, f"video '{job.id}' has {job.state}: WHEP plays a video while it is made", "video_id")
        if request.content_type != "application/sdp":
            raise APIError(415, f"a WHEP offer is application/sdp, not {request.content_type!r}", None)
        sdp = await request.text()
        if not sdp.startswith("v=0") or "\nm=" not in sdp:
            raise bad("the body is not an SDP offer", None, "invalid_sdp")
        if "\nm=video" not in sdp:
            raise bad("the offer has no video", None, "invalid_sdp")
        if "H264/90000" not in sdp or "packetization-mode=1" not in sdp:
            raise APIError(
                406,
                "the offer has no H.264 in packetization mode 1: this server sends its encoder's H.264 as is, "
                "and re-encoding to another codec is not built",
                None,
                "unsupported_codec",
            )
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[RTCIceServer(urls=u) for u in self.ice_servers]))
        track = make_track(job, job.request.fps)
        # H.264 only, offered before the offer is read: the answer's codecs are fixed there
        video = pc.addTransceiver(track, direction="sendonly")
        h264 = [c for c in RTCRtpSender.getCapabilities("video").codecs if c.mimeType == "video/H264"]
        video.setCodecPreferences([c for c in h264 if c.parameters.get("packetization-mode") == "1"])
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp, "offer"))
        except ValueError as exc:
            await pc.close()
            raise bad(f"the SDP offer is refused: {exc}", None, "invalid_sdp") from None
        sid = secrets.token_hex(8)

        @pc.on("datachannel")
        def on_channel(channel) -> None:
            @channel.on("message")
            def on_message(message) -> None:
                asyncio.ensure_future(self._control(job, channel, message))

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                await self._close(sid)

        await pc.setLocalDescription(await pc.createAnswer())  # gathers the candidates
        self.sessions[sid] = (job.id, pc)
        log.info("job %s: WHEP viewer %s", job.id, sid)
        location = f"{request.path}/{sid}"
        start = sum(job.fragment_frames[: track.next])  # the first frame this viewer gets
        return web.Response(
            status=201,
            text=pc.localDescription.sdp,
            content_type="application/sdp",
            headers={"Location": location, "X-Start-Frame": str(start)},
        )

    async def _control(self, job: Job, channel, message) -> None:
        """A steering event on the data channel, answered there (as on the WebSocket)."""
        try:
            event = json.loads(message) if isinstance(message, str) else None
            if not isinstance(event, dict) or event.get("type") not in STEERING:
                raise bad(f"a control message is a JSON object of type {' | '.join(STEERING)}", "type")
            reply = await self.steer(job, event)
        except APIError as err:
            reply = {"type": "error", "message": err.message, "code": err.code, "param": err.param}
        except json.JSONDecodeError:
            reply = {"type": "error", "message": "a control message is JSON", "code": "invalid_json", "param": None}
        if channel.readyState == "open":
            channel.send(json.dumps(reply))

    async def leave(self, request: web.Request) -> web.Response:
        sid = request.match_info["session"]
        held = self.sessions.get(sid)
        if held is None or held[0] != request.match_info["video_id"]:
            raise APIError(404, f"no WHEP session {sid!r} of this video", "session")
        await self._close(sid)
        return web.Response(status=200)

    async def _close(self, sid: str) -> None:
        held = self.sessions.pop(sid, None)
        if held is not None:
            log.info("WHEP viewer %s leaves", sid)
            await held[1].close()

    async def close_all(self) -> None:
        for sid in list(self.sessions):
            await self._close(sid)
