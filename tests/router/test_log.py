"""The throttled logger: a burst of lines per window, then a count of those left out."""

from __future__ import annotations

import logging
import time

from router.log import Throttled


def test_a_throttled_logger_counts_what_it_left_out(caplog) -> None:
    logger = logging.getLogger("kvroute.test_throttled")
    caplog.set_level(logging.WARNING, logger=logger.name)
    throttled = Throttled(logger, burst=1, window=0.05)
    said = [throttled.warning("failed %d", n) for n in range(3)]
    ends = time.monotonic() + 0.05
    while time.monotonic() < ends:  # wait for the window's end (a monotonic clock gets there)
        time.sleep(0.01)
    said.append(throttled.warning("failed %d", 3))
    assert said == [True, False, False, True]
    assert [r.getMessage() for r in caplog.records] == [
        "failed 0",
        "2 similar lines left out in the last 0.05 s",
        "failed 3",
    ]
