"""What the async jobs and batches do: jobs accepted, attempts begun, jobs ended by
outcome, leases lost, and webhook deliveries by result. Labels are the router's own
words, never a client's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

#: how a job came: a single async request, or a line of a batch
JOB_KINDS = ("async", "batch")
JOB_OUTCOMES = ("succeeded", "failed")
#: a webhook delivery attempt's result: taken, to be tried again, or given up
HOOK_RESULTS = ("delivered", "retried", "failed")


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
        for kind in JOB_KINDS:
            self.jobs_accepted.labels(kind)
        for outcome in JOB_OUTCOMES:
            self.jobs_ended.labels(outcome)
        for result in HOOK_RESULTS:
            self.webhooks.labels(result)
