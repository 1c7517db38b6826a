"""Helpers for the chaos and abuse suite: bounded requests that are counted.

Every request the suite sends goes through `Tally.send`, which bounds it in time and
counts it: `sent`, `failed` (an outcome the test did not expect) and `hung` (no answer
within the bound). The session-wide `TALLY` is printed at the end of the run
(`pytest_terminal_summary` in conftest.py), so the suite reports its own counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

MODEL = "stub-model"
CHAT = [{"role": "user", "content": "hello"}]
BOUND = 10.0  # seconds: longer than any request of the suite may take


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return orjson.loads(self.body)

    def events(self) -> list[bytes]:
        """The `data: ` payloads of an SSE body, in order."""
        lines = self.body.split(b"\n")
        return [ln[6:] for ln in lines if ln.startswith(b"data: ")]


@dataclass
class Tally:
    """Counts of one test; each count also goes to `parent` (the session's TALLY)."""

    sent: int = 0
    failed: int = 0
    hung: int = 0
    parent: Tally | None = None

    @classmethod
    def new(cls) -> Tally:
        return cls(parent=TALLY)

    async def send(
        self,
        http: aiohttp.ClientSession,
        url: str,
        *,
        expect: int | set[int] | None = 200,
        method: str = "POST",
        bound: float = BOUND,
        **kwargs,
    ) -> Reply:
        """One request, bounded by `bound` seconds; counted as failed unless its status
        is in `expect` (None: any status), and as hung if it did not end in time."""
        self.add("sent")
        try:
            async with asyncio.timeout(bound):
                async with http.request(method, url, **kwargs) as resp:
                    reply = Reply(resp.status, dict(resp.headers), await resp.read())
        except TimeoutError:
            self.add("hung")
            raise
        except aiohttp.ClientError:
            self.add("failed")
            raise
        wanted = {expect} if isinstance(expect, int) else expect
        if wanted is not None and reply.status not in wanted:
            self.add("failed")
        return reply

    def add(self, what: str, n: int = 1) -> None:
        setattr(self, what, getattr(self, what) + n)
        if self.parent is not None:
            self.parent.add(what, n)

    def __str__(self) -> str:
        return f"requests sent {self.sent}, failed {self.failed}, hung {self.hung}"


TALLY = Tally()


def chat(stream: bool = False, **extra) -> dict:
    return {"json": {"model": MODEL, "messages": CHAT, "stream": stream, **extra}}


async def until(predicate: Callable[[], bool], timeout: float = 5.0, step: float = 0.01) -> None:
    """Wait (bounded) until `predicate()` holds."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(step)
