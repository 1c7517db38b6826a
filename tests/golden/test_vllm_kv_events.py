"""Golden test: events made by vLLM's own `vllm/distributed/kv_events.py` (version-pinned).

The module is taken from the vLLM wheel on PyPI (only that file is read: the wheel is
never installed) and loaded without torch by standing in for the few vLLM modules it
imports (vllm-telemetry.md §6). Its structs encode the batches and its real
ZmqEventPublisher sends them, so the router's decoder and subscriber are checked against
what vLLM actually puts on the wire, not against our reading of it. Where the wheel
cannot be fetched the tests skip and say why. Set KVROUTE_VLLM_WHEEL to a downloaded
wheel to skip the download.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import msgspec
import pytest
import zmq.asyncio

from hashing.blocks import chain, root_key
from hashing.tiered_index import TieredIndex
from router.telemetry.kv_events import EventApplier, EventSubscriber

VLLM_VERSION = "0.33.0"
MODEL = "meta-llama/Llama-3.1-8B"
IDS = list(range(1000, 1064))  # four blocks of 16


def _wheel(tmp: Path) -> Path:
    given = os.environ.get("KVROUTE_VLLM_WHEEL")
    if given:
        return Path(given)
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps"]
    try:
        subprocess.run([*cmd, "-q", "-d", str(tmp)], check=True, capture_output=True, timeout=300)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"vLLM {VLLM_VERSION} wheel not available here: {exc}")
    return next(tmp.glob("vllm-*.whl"))


def _stand_ins() -> dict[str, types.ModuleType]:
    """The vLLM modules kv_events.py imports, reduced to what it uses."""

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so submodules can hang below it
        mod.__dict__.update(attrs)
        return mod

    def unused(*args, **kwargs):
        raise AssertionError("not needed for ipc:// endpoints at DP rank 0")

    class KVEventsConfig:
        def __init__(self, **fields) -> None:
            self.__dict__.update(fields)

    return {
        "vllm": module("vllm"),
        "vllm.config": module("vllm.config"),
        "vllm.config.kv_events": module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig),
        "vllm.config.utils": module("vllm.config.utils", config=dataclasses.dataclass),
        "vllm.logger": module("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": module("vllm.utils"),
        "vllm.utils.network_utils": module(
            "vllm.utils.network_utils",
            get_ip=unused,
            get_tcp_uri=unused,
            is_valid_ipv6_address=unused,
            split_zmq_path=unused,
        ),
        "vllm.v1": module("vllm.v1"),
        "vllm.v1.core": module("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": module(
            "vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int
        ),
        "vllm.distributed": module("vllm.distributed"),
    }


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("vllm")
    source = tmp / "kv_events.py"
    with zipfile.ZipFile(_wheel(tmp)) as wheel:
        source.write_bytes(wheel.read("vllm/distributed/kv_events.py"))
    stand_ins = _stand_ins()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def stored(vllm, hashes: list[int], parent: int | None, ids: list[int]):
    return vllm.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=ids,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def payload(vllm, events: list) -> bytes:
    """A batch exactly as vLLM encodes it (a plain msgspec msgpack Encoder)."""
    return msgspec.msgpack.Encoder().encode(vllm.KVEventBatch(ts=1.0, events=events))


def test_vllm_batches_decode_into_the_index(vllm) -> None:
    index = TieredIndex()
    applier = EventApplier("pod", index, 16, lambda: MODEL)
    keys = chain(root_key(MODEL, None), IDS, 16)
    applier.apply_payload(payload(vllm, [stored(vllm, [11, 12], None, IDS[:32])]))
    applier.apply_payload(payload(vllm, [stored(vllm, [2**64 - 1, 14], 12, IDS[32:])]))
    assert index.gpu.longest_prefix(keys, "pod") == 4
    applier.apply_payload(payload(vllm, [vllm.BlockRemoved(block_hashes=[14], medium="GPU")]))
    assert index.gpu.longest_prefix(keys, "pod") == 3
    applier.apply_payload(payload(vllm, [vllm.AllBlocksCleared()]))
    assert index.gpu.longest_prefix(keys, "pod") == 0
    assert applier.stats.skipped == 0


def test_vllm_salted_and_lora_blocks_are_isolated(vllm) -> None:
    index = TieredIndex()
    applier = EventApplier("pod", index, 16, lambda: MODEL)
    event = stored(vllm, [21], None, IDS[:16])
    event.lora_name, event.extra_keys = "sql-adapter", [("sql-adapter", "tenant-a")]
    applier.apply_payload(payload(vllm, [event]))
    assert index.gpu.longest_prefix(chain(root_key("sql-adapter", "tenant-a"), IDS, 16), "pod") == 1
    assert index.gpu.longest_prefix(chain(root_key(MODEL, None), IDS, 16), "pod") == 0


async def test_vllm_publisher_to_our_subscriber_with_replay(vllm, tmp_path: Path) -> None:
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = vllm.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    ctx = zmq.asyncio.Context()
    index = TieredIndex()
    applier = EventApplier("pod", index, 16, lambda: MODEL)
    resets: list[str] = []
    sub = EventSubscriber(ctx, applier, pub_ep, replay_ep, "kv", resets.append)
    try:
        # batch 0 is published before anyone listens: a PUB socket drops it
        publisher.publish(vllm.KVEventBatch(ts=1.0, events=[stored(vllm, [1, 2], None, IDS[:32])]))
        await asyncio.sleep(0.3)
        sub.last_seq = -1  # as if we had been subscribed since before seq 0
        task = asyncio.create_task(sub.run())
        second = stored(vllm, [3, 4], 2, IDS[32:])
        keys = chain(root_key(MODEL, None), IDS, 16)
        async with asyncio.timeout(10):
            # a PUB socket drops what it sends before the subscription reaches it: the
            # same blocks again, in a batch of the next number, until one arrives
            while index.gpu.longest_prefix(keys, "pod") < 4:
                publisher.publish(vllm.KVEventBatch(ts=2.0, events=[second]))
                await asyncio.sleep(0.2)
        assert applier.stats.gaps_replayed == 1 and not resets
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
