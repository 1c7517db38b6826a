"""A loopback Kubernetes API server for discovery tests: EndpointSlices listed and watched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from aiohttp import web


class FakeKubeApi:
    """A loopback API server serving real EndpointSlice JSON: a list, then a watch stream
    fed by the test. It insists on the service-account token and the label selector."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.slices: dict[str, dict] = {}
        self.events: asyncio.Queue = asyncio.Queue()
        self.lists = 0
        self.watches = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    @staticmethod
    def slice(name: str, ready: dict[str, bool]) -> dict:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "vllm"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [ip], "conditions": {"ready": ok}} for ip, ok in ready.items()
            ],
        }

    def source(self, token_file: Path, token: str, **extra: object) -> dict:
        """The `discovery:` entry that follows this server's `vllm` Service in `ai`,
        presenting `token` (written to `token_file`)."""
        token_file.write_text(token)
        return {
            "kind": "kubernetes",
            "service": "vllm",
            "namespace": "ai",
            "api_server": self.url,
            "token_file": str(token_file),
            **extra,
        }

    async def start(self) -> FakeKubeApi:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ai/endpointslices", self._serve)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        assert request.query["labelSelector"] == "kubernetes.io/service-name=vllm"
        if request.query.get("watch") != "1":
            self.lists += 1
            body = {"kind": "EndpointSliceList", "metadata": {"resourceVersion": "7"}}
            return web.json_response({**body, "items": list(self.slices.values())})
        self.watches += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        while True:
            event = await self.events.get()
            if event is None:  # end this watch (as an API server does on timeout)
                return response
            await response.write(orjson.dumps(event) + b"\n")
