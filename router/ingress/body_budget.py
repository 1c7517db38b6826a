"""The bytes of request bodies a worker holds at once (`limits.max_buffered_body_bytes`).

Why: a body is held whole while it arrives (up to `body_timeout`) and while its request
runs (dispatch forwards it, and keeps it for a retry), so without a bound a crowd of
slow or large uploads grows the router's memory until it dies. A request reserves its
body's size before the body is read: the declared Content-Length at once, a chunked or
decoded body chunk by chunk; a reservation that does not fit refuses the request (503 +
Retry-After), and the reservation is given back when the request ends.

With several worker processes each gets an equal share of the total, at least one
`max_body_bytes` body (so any body the limits allow can be taken): no shared state on
the request path, at the cost of a worker refusing while another has room.

Cost: an addition and a comparison per request.
"""

from __future__ import annotations

from router.errors import BodyBudgetFull


def worker_share(total: int, workers: int, max_body: int) -> int:
    """One worker's budget out of `total` bytes for the router."""
    return max(total // workers, max_body)


class BodyBudget:
    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # bytes reserved by bodies arriving or in requests that run

    def take(self, size: int) -> None:
        """Reserve `size` bytes, or raise BodyBudgetFull."""
        if self.held + size > self.limit:
            raise BodyBudgetFull(
                "The router holds as many request bodies as it may; retry shortly.",
                retry_after=1,
            )
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size
