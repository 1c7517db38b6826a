"""Tally: a stream's observations added to a histogram in one go, exactly as observe would."""

from __future__ import annotations

from importlib.metadata import version

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from router.metrics import Metrics, Tally

BUCKETS = (0.001, 0.01, 0.1, 1.0)
values = st.lists(st.floats(min_value=0, max_value=5, allow_nan=False), max_size=50)


def samples(histogram: Histogram) -> dict[tuple[str, str | None], float]:
    (family,) = histogram.collect()
    kept = (s for s in family.samples if not s.name.endswith("_created"))
    return {(s.name, s.labels.get("le")): s.value for s in kept}


@given(values, values)
def test_flushed_tally_equals_observing_each_value(first: list[float], second: list[float]) -> None:
    tallied = Histogram("t", "t", buckets=BUCKETS, registry=CollectorRegistry())
    observed = Histogram("t", "t", buckets=BUCKETS, registry=CollectorRegistry())
    tally = Tally(tallied)
    for batch in (first, second):  # a tally flushed twice adds each value once
        for v in batch:
            tally.observe(v)
            observed.observe(v)
        tally.flush()
    got, want = samples(tallied), samples(observed)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, value), key


def test_nothing_reaches_the_histogram_before_flush() -> None:
    histogram = Histogram("t", "t", buckets=BUCKETS, registry=CollectorRegistry())
    tally = Tally(histogram)
    tally.observe(0.01)  # on a bound: counted in that bucket, as observe does
    assert samples(histogram)["t_count", None] == 0
    tally.flush()
    assert samples(histogram)["t_bucket", "0.01"] == 1
    assert samples(histogram)["t_bucket", "0.001"] == 0


def test_build_info_names_the_installed_release() -> None:
    page = Metrics(list).render().decode()
    assert f'kvroute_build_info{{version="{version("kvroute")}"}} 1.0' in page
