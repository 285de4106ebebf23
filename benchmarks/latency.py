"""A TCP proxy on 127.0.0.1 that delays everything it forwards, to give a local server latency.

Each chunk read from one side is written to the other ``delay`` seconds after it arrived (in
order, without holding back the chunks behind it), so every request/response pays a round trip
of ``2 x delay`` while throughput is whatever the two ends manage. Runs an asyncio loop in a
daemon thread; :meth:`LatencyProxy.stop` closes it.
"""

from __future__ import annotations

import asyncio
import threading
import time

__all__ = ["LatencyProxy"]

_READ = 1 << 16


class LatencyProxy:
    """Forward ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>`` with ``delay`` s each way.

    Attributes:
        port: the port the proxy listens on (chosen by the OS).
    """

    def __init__(self, target_port: int, delay: float) -> None:
        self.target_port = target_port
        self.delay = delay
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name="bench-latency-proxy")
        self._thread.start()
        if not ready.wait(10) or not self.port:
            raise RuntimeError("the latency proxy did not start")

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()

        loop.run_until_complete(start())
        try:
            loop.run_forever()
        finally:
            # Connections still open (idle keep-alive ones): cancel their tasks and let them end.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            while True:
                try:
                    data = await reader.read(_READ)
                except ConnectionError:
                    data = b""
                await queue.put((time.monotonic(), data))
                if not data:
                    return

        async def write() -> None:
            while True:
                arrived, data = await queue.get()
                wait = arrived + self.delay - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                try:
                    writer.write(data)
                    await writer.drain()
                except ConnectionError:
                    return

        await asyncio.gather(read(), write(), return_exceptions=True)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(
                self._pipe(client_r, server_w), self._pipe(server_r, client_w), return_exceptions=True
            )
        except asyncio.CancelledError:
            pass  # the proxy is stopping; ending normally keeps asyncio from logging it
        finally:
            client_w.close()
            server_w.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            loop.stop()

        loop.call_soon_threadsafe(shutdown)
        self._thread.join(10)
