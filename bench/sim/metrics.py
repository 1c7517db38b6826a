"""Prometheus metrics of one simulated server, under vLLM V1's exact names and types.

One CollectorRegistry per backend (a restart builds a new one: counters start over, as
in a new vLLM process). Every series carries `model_name` and `engine="0"`, except
`vllm:cache_config_info`, which like vLLM carries `engine` plus one label per cache
setting. Counters are declared without `_total`; prometheus_client adds it on export.
Values are recorded once per engine step, so gauges show the last step. Durations are
wall-clock seconds (already scaled by time_scale), i.e. what clients observe.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from bench.sim.params import SimParams

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vllm/v1/metrics/buckets.py defaults (see docs/vllm-telemetry.md §1.2)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_LABELS = ("model_name", "engine")


class SimMetrics:
    def __init__(self, params: SimParams) -> None:
        self.registry = CollectorRegistry()
        values = (params.model, "0")
        reg = self.registry

        # Each helper returns the family's only child, so recording is one plain call.
        def gauge(name: str, doc: str) -> Gauge:
            family = Gauge(name, doc, _LABELS, registry=reg, multiprocess_mode="mostrecent")
            return family.labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=reg, buckets=buckets).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*_LABELS, "finished_reason"),
            registry=reg,
        )
        self.success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self._cache_config_info(params)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _cache_config_info(self, params: SimParams) -> None:
        info = {
            "block_size": str(params.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(params.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "hash_block_size": str(params.block_size),
            "num_cpu_blocks": str(params.num_cpu_blocks or None),
            "num_gpu_blocks": str(params.num_gpu_blocks),
            "prefix_caching_hash_algo": "xxhash",
        }
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            (*info, "engine"),
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        gauge.labels(*info.values(), "0").set(1)
