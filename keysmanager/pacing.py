"""A server's uplink as the embedded runtime's virtual servers share one machine's loopback:
what the KeysManager sends its peers goes out no faster than QUART_SERVER_BANDWIDTH bytes/s, all
its responses together, so that several servers on one machine behave as several machines with
links of that speed. Written here because the pacing is of this server's sends, on its event
loop: a virtual clock of when the link is next free, which each chunk advances by its size (a
chunk starts once the link has carried the ones before it)."""
from __future__ import annotations

import asyncio
import time


class Uplink:
    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a link's speed is positive, not {bytes_per_s}")
        self.rate = bytes_per_s
        self._free_at = 0.0

    async def send(self, size: int) -> None:
        """Returns when `size` more bytes may start out: once the link has carried what was
        sent before them (it is then busy with these for size/rate seconds)."""
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + size / self.rate
        if start > now:
            await asyncio.sleep(start - now)
