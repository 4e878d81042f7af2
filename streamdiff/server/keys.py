"""What the aiohttp application holds (supervisor process), shared by the HTTP and WebSocket
handlers."""

from __future__ import annotations

from aiohttp import web

from ..config import Config
from ..supervisor.core import Supervisor
from .jobs import JobStore

SUPERVISOR = web.AppKey("supervisor", Supervisor)
JOBS = web.AppKey("jobs", JobStore)
CONFIG = web.AppKey("config", Config)
API_KEYS = web.AppKey("api_keys", list)
STORE = web.AppKey("store", object)  # VideoStore | None
