"""systemd notification protocol (supervisor process): READY=1, WATCHDOG=1, STOPPING=1, STATUS=.

Written against sd_notify(3): one datagram per message to the AF_UNIX socket named by
$NOTIFY_SOCKET (a leading '@' means the abstract namespace). A no-op when not under systemd.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self.address else None

    @property
    def enabled(self) -> bool:
        return self.sock is not None

    def notify(self, *fields: str) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendto("\n".join(fields).encode(), self.address)
        except OSError:
            pass

    def ready(self, status: str = "") -> None:
        self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def stopping(self, status: str = "") -> None:
        self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    @staticmethod
    def watchdog_interval_s() -> float | None:
        """Half of systemd's WatchdogSec (WATCHDOG_USEC), if it is meant for this process."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        return int(usec) / 2e6
