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
import contextvars
import ipaddress
import json
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field
from fractions import Fraction

from aiohttp import web

from ..config import ServerConfig
from ..media.cmaf import annexb_access_unit, fragment_samples, init_parameter_sets
from .api import APIError, bad
from .jobs import Job
from .realtime import STEERING, client_event

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
                    self.stop()  # "ended": its peer is closed (WHEP._watch)
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


INBOX = 16  # data-channel messages waiting for their answer; more are answered with an error


@dataclass
class Peer:
    """One WHEP viewer: its connection, its track, and what its watcher waits on."""

    video_id: str
    pc: object  # aiortc.RTCPeerConnection
    track: object
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # failed, closed, or its video ended
    inbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(INBOX))
    tasks: list[asyncio.Task] = field(default_factory=list)


class WHEP:
    """The handlers of /v1/videos/{id}/whep, given how to find a job and steer it."""

    def __init__(self, get_job, steer, server: ServerConfig) -> None:
        self.get_job, self.steer, self.server = get_job, steer, server
        self.peers: dict[str, Peer] = {}  # resource id -> its viewer
        self.addresses = host_addresses(server)
        _filter_host_addresses()

    def routes(self, prefix: str) -> list[web.RouteDef]:
        base = f"{prefix}/videos/{{video_id}}/whep"
        return [web.post(base, self.offer), web.delete(f"{base}/{{session}}", self.leave)]

    async def offer(self, request: web.Request) -> web.Response:
        job = self.get_job(request)
        if job.finished or job.expired:
            raise APIError(409, f"video '{job.id}' has {job.state}: WHEP plays a video while it is made", "video_id")
        if request.content_type != "application/sdp":
            raise APIError(415, f"a WHEP offer is application/sdp, not {request.content_type!r}", None)
        self._check_caps(job)
        sdp = await self._read_offer(request)
        self._check_caps(job)  # others may have joined while it arrived
        pc, track, answer = await self._connect(job, sdp)
        sid = secrets.token_hex(8)
        peer = self.peers[sid] = Peer(job.id, pc, track)
        self._watch_peer(sid, peer, job)
        log.info("job %s: WHEP viewer %s", job.id, sid)
        start = sum(job.fragment_frames[: track.next])  # the first frame this viewer gets
        return web.Response(
            status=201,
            text=answer,
            content_type="application/sdp",
            headers={"Location": f"{request.path}/{sid}", "X-Start-Frame": str(start)},
        )

    def _check_caps(self, job: Job) -> None:
        s = self.server
        if len(self.peers) >= s.webrtc_max_peers:
            raise APIError(
                503,
                f"this server has {len(self.peers)} WHEP viewers, its limit (server.webrtc_max_peers = "
                f"{s.webrtc_max_peers}); retry later",
                None,
                "too_many_viewers",
                "server_error",
                {"Retry-After": "5"},
            )
        mine = sum(p.video_id == job.id for p in self.peers.values())
        if mine >= s.webrtc_max_peers_per_video:
            raise APIError(
                429,
                f"video '{job.id}' has {mine} WHEP viewers, its limit (server.webrtc_max_peers_per_video = "
                f"{s.webrtc_max_peers_per_video}); watch it over HLS instead",
                None,
                "too_many_viewers",
                "rate_limit_error",
                {"Retry-After": "5"},
            )

    async def _read_offer(self, request: web.Request) -> str:
        """The offer's text: within max_body_bytes (413), UTF-8 (400), an SDP offer with video and
        at most webrtc_max_candidates candidates (400). All of it checked before anything parses it."""
        limit = self.server.max_body_bytes
        charset = (request.charset or "utf-8").lower()
        if charset not in ("utf-8", "utf8", "us-ascii", "ascii"):
            raise bad(f"a WHEP offer is UTF-8 text, not charset {request.charset!r}", None, "invalid_charset")
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        raw = bytearray()
        try:
            async with asyncio.timeout(self.server.request_read_timeout_s):
                async for chunk in request.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > limit:
                        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
        except TimeoutError:
            raise APIError(
                408, f"the offer did not arrive within {self.server.request_read_timeout_s:g}s", None, "request_timeout"
            ) from None
        try:
            sdp = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad(f"the offer is not UTF-8 text: {exc}", None, "invalid_charset") from None
        if not sdp.startswith("v=0") or "\nm=" not in sdp:
            raise bad("the body is not an SDP offer", None, "invalid_sdp")
        candidates = sdp.count("\na=candidate")
        if candidates > self.server.webrtc_max_candidates:
            raise bad(
                f"the offer has {candidates} ICE candidates; the limit is {self.server.webrtc_max_candidates} "
                "(server.webrtc_max_candidates)",
                None,
                "too_many_candidates",
            )
        return sdp

    async def _connect(self, job: Job, sdp: str):
        """A peer connection answering `sdp`: (pc, track, answer), or APIError with the peer closed."""
        from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
        from aiortc.exceptions import OperationError
        from aiortc.rtcrtpsender import RTCRtpSender
        from aiortc.sdp import SessionDescription

        try:
            parsed = SessionDescription.parse(sdp)
        except Exception as exc:  # aiortc's parser raises what its code meets: KeyError, IndexError, ...
            raise bad(f"the SDP offer does not parse: {_why(exc)}", None, "invalid_sdp") from None
        video = [m for m in parsed.media if m.kind == "video"]
        if not video:
            raise bad("the offer has no video", None, "invalid_sdp")
        if not any(c.mimeType.lower() == "video/h264" and str(c.parameters.get("packetization-mode")) == "1"
                   for m in video for c in m.rtp.codecs):  # fmt: skip
            raise _no_codec("the offer has no H.264 in packetization mode 1")
        ice = [RTCIceServer(urls=u) for u in self.server.webrtc_ice_servers]
        pc = RTCPeerConnection(RTCConfiguration(iceServers=ice))
        try:
            track = make_track(job, job.request.fps)
            # H.264 only, offered before the offer is read: the answer's codecs are fixed there
            sender = pc.addTransceiver(track, direction="sendonly")
            h264 = [c for c in RTCRtpSender.getCapabilities("video").codecs if c.mimeType == "video/H264"]
            sender.setCodecPreferences([c for c in h264 if c.parameters.get("packetization-mode") == "1"])
            try:
                await pc.setRemoteDescription(RTCSessionDescription(sdp, "offer"))
            except OperationError as exc:  # no codec in common with what the track sends
                raise _no_codec(f"the offer's codecs are not this track's ({exc})") from None
            except Exception as exc:
                raise bad(f"the SDP offer is refused: {_why(exc)}", None, "invalid_sdp") from None
            token = _HOST_ADDRESSES.set(self.addresses)
            try:
                await pc.setLocalDescription(await pc.createAnswer())  # gathers the candidates
            finally:
                _HOST_ADDRESSES.reset(token)
            return pc, track, pc.localDescription.sdp
        except BaseException:
            await pc.close()
            raise

    def _watch_peer(self, sid: str, peer: Peer, job: Job) -> None:
        pc = peer.pc

        @pc.on("datachannel")
        def on_channel(channel) -> None:
            @channel.on("message")
            def on_message(message) -> None:
                try:
                    peer.inbox.put_nowait((channel, message))
                except asyncio.QueueFull:
                    _reply(channel, _error(f"more than {INBOX} control messages wait for their answers", "flood"))

        @pc.on("connectionstatechange")
        def on_state() -> None:
            if pc.connectionState == "connected":
                peer.connected.set()
            elif pc.connectionState in ("failed", "closed"):
                peer.ended.set()

        peer.track.on("ended", peer.ended.set)
        peer.tasks = [
            asyncio.create_task(self._watch(sid, peer), name=f"whep-{sid}"),
            asyncio.create_task(self._answer(job, peer), name=f"whep-{sid}-control"),
        ]

    async def _watch(self, sid: str, peer: Peer) -> None:
        """Closes the peer when it does not connect in time, or once it has ended."""
        timeout = self.server.webrtc_connect_timeout_s
        try:
            await asyncio.wait_for(peer.connected.wait(), timeout)
        except TimeoutError:
            log.info("WHEP viewer %s did not connect within %gs (server.webrtc_connect_timeout_s)", sid, timeout)
        else:
            await peer.ended.wait()
        await self._close(sid)

    async def _answer(self, job: Job, peer: Peer) -> None:
        """The data channel's steering events, in their order, each answered there (as on the
        WebSocket): a bad one gets an `error` event and the rest go on."""
        while True:
            channel, message = await peer.inbox.get()
            try:
                if not isinstance(message, str):
                    raise bad("a control message is text: a JSON object", None, "invalid_body")
                event = client_event(message, self.server)
                if event.get("type") not in STEERING:
                    raise bad(f"a control message is a JSON object of type {' | '.join(STEERING)}", "type")
                reply = await self.steer(job, event)
            except APIError as err:
                reply = _error(err.message, err.code, err.param)
            except Exception:
                log.exception("job %s: a WHEP control message failed", job.id)
                reply = _error("internal error", "internal_error")
            _reply(channel, reply)

    async def leave(self, request: web.Request) -> web.Response:
        sid = request.match_info["session"]
        peer = self.peers.get(sid)
        if peer is None or peer.video_id != request.match_info["video_id"]:
            raise APIError(404, f"no WHEP session {sid!r} of this video", "session")
        await self._close(sid)
        return web.Response(status=200)

    async def _close(self, sid: str) -> None:
        peer = self.peers.pop(sid, None)
        if peer is None:
            return
        log.info("WHEP viewer %s leaves", sid)
        me = asyncio.current_task()
        for t in peer.tasks:
            if t is not me:
                t.cancel()
        peer.track.stop()
        await peer.pc.close()

    async def close_all(self) -> None:
        for sid in list(self.peers):
            await self._close(sid)


def _no_codec(why: str) -> APIError:
    return APIError(
        406,
        f"{why}: this server sends its encoder's H.264 (constrained baseline, packetization mode 1) as is, "
        "and re-encoding to another codec is not built",
        None,
        "unsupported_codec",
    )


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error(message: str, code: str, param: str | None = None) -> dict:
    return {"type": "error", "message": message, "code": code, "param": param}


def _reply(channel, event: dict) -> None:
    if channel.readyState == "open":
        channel.send(json.dumps(event))


# ----------------------------------------------------------------------------- host candidates

_HOST_ADDRESSES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("whep_hosts", default=None)


def host_addresses(server: ServerConfig) -> tuple[str, ...] | None:
    """The addresses a WHEP peer offers host candidates on: server.webrtc_host_addresses where
    given, else the listening address's (None, every interface, where it listens on all)."""
    if server.webrtc_host_addresses:
        return tuple(server.webrtc_host_addresses)
    host = server.host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return None
    try:
        return (str(ipaddress.ip_address(host)),)
    except ValueError:  # a name: its addresses
        return tuple(sorted({a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)}))


def _filter_host_addresses() -> None:
    """aioice gathers host candidates on every interface but loopback (`aioice.ice.
    get_host_addresses`), and neither it nor aiortc takes the addresses to use. Wrapped once, it
    answers with the addresses of the gathering peer's context (`_HOST_ADDRESSES`, set around
    its setLocalDescription); with none set, with aioice's own."""
    import aioice.ice

    original = aioice.ice.get_host_addresses
    if getattr(original, "streamdiff", False):
        return

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        chosen = _HOST_ADDRESSES.get()
        if chosen is None:
            return original(use_ipv4, use_ipv6)
        return [a for a in chosen if (use_ipv6 if ":" in a else use_ipv4)]

    get_host_addresses.streamdiff = True
    aioice.ice.get_host_addresses = get_host_addresses
