"""Smoke tests of `kvroute bench` and `kvroute demo` on tiny workloads, real processes on
127.0.0.1; plus the report's pure arithmetic. The peers are pointed at an empty
virtualenv and never pip-installed, so every machine runs the same tests."""

import errno
import importlib.util
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import orjson
import psutil
import pytest
from aiohttp import web

from bench.harness import compare as harness
from bench.harness import demo
from bench.harness.loadgen import SGLANG_ROUTING_KEY, Outcome, replay
from bench.harness.report import (
    BackendDelta,
    Run,
    bucket_quantile,
    percentile,
    reading,
    seed_means,
    summarize,
)
from bench.harness.workloads import WorkloadSpec, generate
from bench.sim import SimParams, start_fleet
from router.config import DEFAULT_STRATEGY
from router.control.supervisor import usable_cores
from router.control.worker import Router

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).parents[2]
MINUS = "\N{MINUS SIGN}"

TINY = [
    "--backends=2",
    "--strategies=RANDOM,PREFIX_AWARE",
    "--requests=20",
    "--groups=4",
    "--prefix-tokens=2000",
    "--max-tokens=8",
    "--rate=4",
    "--time-scale=0.05",
    "--calibration=5",
    "--max-wall=20",
]


def _rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("strategy "))
    rows = {}
    for line in lines[header + 1 :]:
        cells = line.split()
        if len(cells) < 2 or not cells[1].isdigit():
            break
        rows[cells[0]] = cells
    return rows


def _header(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("strategy "))


def _results(out: Path) -> dict:
    return orjson.loads((out / "results.json").read_bytes())


def test_bench_compares_strategies_and_writes_json(tmp_path, capsys):
    """By default each router runs as `kvroute serve` does: one worker per usable core."""
    assert harness.main([*TINY, f"--out={tmp_path}"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {"RANDOM", "PREFIX_AWARE"}
    for cells in rows.values():
        assert cells[1:3] == ["20", "0"]  # ok, failed
        assert cells[12].endswith("%")  # fleet KV hit rate
    assert "PREFIX_AWARE vs RANDOM: P50 TTFT" in out
    assert "tier hit" not in _header(out)  # no offload tier, no column
    assert "Learned speeds" not in out  # one speed: nothing to tell the fleet apart
    doc = _results(tmp_path)
    assert [s["strategy"] for s in doc["summaries"]] == ["RANDOM", "PREFIX_AWARE"]
    cores = usable_cores()
    for run in doc["runs"]:
        setup = run["setup"]
        assert (setup["workers"], setup["workers_config"], setup["replicas"]) == (cores, 0, 1)
        assert setup["processes"] >= (cores + 2 if cores > 1 else 1)  # + supervisor, collector
        assert setup["kv_events"] is False
    assert doc["runs"][1]["setup"]["params"]["prefix_length"] == 256
    # each request's id, as the router's access log and /debug/routing name it
    ids = [out["request_id"] for run in doc["runs"] for out in run["outcomes"]]
    assert len(ids) == 40 and len(set(ids)) == 40 and all(ids), ids
    assert f"PREFIX_AWARE: kvroute serve, {cores} worker" in out
    assert "KV events off; prefix_length=256 concurrency_threshold=32" in out
    prefix_aware = doc["summaries"][1]
    assert prefix_aware["hit_rate"] > 0.5  # 4 of every 5 requests find their document
    assert len(doc["runs"][0]["outcomes"]) == 20
    assert all(o["cached_tokens"] is not None for o in doc["runs"][1]["outcomes"])
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "ttft_hit_rate.png").exists() == has_matplotlib


def test_default_strategies_include_what_serve_routes_with_by_default(tmp_path, capsys):
    """`kvroute bench` and `kvroute demo` without --strategies: a row for the serve default."""
    assert DEFAULT_STRATEGY in harness.build_parser().parse_args([]).strategies.split(",")
    assert f"--strategies={','.join(harness.DEFAULT_STRATEGIES)}" in demo.demo_argv(4, 16, 0.25)
    argv = [a for a in TINY if not a.startswith("--strategies")]
    assert harness.main([*argv, "--requests=4", "--calibration=0", f"--out={tmp_path}"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == list(harness.DEFAULT_STRATEGIES)
    assert rows[DEFAULT_STRATEGY][1:3] == ["4", "0"]  # ok, failed


def test_replicas_share_the_requests_of_one_config(tmp_path, capsys):
    argv = [*TINY, "--strategies=PREFIX_AWARE", "--replicas=2", "--workers=1", f"--out={tmp_path}"]
    assert harness.main(argv) == 0
    (run,) = _results(tmp_path)["runs"]
    assert (run["setup"]["replicas"], run["setup"]["workers"]) == (2, 1)
    first, second = run["replica_requests"]  # each router's own kvroute_requests_total
    assert first > 0 and second > 0 and first + second <= 20  # a last one may count late
    assert (
        f"2 replicas (requests {first:.0f} / {second:.0f} with seed 0)" in capsys.readouterr().out
    )


def test_cluster_both_runs_each_strategy_alone_then_sharing_through_redis(tmp_path, capsys):
    """`--cluster both`: the replicas without, then with, a Redis of the bench's own."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package)")
    argv = [*TINY, "--strategies=KV_AWARE", "--replicas=2", "--workers=1", "--cluster=both"]
    assert harness.main([*argv, f"--out={tmp_path}"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == ["KV_AWARE", "KV_AWARE+cluster"]
    for cells in rows.values():
        assert cells[1:3] == ["20", "0"]  # ok, failed
    alone, shared = (run["setup"] for run in _results(tmp_path)["runs"])
    assert (alone["cluster"], shared["cluster"]) == (False, True)
    assert "with seed 0) sharing through Redis, KV events off" in out
    assert "Router CPU per request (real ms, every replica's processes): " in out


def test_a_redis_outage_mid_replay_fails_no_request(tmp_path, capsys):
    """--redis-outage stops the row's Redis during the replay: the replicas route alone."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package)")
    argv = [*TINY, "--strategies=KV_AWARE", "--replicas=2", "--workers=1", "--cluster"]
    assert harness.main([*argv, "--redis-outage=0:0.5", "--time-scale=0.2"]) == 0
    out = capsys.readouterr().out
    assert _rows(out)["KV_AWARE+cluster"][1:3] == ["20", "0"]  # ok, failed
    assert "sharing through Redis (down 0-0.5 s into the replay, real time)" in out


def test_peers_that_cannot_run_are_rows_of_na_with_the_reason(tmp_path, capsys):
    venv = tmp_path / "no-peers"
    argv = [*TINY, "--strategies=RANDOM", "--requests=8", f"--out={tmp_path}"]
    assert harness.main([*argv, "--peers", f"--peers-venv={venv}", "--no-install"]) == 0
    rows = _rows(capsys.readouterr().out)
    labels = ["sglang-router:cache_aware", "sglang-router:round_robin", "vllm-router:cache_aware"]
    assert list(rows) == ["RANDOM", *labels]
    for label in labels:
        assert rows[label][1:17] == ["0", "0", *["n/a"] * 14]
        assert " ".join(rows[label][17:]) == f"not installed in {venv} (--no-install)"
    assert not venv.exists()  # --no-install: nothing was created
    peers = _results(tmp_path)["summaries"][1:]
    assert {(s["ok"], s["unmeasured"]) for s in peers} == {
        (0, f"not installed in {venv} (--no-install)")
    }


def test_a_peer_that_does_not_start_is_a_row_of_na_with_its_error(tmp_path, capsys):
    python = tmp_path / "peers" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(  # "installed" (it has a version), but the router cannot start
        '#!/bin/sh\ncase "$1" in -c) echo 9.9;; *) echo "no router here" >&2; exit 3;; esac\n'
    )
    python.chmod(0o755)
    argv = [*TINY, "--strategies=RANDOM", "--requests=8", "--calibration=0", "--peers"]
    assert harness.main([*argv, f"--peers-venv={python.parents[1]}", "--no-install"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["RANDOM"][1:3] == ["8", "0"]
    note = "did not start: exited with code 3 | no router here"
    assert " ".join(rows["vllm-router:cache_aware"][17:]) == note
    assert "sglang-router 9.9 --policy round_robin with its defaults, 1 replica" in out


def test_seeds_give_a_table_each_and_their_means(tmp_path, capsys):
    argv = [*TINY, "--strategies=RANDOM", "--requests=8", "--seeds=0,1", f"--out={tmp_path}"]
    assert harness.main(argv) == 0
    out = capsys.readouterr().out
    assert "seed 0; 2 simulated" in out and "seed 1; 2 simulated" in out
    assert "Mean over seeds 0, 1" in out
    doc = _results(tmp_path)
    assert doc["seeds"] == [0, 1]
    assert [(s["strategy"], s["seed"]) for s in doc["summaries"]] == [("RANDOM", 0), ("RANDOM", 1)]
    (mean,) = doc["means"]
    p50s = [s["ttft_p50"] for s in doc["summaries"]]
    assert mean["seeds"] == 2 and math.isclose(mean["ttft_p50"], sum(p50s) / 2)


def test_seed_means_average_each_row_and_keep_na():
    runs = [_run("RANDOM", [0.4, 0.6], 0.2, [1.0]), _run("RANDOM", [0.9, 1.1], 0.4, [1.0])]
    runs.append(Run(strategy="peer", time_scale=1, wall_seconds=0, outcomes=[], unmeasured="no"))
    summaries = [summarize(r) for r in runs]
    random_row, peer_row = seed_means(summaries)
    assert random_row.seeds == 2
    assert math.isclose(random_row.ttft_p50, 1.5)  # (1.0 + 2.0) / 2, in simulated seconds
    assert math.isclose(random_row.hit_rate, 0.3)
    assert (peer_row.strategy, peer_row.ttft_p50, peer_row.hit_rate) == ("peer", None, None)
    assert reading([summaries[0], summaries[2]]) == []  # nothing measured to compare with


def test_demo_runs_four_strategies_and_explains(capsys):
    assert demo.main(["--backends=2", "--groups=2", "--time-scale=0.05"]) == 0
    out = capsys.readouterr().out
    rows = {"RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE", "KV_AWARE"}
    assert set(_rows(out)) == rows
    assert "KV_AWARE vs RANDOM" in out and "Why:" in out
    legend = "spread req / spread busy: the busiest backend's requests / busy time"
    assert legend in " ".join(out.split())  # the columns explained, wrapped
    assert "Next:" in out and "kvroute sim" in out.split("Next:")[1]


def test_a_cpu_tier_adds_its_hit_rate_and_param_sets_any_routing_parameter(tmp_path, capsys):
    """GPU room for one of the four documents per backend, CPU room for all of them."""
    tier = ["--sim-arg=--kv-events", "--sim-arg=--num-gpu-blocks=200"]
    tier += ["--sim-arg=--num-cpu-blocks=4000", "--sim-arg=--max-model-len=3000"]
    argv = [*TINY, "--strategies=KV_AWARE", "--param=miss_penalty=2.5", *tier, f"--out={tmp_path}"]
    assert harness.main(argv) == 0
    out = capsys.readouterr().out
    assert "tier hit" in _header(out) and "miss_penalty=2.5" in out
    doc = _results(tmp_path)
    assert doc["runs"][0]["setup"]["params"]["miss_penalty"] == 2.5
    assert 0 < doc["summaries"][0]["tier_hit_rate"] < 1


def test_set_gives_every_kvroute_row_any_other_setting(tmp_path, capsys):
    """--set reaches the router's config file: a body limit under the prompts' size
    refuses every request (413: the bench exits 1 for failed requests), and the row's
    configuration line names it."""
    argv = [*TINY, "--strategies=RANDOM", "--set=limits.max_body_bytes=2048"]
    argv += ["--set=log_level=error", f"--out={tmp_path}"]
    assert harness.main(argv) == 1
    out = capsys.readouterr().out
    assert "config limits.max_body_bytes=2048 log_level=error" in " ".join(out.split())
    doc = _results(tmp_path)
    (run,) = doc["runs"]
    assert run["setup"]["settings"] == {"limits": {"max_body_bytes": 2048}, "log_level": "error"}
    assert {o["status"] for o in run["outcomes"]} == {413}


def test_pd_runs_each_strategy_disaggregated_beside_the_same_backends_combined(tmp_path, capsys):
    """The P/D row's decode backend gets its prompts' KV from the prefill backend: vLLM's
    external prefix-cache counters show the transfer (tier hit), which the combined row
    has none of."""
    argv = [*TINY, "--strategies=KV_AWARE", "--requests=8", "--pd=1:1", f"--out={tmp_path}"]
    assert harness.main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == ["KV_AWARE", "KV_AWARE-pd1:1"]
    assert all(cells[1:3] == ["8", "0"] for cells in rows.values())  # ok, failed
    assert "(P/D rows: 1 prefill + 1 decode)" in out and "pools prefill 1 + decode 1" in out
    combined, split = _results(tmp_path)["summaries"]
    assert combined["tier_hit_rate"] in (None, 0) and split["tier_hit_rate"] > 0
    assert split["itl_p50"] is not None


def test_a_mixed_fleet_shows_what_each_kvroute_row_learned_of_each_backends_speed(tmp_path, capsys):
    """Beside each backend's true speed from the simulator, in simulated units."""
    argv = [*TINY, "--strategies=KV_AWARE", "--speeds=1,0.5", "--calibration=0"]
    assert harness.main([*argv, f"--out={tmp_path}"]) == 0
    out = capsys.readouterr().out
    (run,) = _results(tmp_path)["runs"]
    speeds = {s["backend"]: s for s in run["speeds"]}
    assert sorted(speeds) == ["sim-0", "sim-1"]
    assert speeds["sim-0"]["true_prefill_tokens_per_s"] == pytest.approx(10_000)
    assert speeds["sim-1"]["true_prefill_tokens_per_s"] == pytest.approx(5_000)
    assert speeds["sim-1"]["true_decode_step_ms"] == pytest.approx(50)
    assert "Learned speeds at the end of each kvroute row" in out
    line = next(line for line in out.splitlines() if line.startswith("  KV_AWARE, seed 0: "))
    for name, s in speeds.items():
        if s["prefill_tokens_per_s"] is None:
            assert f"{name} prior" in line
        else:
            rate = f"{name} {s['prefill_tokens_per_s']:,.0f} tok/s ("
            assert s["prefill_tokens_per_s"] > 0 and rate in line
            prior = s["source"] == "learned" and "prefill_tokens_per_s" not in s["figures"]
            assert (rate + "prior)" in line) == prior  # a figure its samples did not give


def test_knee_ramps_each_row_on_a_mixed_fleet_and_reports_its_last_step_under_the_slo(
    tmp_path, capsys
):
    """Two strategies, three steps each, on one full-speed and one half-speed backend."""
    argv = [a for a in TINY if not a.startswith("--rate")]
    argv += ["--knee", "--knee-start=2", "--knee-steps=3", "--slo-ttft=0.8", "--speeds=1,0.5"]
    assert harness.main([*argv, "--calibration=0", f"--out={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "Poisson rates ramped from 2.00 req/s by 1.25x" in out and "speeds 1,0.5" in out
    assert "CPU, peak share of one core over a replay" in out  # what may distort the steps
    header = next(line for line in out.splitlines() if line.startswith("row "))
    assert header.split() == [
        *("row", "knee", "req/s", "steps", "TTFT", "p50", "p90", "p99"),
        *("E2E", "p50", "p90", "p99", "KV", "hit", "vs", "best", "stopped", "by"),
    ]
    doc = _results(tmp_path)
    assert doc["options"]["speeds"] == [1.0, 0.5]
    rows = doc["rows"]
    assert [r["label"] for r in rows] == ["RANDOM", "PREFIX_AWARE"]
    printed = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    knees = {}
    for row in rows:
        steps = row["steps"]
        assert 1 <= len(steps) <= 3
        assert [s["rate"] for s in steps] == pytest.approx([2 * 1.25**i for i in range(len(steps))])
        for s in steps:  # each step judged by its own results
            summary = s["summary"]
            assert summary["ok"] + summary["failed"] == 20
            held = summary["failed"] == 0 and summary["ttft_p90"] < 0.8
            assert s["passed"] == held
        assert all(s["passed"] for s in steps[:-1])  # the ramp stopped at its first failure
        passed = [s for s in steps if s["passed"]]
        knees[row["label"]] = passed[-1]["rate"] if passed else None
        cell = printed[row["label"]][1]
        if passed:
            bound = "" if not steps[-1]["passed"] else ">="
            assert cell == f"{bound}{passed[-1]['rate']:.2f}"
            assert printed[row["label"]][9].endswith("%")  # the knee step's hit rate
        else:
            assert cell == "<2.00"
    best = max((k for k in knees.values() if k), default=None)
    for label, rate in knees.items():
        if rate and best:
            assert printed[label][10] == f"{rate / best:.2f}x"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "knee.png").exists() == has_matplotlib


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies=NOPE"], "unknown strategies"),
        (["--param=miss_penalty"], "expected KEY=VALUE"),
        (["--strategies=RANDOM", "--param=tiers={}"], "--param tiers: no routing parameter"),
        (["--strategies=KV_AWARE", "--param=tiers=5"], "$.routing.tiers"),
        (["--set=flow.saturation.enabled"], "expected PATH=VALUE"),
        (["--set=routing.sample=0"], "the bench sets `routing` itself"),
        (["--set=flow.saturation.nope=1"], "$.flow.saturation"),
        (["--set=log_level=error", "--target=http://127.0.0.1:9"], "not with --target"),
        (["--pd=2"], "expected P:D with P, D >= 1"),
        (["--pd=0:1"], "expected P:D with P, D >= 1"),
        (["--pd=2:2", "--backends=3"], "--pd 2:2 is 4 backends, not --backends 3"),
        (["--pd=1:1", "--target=http://127.0.0.1:9"], "--pd starts its own fleet"),
        (["--backends=4", "--speeds=1,0.5"], "--speeds gives 2 speeds for 4 backends"),
        (["--speeds=1,0"], "want positive numbers like 1,1,0.5,0.5"),
        (["--speeds=1", "--target=http://127.0.0.1:9"], "--speeds sets the simulated fleet"),
        (["--knee", "--rate=3"], "it does not go with --rate"),
        (["--knee", "--concurrency=3"], "it does not go with --concurrency"),
        (["--knee", "--target=http://127.0.0.1:9"], "it does not go with --target"),
        (["--knee", "--seeds=0,1"], "--knee runs one seed"),
        (["--knee", "--knee-factor=1"], "must be above 1"),
        (["--knee", "--knee-steps=0"], "--knee-steps must be 1 or more"),
        (["--knee", "--slo-ttft=0"], "must be positive"),
        (["--slo-ttft=2"], "--slo-ttft goes with --knee"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        harness.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


async def test_target_mode_reads_what_a_kvroute_target_exposes():
    """--target: nothing started; strategy and spread come from the router itself."""
    params = SimParams(time_scale=0.05, num_gpu_blocks=2048, max_model_len=8192)
    async with await start_fleet(2, params) as fleet:
        router = Router(harness.router_config("PREFIX_AWARE", [{"url": u} for u in fleet.urls], {}))
        try:
            await router.start()
            options = harness.Options(
                strategies=["target"],
                backends=0,
                time_scale=0.05,
                sim_args=[],
                routing={},
                target=router.url,
                model=None,
                concurrency=2,
                max_wall=20,
                calibration=0,
            )
            spec = WorkloadSpec(requests=8, groups=2, prefix_tokens=300, max_tokens=4)
            (run,) = await harness.run_bench(generate(spec), options)
        finally:
            await router.stop()
    summary = summarize(run)
    assert (run.strategy, summary.ok, summary.failed) == ("PREFIX_AWARE", 8, 0)
    assert summary.hit_rate_source == "usage.cached_tokens" and summary.hit_rate > 0.3
    assert summary.spread_busy is None and summary.spread_requests is not None
    assert summary.hop_ms is None and summary.decision_us is not None


@pytest.fixture
def sim_url():
    """One simulated vLLM server in a child process, for `kvroute bench --target` runs."""
    cmd = [sys.executable, "-m", "bench.sim", "--instances=1", "--time-scale=0.05"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        url = proc.stdout.readline().decode().strip()  # its first line, once it listens
        assert url.startswith("http://127.0.0.1:"), "the simulator did not start"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


TARGET = ["--requests=2", "--groups=1", "--prefix-tokens=100", "--max-tokens=4", "--rate=20"]


@pytest.mark.parametrize(
    ("scale", "clock"), [([], "wall time"), (["--time-scale=0.05"], "simulated time")]
)
def test_target_output_names_one_clock_and_no_empty_heading(sim_url, capsys, scale, clock):
    """A target's latencies are wall time unless --time-scale gives a simulated target's
    scale; nothing was started, so no row has a configuration to list."""
    assert harness.main(["--target", sim_url, *TARGET, *scale]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"percentiles in ms of {clock}" in out
    assert f"Latencies (ms) and req/s are in {clock}" in out
    other = "simulated" if clock == "wall time" else "wall time"
    assert other not in out.replace("(wall / time_scale)", "")
    assert "Configuration of each row" not in out


def test_a_count_of_one_is_singular(sim_url, capsys):
    argv = ["--target", sim_url, "--requests=1", "--groups=1", "--prefix-tokens=100"]
    assert harness.main([*argv, "--max-tokens=1", "--concurrency=1"]) == 0
    header = "long-prefix: 1 request, 1 group, 100-token shared prompts, 100-token questions, "
    assert header + "1 output token, closed loop, 1 client, seed 0;" in capsys.readouterr().out


@pytest.mark.parametrize("model", [[], ["--model=m"]])
def test_an_unreachable_target_is_one_line_naming_it(capsys, model):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}"  # closed once the block ends
    assert harness.main(["--target", url, "--requests=1", *model]) == 1
    out, err = capsys.readouterr()
    assert err == f"kvroute bench: cannot reach {url}: {os.strerror(errno.ECONNREFUSED)}\n"
    assert out == ""  # no table of failed requests


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 0.5, None),
        ([3.0], 0.99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 1.0, 4.0),
    ],
)
def test_percentile(values, q, expected):
    assert percentile(values, q) == expected


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        ([], 0.5, None),
        ([("1e-05", 0.0), ("+Inf", 0.0)], 0.5, None),
        ([("1e-05", 10.0), ("2e-05", 30.0), ("+Inf", 30.0)], 0.5, 1.25e-5),
        ([("1e-05", 0.0), ("+Inf", 4.0)], 0.5, 1e-5),
    ],
)
def test_bucket_quantile(buckets, q, expected):
    got = bucket_quantile(buckets, q)
    assert got == expected or math.isclose(got, expected)


def _run(strategy: str, ttfts: list[float], hits: float, busy: list[float]) -> Run:
    outcomes = [
        Outcome(index=i, group=0, ok=True, sent=float(i), ttft=t, e2e=1.0)
        for i, t in enumerate(ttfts)
    ]
    backends = [
        BackendDelta(name=f"b{i}", requests=1, busy_seconds=b, prefix_hits=hits, prefix_queries=1)
        for i, b in enumerate(busy)
    ]
    return Run(
        strategy=strategy, time_scale=0.5, wall_seconds=1, outcomes=outcomes, backends=backends
    )


def test_summary_scales_to_simulated_time_and_reading_compares_to_baseline():
    base = summarize(_run("RANDOM", [0.4, 0.5, 0.6], 0.25, [1.0, 1.0]))
    better = summarize(_run("PREFIX_AWARE", [0.1, 0.1, 0.3], 0.8, [1.0, 3.0]))
    assert base.ttft_p50 == 1.0  # 0.5 s of wall time at time_scale 0.5
    assert (base.hit_rate, better.spread_busy) == (0.25, 1.5)
    assert reading([base, better]) == [
        f"PREFIX_AWARE vs RANDOM: P50 TTFT {MINUS}80%, P90 TTFT {MINUS}55%, "
        "KV hit rate 25.0% → 80.0%, "
        "busy spread 1.00 → 1.50"
    ]


def test_a_knee_runs_at_time_scale_1_unless_told_and_a_host_short_of_cores_is_named():
    """At 0.5 the simulator's steps come twice as fast in wall time, and a small host ran
    out of CPU below a 4-backend fleet's capacity: its top steps measured the host."""
    parser = harness.build_parser()
    bare = [a for a in TINY if not a.startswith(("--time-scale", "--rate"))]
    scales = {}
    for extra in ([], ["--knee"], ["--knee", "--time-scale=0.5"]):
        _, options = harness._from_args(parser.parse_args([*bare, *extra]))
        scales[" ".join(extra)] = options.time_scale
    assert scales == {"": 0.5, "--knee": 1.0, "--knee --time-scale=0.5": 0.5}
    cores = usable_cores()
    run = _run("RANDOM", [0.1], 0.0, [1.0])
    quiet = msgspec.structs.replace(run, cpu={"harness": 0.1, "router": 0.1, "simulator": 0.1})
    busy = msgspec.structs.replace(run, cpu={"harness": 0.25 * cores, "simulator": 0.5 * cores})
    warning = f"of a core, of the {cores} this host has"
    assert not any(warning in line for line in harness._machine([quiet], options))
    (line,) = [x for x in harness._machine([quiet, busy], options) if warning in x]
    assert f"took {0.75 * cores:.0%}" in line and "use a larger --time-scale" in line


@pytest.mark.parametrize("knee", [False, True])
def test_a_simulator_killed_mid_replay_fails_the_row_naming_it(tmp_path, capsys, monkeypatch, knee):
    """Once the replay's first request is done, the harness's simulator child is killed:
    the replay stops, and the row is no measurement but a failure naming the process, its
    exit code and its stderr's last lines."""
    killed: list[int] = []
    done: list[Outcome] = []

    def kill_the_simulator(label: str, total: int):
        def on_done(outcome: Outcome) -> None:
            done.append(outcome)
            if not killed:
                (sim,) = [p for p in psutil.Process().children() if "bench.sim" in p.cmdline()]
                sim.kill()
                killed.append(sim.pid)

        return on_done

    monkeypatch.setattr(harness, "_progress_factory", lambda: kill_the_simulator)
    argv = [*TINY, "--strategies=RANDOM", "--requests=40", "--time-scale=1", "--calibration=0"]
    if knee:
        argv = [a for a in argv if a != "--rate=4"] + ["--knee", "--knee-start=4"]
    assert harness.main([*argv, f"--out={tmp_path}"]) == 1
    captured = capsys.readouterr()
    banner = "kvroute sim: 2 servers of model 'sim-llama-70b'"  # its stderr's last line
    why = f"the simulator (pid {killed[0]}) exited with code -9 | {banner}"
    assert f"kvroute bench: RANDOM failed: {why}" in captured.err
    assert f"failed: {why}" in captured.out
    results = _results(tmp_path)
    rows = results["rows"] if knee else results["summaries"]
    assert [r["unmeasured"] for r in rows] == [f"failed: {why}"]
    assert len(done) < 20  # the replay (40 arrivals over 10 s) was stopped


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_the_simulator_and_exits_130(sig):
    cmd = [sys.executable, "-m", "bench.harness.compare", "--backends=2", "--requests=500"]
    proc = subprocess.Popen(
        [*cmd, "--time-scale=1", "--calibration=0"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    try:
        sim = _wait_for_child(proc.pid)
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 130
    finally:
        proc.kill()
        proc.wait()
    assert b"interrupted" in proc.stderr.read()
    assert not _alive(sim)


def _wait_for_child(pid: int) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            time.sleep(1.0)  # let the replay start
            return int(children[0])
        time.sleep(0.1)
    raise AssertionError("the simulator never started")


def _alive(pid: int) -> bool:
    try:
        return b"(zombie)" not in Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return False


async def test_multi_turn_requests_name_their_conversation_as_a_session() -> None:
    """Each multi-turn request carries its conversation under the headers the routers
    compared read (X-Session-ID, sglang-router's routing key); other shapes name none."""
    seen: list[tuple[str | None, str | None]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers.get("X-Session-ID"), request.headers.get(SGLANG_ROUTING_KEY)))
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        turns = generate(WorkloadSpec(shape="multi-turn", requests=6, groups=2, max_tokens=2))
        outcomes = await replay([url], "m", turns, concurrency=2, deadline=20)
        assert all(out.ok for out in outcomes)
        sessions = sorted((spec.session, spec.session) for spec in turns)
        assert sorted(seen) == sessions and len(set(sessions)) == 2
        seen.clear()
        documents = generate(WorkloadSpec(requests=2, groups=1, prefix_tokens=20, max_tokens=2))
        await replay([url], "m", documents, concurrency=2, deadline=20)
        assert seen == [(None, None)] * 2
    finally:
        await runner.cleanup()


def test_multi_turn_adds_the_peers_session_modes(tmp_path, capsys):
    venv = tmp_path / "no-peers"
    argv = [*TINY, "--workload=multi-turn", "--strategies=RANDOM", "--requests=8"]
    assert harness.main([*argv, "--peers", f"--peers-venv={venv}", "--no-install"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows)[-2:] == ["sglang-router:manual", "vllm-router:consistent_hash"]
