"""What the async jobs and batches do: jobs accepted, attempts begun, jobs ended by
outcome, leases lost, webhook deliveries by result, and the job store's failures.
Labels are the router's own words, never a client's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

#: how a job came: a single async request, or a line of a batch
JOB_KINDS = ("async", "batch")
JOB_OUTCOMES = ("succeeded", "failed")
#: a webhook delivery attempt's result: taken, to be tried again, or given up
HOOK_RESULTS = ("delivered", "retried", "failed")
#: the job store's calls (router/jobs/store.py's JobStore), as its failures label them
STORE_OPS = (
    "put", "get", "claim", "renew", "finish", "release", "expire", "unsettled", "due_hook",
    "hook_tried", "put_file", "file", "content", "files", "delete_file", "put_batch",
    "batch", "batches", "cancel_batch", "settle",
)  # fmt: skip


class JobMetrics:
    """The job counters of `Metrics`."""

    def _declare_jobs(self, r: CollectorRegistry) -> None:
        self.jobs_accepted = Counter(
            "kvroute_jobs_accepted",
            "Jobs stored, by kind: async (POST /v1/async/...) or batch (a batch's lines)",
            ["kind"],
            registry=r,
        )
        self.job_attempts = Counter(
            "kvroute_job_attempts",
            "Job attempts begun: each claim of a job, the ones after a lease ran out (a "
            "worker died mid-job) or after a worker stopped included",
            registry=r,
        )
        self.jobs_ended = Counter(
            "kvroute_jobs_ended",
            "Jobs whose answer was stored, by outcome: succeeded (below 400) or failed",
            ["outcome"],
            registry=r,
        )
        self.job_refusals_retried = Counter(
            "kvroute_job_refusals_retried",
            "Job attempts the router refused for now (admission's 429, no backend "
            "available) and tried again after a wait",
            registry=r,
        )
        self.job_leases_lost = Counter(
            "kvroute_job_leases_lost",
            "Jobs whose lease ran out while this worker ran them (another may run them)",
            registry=r,
        )
        self.webhooks = Counter(
            "kvroute_webhooks",
            "Webhook delivery attempts, by result: delivered, retried (to be tried again) "
            "or failed (given up)",
            ["result"],
            registry=r,
        )
        self.job_store_errors = Counter(
            "kvroute_job_store_errors",
            "Job store calls that failed (a full disk, a database locked, corrupt or gone, "
            "Redis away), by call: the job routes answered 503, the runner backed off",
            ["op"],
            registry=r,
        )
        self.job_store_unavailable = Gauge(
            "kvroute_job_store_unavailable",
            "1 while the job store's last call in a worker failed (/ready says why)",
            registry=r,
            multiprocess_mode="livemax",
        )
        for op in STORE_OPS:
            self.job_store_errors.labels(op)
        for kind in JOB_KINDS:
            self.jobs_accepted.labels(kind)
        for outcome in JOB_OUTCOMES:
            self.jobs_ended.labels(outcome)
        for result in HOOK_RESULTS:
            self.webhooks.labels(result)
