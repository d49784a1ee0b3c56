"""A loopback TCP proxy that makes a healthy server slow: requests go through at full speed
(or at `request_rate` bytes per second: a slow write), replies at `rate` bytes per second
(None: full speed) after `delay_s` per chunk, so a real redis-server can be made to trickle
(alive, answering, never silent for a socket timeout) or to stall. Rates and delay may change
while it runs (a store that recovers). Test helper: one thread per direction per connection,
all closed with the proxy."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

CHUNK = 1024  # bytes forwarded at a time on the slow side


class TrickleProxy:
    """127.0.0.1:`port` -> 127.0.0.1:`upstream`."""

    def __init__(self, upstream: int, rate: float | None = None, delay_s: float = 0.0,
                 request_rate: float | None = None) -> None:
        self.upstream, self.rate, self.delay_s = upstream, rate, delay_s
        self.request_rate = request_rate
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port: int = self.listener.getsockname()[1]
        self.accepted = 0  # connections made through it
        self.requested = 0  # request bytes forwarded to the server
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="trickle-accept").start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._closed = True
        with self._lock:
            socks, self._socks = self._socks, []
        for s in [self.listener, *socks]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self.accepted += 1
                self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while True:
                rate = self.rate if slow else self.request_rate
                data = src.recv(CHUNK if rate else 1 << 16)
                if not data:
                    break
                if slow and self.delay_s:
                    time.sleep(self.delay_s)
                if rate:
                    time.sleep(len(data) / rate)
                if not slow:
                    self.requested += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):  # one side gone: the connection is over
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
