"""`kvroute recommend` on capture files written in the data capture's format (v1) from
bench.harness.workloads' requests, timed by a virtual-time replay on simulated engines; its
measurements on hand-made traffic; bad input; and --validate's two bench rows."""

import gzip
import time
import zlib
from pathlib import Path

import orjson
import pytest

from bench.harness import recommend
from bench.harness.replay import MODEL, policy_maker, replay
from bench.harness.report import Summary
from bench.harness.traffic import Seen, Tokens, Traffic, concurrency, prefixes
from bench.harness.workloads import WorkloadSpec, generate
from bench.sim import SimParams
from router.__main__ import main as kvroute
from router.access_log import Entry
from router.capture import Capture, Captured
from router.config import CaptureConfig

pytestmark = pytest.mark.timeout(60)
EPOCH = 1_780_000_000.0


def _capture(path: Path, spec: WorkloadSpec, backends: int = 2, extra: list[dict] = ()) -> Path:
    """`spec`'s requests as the router's data capture writes them, one JSON line each."""
    timed = replay(spec, policy_maker("LEAST_OUTSTANDING_REQUESTS", 0), backends)
    lines = []
    for req in generate(spec):
        i = req.index
        prompt, cached = timed.tokens[i]
        record = {
            "v": 1,
            "at": EPOCH + timed.finished_at[i],
            "request_id": f"req-{i}",
            "tenant": None,
            "path": "/v1/chat/completions",
            "model": MODEL,
            "status": 200,
            "backend": f"http://127.0.0.1:{8100 + timed.backend[i]}",
            "pool": None,
            "strategy": "LEAST_OUTSTANDING_REQUESTS",
            "ttft_ms": timed.ttft[i] * 1000,
            "duration_ms": (timed.finished_at[i] - timed.sent_at[i]) * 1000,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": req.max_tokens,
                "cached_tokens": cached,
            },
            "request": {"model": MODEL, "messages": req.messages, "stream": True},
            "response": {"stream": True, "events": 9, "content": "...", "finish_reason": "length"},
        }
        lines.append(orjson.dumps(record))
    lines.extend(orjson.dumps(r) for r in extra)
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _advice(argv: list[str], capsys) -> dict:
    assert recommend.main([*argv, "--json"]) == 0
    return orjson.loads(capsys.readouterr().out)


def _setting(doc: dict, strategy: str) -> dict:
    return next(s for s in doc["advice"] if s["strategy"] == strategy)


def test_long_prefix_prefix_length_covers_the_shared_documents(tmp_path, capsys):
    spec = WorkloadSpec(shape="long-prefix", requests=60, groups=6, prefix_tokens=2000, rate=4)
    doc = _advice([str(_capture(tmp_path / "capture.jsonl", spec))], capsys)
    p = doc["prefixes"]
    assert (p["requests"], p["groups"]) == (60, 6)
    assert p["global_tokens"] == 0  # documents differ from their first token on
    assert p["group_shared_tokens"]["p10"] >= 1984  # each group's 2,000-token document
    assert [s["strategy"] for s in doc["advice"]] == ["KV_AWARE", "PREFIX_AWARE"]
    length = _setting(doc, "PREFIX_AWARE")["params"]["prefix_length"]
    assert p["global_tokens"] < length <= p["group_shared_tokens"]["p10"]


def test_replicas_without_kv_events_get_prefix_aware(tmp_path, capsys):
    spec = WorkloadSpec(shape="long-prefix", requests=30, groups=3, prefix_tokens=1000, rate=4)
    capture = str(_capture(tmp_path / "capture.jsonl.gz", spec))
    doc = _advice([capture, "--replicas=3"], capsys)
    assert doc["advice"][0]["strategy"] == "PREFIX_AWARE"
    assert "3 router replicas without KV events" in doc["advice"][0]["why"][0]
    doc = _advice([capture, "--replicas=3", "--kv-events"], capsys)
    assert doc["advice"][0]["strategy"] == "KV_AWARE"


@pytest.mark.parametrize("tokenizer", ["approx", "chatml4"])
def test_multi_turn_prefix_length_exceeds_the_shared_system_prompt(tmp_path, capsys, tokenizer):
    spec = WorkloadSpec(shape="multi-turn", requests=60, groups=6, prefix_tokens=1000, rate=2)
    capture = str(_capture(tmp_path / "capture.jsonl", spec))
    doc = _advice([capture, f"--tokenizer={tokenizer}"], capsys)
    p = doc["prefixes"]
    assert 992 <= p["global_tokens"] <= 1024  # the system prompt and its template, to the block
    length = _setting(doc, "PREFIX_AWARE")["params"]["prefix_length"]
    assert length > 1000 + 5  # past the system prompt and the next message's markers
    assert length <= 1000 + spec.question_tokens  # within the first question
    why = " ".join(_setting(doc, "PREFIX_AWARE")["why"])
    assert "the default 256 falls inside the global part" in why


def test_no_sharing_gets_least_outstanding_requests(tmp_path, capsys):
    spec = WorkloadSpec(shape="no-sharing", requests=40, prefix_tokens=500, rate=4)
    doc = _advice([str(_capture(tmp_path / "capture.jsonl", spec))], capsys)
    assert doc["prefixes"]["reuse"] == 0.0
    assert doc["prefixes"]["shared_histogram"]["0"] == 40
    assert [s["strategy"] for s in doc["advice"]] == ["LEAST_OUTSTANDING_REQUESTS", "KV_AWARE"]
    assert doc["advice"][0]["params"] == {}


def test_timing_gives_concurrency_and_the_simulators_prefill_rate(tmp_path, capsys):
    spec = WorkloadSpec(shape="no-sharing", requests=60, prefix_tokens=2000, rate=6)
    doc = _advice([str(_capture(tmp_path / "capture.jsonl", spec))], capsys)
    c = doc["concurrency"]
    assert c["timed"] == 60 and c["backends"] == 2
    assert 1 <= c["backend_p50"] <= c["backend_max"] <= c["fleet_max"]
    assert 4 < c["rate"] < 8  # Poisson at 6 per second
    rate = 1000 / SimParams().prefill_per_token_ms  # what the simulator prefills, per second
    estimate = doc["prefill"]["tokens_per_s"]
    assert 0.7 * rate < estimate <= 1.05 * rate  # queueing only lowers the estimate
    kv = _setting(doc, "KV_AWARE")["params"]
    assert kv["prefill_tokens_per_s"] == pytest.approx(estimate, rel=0.06)
    fair = c["fleet_p99"] / c["backends"]
    assert kv["concurrency_threshold"] == max(4, -(-2 * fair // 1))


def test_skipped_records_are_counted_and_the_text_report_reads(tmp_path, capsys):
    spec = WorkloadSpec(shape="long-prefix", requests=20, groups=2, prefix_tokens=500, rate=4)
    base = {"v": 1, "at": EPOCH, "model": MODEL, "status": 200, "duration_ms": 5.0}
    extra = [
        {**base, "path": "/v1/embeddings", "request": {"model": MODEL, "input": "x"}},
        {**base, "path": "/v1/chat/completions", "status": 503, "request": {"messages": []}},
        {**base, "path": "/v1/chat/completions", "usage": None},
        {**base, "path": "/v1/chat/completions", "request": {"messages": "not a list"}},
    ]
    capture = _capture(tmp_path / "capture.jsonl", spec, extra=extra)
    assert kvroute(["recommend", str(capture)]) == 0
    out = capsys.readouterr().out
    assert (
        f"{capture}: 20 requests (1 of other endpoints; 1 that failed; 1 without a request "
        "body; 1 with a request body routing cannot read, left out)"
    ) in out
    assert "Advice: KV_AWARE\n  routing: {strategy: KV_AWARE" in out
    assert "Runner-up: PREFIX_AWARE\n  routing: {strategy: PREFIX_AWARE, prefix_length: 256" in out


def _captured(i: int, messages: list[dict]) -> Captured:
    """A chat request as the router's request path hands it to the capture's writer."""
    entry = Entry(
        EPOCH + i, 0.5, 0.1, f"req-{i}", None, "POST", "/v1/chat/completions", MODEL,
        "KV_AWARE", "b0", "kv_hit", "", "200", 0, 900, 0, 9, "",
    )  # fmt: skip
    request = orjson.dumps({"model": MODEL, "messages": messages})
    return Captured(entry, None, (), request, b'{"choices": []}', False)


def _complete_lines(gz: bytes) -> int:
    """The newlines in what a gzip file's bytes decompress to, member after member, its
    last member's end-of-stream marker there or not."""
    lines = 0
    while gz:
        member = zlib.decompressobj(zlib.MAX_WBITS | 16)
        lines += member.decompress(gz).count(b"\n")
        gz = member.unused_data
    return lines


def _unfinished(capsys, path: Path) -> int:
    """The requests recommend reads from `path`, with its one-line warning checked."""
    assert recommend.main([str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"kvroute recommend: warning: {path} ends mid-record (still being written, or its "
        "writer was killed); read up to its last complete line\n"
    )
    return orjson.loads(out)["prefixes"]["requests"]


def test_a_gzip_capture_still_being_written_or_killed_is_read_to_its_last_line(tmp_path, capsys):
    """The router's writer with gzip on, not closed: its file holds whole gzip members,
    read without a warning; cut short, as `kill -9` may leave it, it is read up to its
    last complete line, with the warning."""
    spec = WorkloadSpec(shape="long-prefix", requests=12, groups=3, prefix_tokens=500)
    written = tmp_path / "capture"
    capture = Capture(
        CaptureConfig(enabled=True, path=str(written), gzip=True), lambda _: None, lambda: None
    )
    capture.start()
    try:
        for req in generate(spec):
            capture.add(_captured(req.index, req.messages))
        (path,) = written.iterdir()
        deadline = time.monotonic() + 10
        while _complete_lines(path.read_bytes()) < 12:  # the writer flushes when idle
            assert time.monotonic() < deadline, "the capture was not flushed"
            time.sleep(0.01)
        assert recommend.main([str(path), "--json"]) == 0
        out, err = capsys.readouterr()
        assert (err, orjson.loads(out)["prefixes"]["requests"]) == ("", 12)
        killed = tmp_path / "killed.jsonl.gz"
        killed.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        whole = _complete_lines(killed.read_bytes())
        assert 0 < whole < 12
        assert _unfinished(capsys, killed) == whole
    finally:
        capture.close()


def test_a_plain_capture_whose_last_line_is_cut_is_read_without_it(tmp_path, capsys):
    spec = WorkloadSpec(shape="long-prefix", requests=12, groups=3, prefix_tokens=500, rate=4)
    path = _capture(tmp_path / "capture.jsonl", spec)
    data = path.read_bytes()
    path.write_bytes(data[: data.rindex(b"\n", 0, -1) + 100])  # the 12th line cut
    assert _unfinished(capsys, path) == 11


def _traffic(*prompts: str) -> Traffic:
    return Traffic("test", [Seen(model="m", prompt=p) for p in prompts])


CASES = {
    # name: (prompts, shared tokens of each, global tokens, groups as (requests, tokens))
    "one document, two questions": (
        ["d" * 4096 + "q1" * 100, "d" * 4096 + "q2" * 100],
        [0, 1024],
        1024,
        [],
    ),
    "cut inside a block rounds down": (["x" * 100 + "a", "x" * 100 + "b"], [0, 16], 16, []),
    "two families past a common part": (
        [
            "s" * 256 + "A" * 512 + "1" * 64,
            "s" * 256 + "A" * 512 + "2" * 64,
            "s" * 256 + "B" * 512 + "3" * 64,
            "s" * 256 + "B" * 512 + "4" * 64,
        ],
        [0, 192, 64, 192],
        64,
        [(2, 192), (2, 192)],
    ),
    "nothing in common": (["a" * 400, "b" * 400, "c" * 400], [0, 0, 0], 0, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_shared_prefixes_by_block_chains(name):
    prompts, shared, global_tokens, groups = CASES[name]
    p = prefixes(_traffic(*prompts), Tokens())
    assert p.shared == shared
    assert p.global_tokens == global_tokens
    assert [(g.requests, g.shared_tokens) for g in p.groups] == groups


def test_tenants_and_models_never_share():
    same = "p" * 1000
    requests = [Seen(model="m", prompt=same), Seen(model="m", tenant="t", prompt=same)]
    traffic = Traffic("test", [*requests, Seen(model="other", prompt=same)])
    assert prefixes(traffic, Tokens()).shared == [0, 0, 0]


def test_concurrency_counts_overlaps_per_backend():
    spans = [(0.0, 2.0, "a"), (1.0, 3.0, "a"), (1.5, 2.5, "b"), (3.0, 4.0, "a")]
    requests = [Seen(model="m", end=e, duration=e - s, backend=b) for s, e, b in spans]
    c = concurrency(Traffic("test", requests), None)
    assert (c.fleet_max, c.backend_max, c.backends) == (3, 2, 2)  # the last starts as one ends
    assert c.rate == pytest.approx(3 / 3.0)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing", None, "No such file or directory"),
        (
            "garbage.jsonl",
            b'{"v": 1, "at": 1, "path": "/v1/completions"}\nnot json\n',
            ":2: not a JSON line",
        ),
        ("wrong.jsonl", b'{"at": 1, "path": "/v1/completions"}\n', ":1: not a capture record"),
        ("v2.jsonl", b'{"v": 2, "at": 1, "path": "/v1/completions"}\n', "capture format v2"),
        (
            "bodiless.jsonl",
            b'{"v": 1, "at": 1, "path": "/v1/chat/completions"}\n',
            "no request with a prompt to analyse (1 without a request body)",
        ),
        ("broken.jsonl.gz", b"not gzip", "Not a gzipped file"),
    ],
)
def test_bad_input_exits_2_with_the_reason(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    assert kvroute(["recommend", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute recommend: {path}")
    assert message in err


def test_capture_or_workload_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        recommend.main([])
    assert exc.value.code == 2
    assert "give capture files or --workload" in capsys.readouterr().err


TINY = [
    "--workload=long-prefix",
    "--requests=12",
    "--groups=3",
    "--prefix-tokens=1000",
    "--max-tokens=8",
    "--rate=4",
    "--backends=2",
    "--time-scale=0.05",
    "--max-wall=20",
]


def test_validate_runs_the_advice_and_the_runner_up(capsys):
    doc = _advice([*TINY, "--validate"], capsys)
    rows = doc["validation"]["rows"]
    assert [r["strategy"] for r in rows] == ["KV_AWARE", "PREFIX_AWARE"]
    assert all((r["ok"], r["failed"]) == (12, 0) for r in rows)
    assert all(r["hit_rate"] > 0.3 for r in rows)  # 3 of every 4 requests find their document
    assert doc["validation"]["workload"]["requests"] == 12
    assert doc["validation"]["favoured"] in ("KV_AWARE", "PREFIX_AWARE")


def test_validate_on_a_capture_matches_its_shape(tmp_path, capsys):
    spec = WorkloadSpec(
        shape="multi-turn", requests=12, groups=3, prefix_tokens=300, max_tokens=8, rate=4
    )
    capture = str(_capture(tmp_path / "capture.jsonl", spec))
    argv = [capture, "--validate", "--requests=8", "--time-scale=0.05", "--max-wall=20"]
    assert recommend.main(argv) == 0
    out = capsys.readouterr().out
    assert "Validation on simulated backends: multi-turn, 8 requests, 3 groups" in out
    assert "Verdict: the " in out and " ms for KV_AWARE, " in out
    assert "KV_AWARE " in out and "PREFIX_AWARE " in out


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        kvroute(["recommend", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "kvroute recommend capture-*.jsonl.gz" in out
    assert "--validate" in out and "--workload" in out


def _row(strategy: str, p90: float | None) -> Summary:
    measured = set(Summary.__struct_fields__) - {"strategy", "seed", "ok", "failed"}
    unknown = dict.fromkeys(measured - {"ttft_p90", "hit_rate_source", "unmeasured"})
    return Summary(
        strategy=strategy, seed=0, ok=1, failed=0, ttft_p90=p90, hit_rate_source="", **unknown
    )


@pytest.mark.parametrize(
    ("p90s", "expected"),
    [
        ((0.100, 0.080), "PREFIX_AWARE"),  # the runner-up clearly better
        ((0.100, 0.095), "KV_AWARE"),  # within the noise: the advice stands
        ((0.100, 0.120), "KV_AWARE"),
        ((0.100, None), "KV_AWARE"),  # nothing to compare
    ],
)
def test_the_verdict_prefers_the_runner_up_only_on_a_clear_win(p90s, expected):
    rows = [_row("KV_AWARE", p90s[0]), _row("PREFIX_AWARE", p90s[1])]
    strategy, why = recommend.favoured(rows)
    assert strategy == expected
    if p90s[1] is not None:
        assert f"P90 TTFT 100 ms for KV_AWARE, {p90s[1] * 1000:.0f} ms for PREFIX_AWARE" in why
