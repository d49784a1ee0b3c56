"""uvicorn's h11 connection with a deadline on request headers: a client must finish a
request's headers within `header_timeout_s` of connecting (or of its previous response),
else the connection is closed. uvicorn alone waits for a trickle of header lines forever
(its keep-alive timeout restarts with every byte)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for uvicorn's `http=` setting."""

    class HeaderDeadlineH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if not self._awaiting_headers():
                self._disarm()  # a request's headers are in: the app's timeouts apply now

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineH11
