"""SIGTERM drain with a deadline that ends every request properly.

uvicorn drains by waiting for open connections and, past ``timeout_graceful_shutdown``,
cancels their tasks: a stream is then cut without an error event or ``[DONE]`` and a
non-streaming request gets a bare 500. Here the deadline belongs to us:

    SIGTERM ──> stop accepting ──> requests finish ... ──> --shutdown-timeout reached:
                                                          fail the rest with
                                                          ServerShutdownError
                                  streams: error event + [DONE]; others: 503 envelope
                                  ──> DRAIN_GRACE_S later uvicorn's own deadline cancels
                                      whatever still hangs (nothing, normally)
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn

DRAIN_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` that calls ``on_drain_timeout`` ``drain_timeout_s`` after the
    shutdown starts, while responses can still be written."""

    def __init__(
        self, config: uvicorn.Config, drain_timeout_s: float, on_drain_timeout: Callable[[], None]
    ) -> None:
        config.timeout_graceful_shutdown = drain_timeout_s + DRAIN_GRACE_S
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.on_drain_timeout = on_drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.drain_timeout_s, self.on_drain_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
