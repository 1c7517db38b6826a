"""Two router replicas (two `kvroute serve` processes, same config) agree on placement:
consistent hashing needs no shared state, so each prefix lands on the same backend
whichever replica a client reaches."""

from __future__ import annotations

import asyncio
import sys
from contextlib import asynccontextmanager

import aiohttp
import yaml

from bench.harness.processes import free_port, process, wait_ready
from tests.stub_backend import StubBackend


@asynccontextmanager
async def replica(config_path: str):
    """A `kvroute serve` process on a free port, yielded once it is ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "router", "serve", "-c", config_path, "--port", str(port)]
    with process(cmd):
        url = f"http://127.0.0.1:{port}"
        await wait_ready(url, timeout=30)
        yield url


async def placement(url: str, prompts: list[str]) -> list[str]:
    out = []
    async with aiohttp.ClientSession() as http:
        for prompt in prompts:
            body = {"model": "stub-model", "messages": [{"role": "system", "content": prompt}]}
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                out.append(resp.headers["x-kvroute-backend"])
    return out


async def test_two_replicas_route_the_same_prefixes_to_the_same_backends(tmp_path) -> None:
    stubs = [await StubBackend().start() for _ in range(4)]
    config = {
        "listen": {"host": "127.0.0.1"},
        "backends": [{"url": s.url, "name": f"vllm-{i}"} for i, s in enumerate(stubs)],
        "routing": {"strategy": "PREFIX_AWARE", "prefix_length": 32},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    prompts = [f"document {i}: " + "the tenant shall keep the premises " * 8 for i in range(40)]
    try:
        async with replica(str(path)) as a, replica(str(path)) as b:
            first, second = await asyncio.gather(placement(a, prompts), placement(b, prompts))
        assert first == second
        assert len(set(first)) == 4  # and the prefixes are spread over the fleet
    finally:
        for stub in stubs:
            await stub.stop()
