"""The locust file: a clear import error without locust, and a short headless run with it
against a simulated backend behind a router on 127.0.0.1 (skipped when locust is absent)."""

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.harness.compare import router_config
from bench.sim import SimParams, start_fleet
from router.control.worker import Router

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).parents[2]
LOCUSTFILE = ROOT / "bench" / "micro" / "locustfile.py"


def test_without_locust_the_import_error_says_what_to_install():
    hide_locust = (
        f"import runpy, sys; sys.modules['locust'] = None; runpy.run_path({str(LOCUSTFILE)!r})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hide_locust], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode != 0
    assert "pip install -e '.[bench]'" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust not installed")
async def test_headless_run_replays_the_workload(tmp_path):
    params = SimParams(time_scale=0.05, num_gpu_blocks=2048, max_model_len=8192)
    async with await start_fleet(2, params) as fleet:
        router = Router(router_config("PREFIX_AWARE", [{"url": u} for u in fleet.urls], {}))
        try:
            await router.start()
            cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless"]
            cmd += ["--host", router.url, "--json-file", str(tmp_path / "run"), "--skip-log"]
            cmd += ["--users=2", "--spawn-rate=2", "--run-time=30s", "--requests=6"]
            cmd += ["--workload=multi-turn", "--system-prompt=per-conversation"]
            cmd += ["--groups=2", "--prefix-tokens=300", "--max-tokens=4"]
            proc = await asyncio.create_subprocess_exec(
                *cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            output, _ = await asyncio.wait_for(proc.communicate(), 45)
        finally:
            await router.stop()
    assert proc.returncode == 0, output.decode()[-2000:]
    stats = {s["name"]: s for s in orjson.loads((tmp_path / "run.json").read_bytes())}
    for name in ("TTFT", "E2E", "/v1/chat/completions"):
        assert (stats[name]["num_requests"], stats[name]["num_failures"]) == (6, 0)
