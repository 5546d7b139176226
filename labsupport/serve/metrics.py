"""The course server's Prometheus metrics (``GET /metrics``), named after vLLM's.

Each app gets its own :class:`prometheus_client.CollectorRegistry` (never the global one), so tests
and several apps in one Python do not clash. Names take the prefix ``course:`` where vLLM's take
``vllm:`` (https://docs.vllm.ai/en/stable/usage/metrics/ and vLLM's ``docs/design/metrics.md``):

==================================================  ==================================================
course metric                                       the vLLM metric it mirrors
==================================================  ==================================================
``course:num_requests_running`` (gauge)             ``vllm:num_requests_running``
``course:num_requests_waiting`` (gauge)             ``vllm:num_requests_waiting``
``course:kv_cache_usage_perc`` (gauge, 0 to 1;      ``vllm:kv_cache_usage_perc`` (named
continuous engine only)                             ``vllm:gpu_cache_usage_perc`` before vLLM 0.9,
                                                    deprecated since)
``course:spec_decode_num_draft_tokens_total``,      ``vllm:spec_decode_num_draft_tokens_total``,
``course:spec_decode_num_accepted_tokens_total``    ``vllm:spec_decode_num_accepted_tokens_total``
(counters; continuous engine only)                  (acceptance rate: accepted over draft, each a rate)
``course:slots_used``, ``course:slots_total``       none: the server's admission limit (``--max-requests``)
``course:draining`` (gauge, 0 or 1)                 none: 1 once a graceful drain has begun
``course:time_to_first_token_seconds`` (histogram)  ``vllm:time_to_first_token_seconds``
``course:inter_token_latency_seconds`` (histogram)  ``vllm:inter_token_latency_seconds`` (named
                                                    ``vllm:time_per_output_token_seconds`` before
                                                    vLLM 0.11; the old name since removed,
                                                    vllm-project/vllm#32661)
``course:e2e_request_latency_seconds`` (histogram)  ``vllm:e2e_request_latency_seconds``
``course:prompt_tokens_total`` (counter)            ``vllm:prompt_tokens_total``
``course:generation_tokens_total`` (counter)        ``vllm:generation_tokens_total``
``course:request_success_total{finished_reason}``   ``vllm:request_success_total{finished_reason}``
``course:request_aborted_total{reason}``            none (vLLM counts aborts as ``finished_reason="abort"``)
``course:request_rejected_total{reason}``           none: vLLM's opt-in admission caps (#49445) answer
                                                    503 and no release counts the refusals (a
                                                    counter is proposed in #55812)
``course:stack_prefix_cache_admissions_total``      none: with ``--stack``, the admissions replayed on
``{result}`` (``agreed`` or ``disagreed``)          a learner's prefix cache, by whether its hits
                                                    agreed (:mod:`labsupport.serve.stack_engine`)
==================================================  ==================================================

Conventions: latencies are measured in the HTTP layer from a request's arrival (its headers are in)
with ``time.monotonic()``; time to first token ends when the first token leaves the back end, so
it includes queueing and the prefill. ``prompt_tokens_total`` counts a request's prompt when it is
admitted; ``generation_tokens_total`` counts each token as it is produced, aborted requests
included. ``request_success_total`` counts requests that finished (``stop`` or ``length``);
``request_aborted_total`` those stopped early, by why: ``client_disconnect``, ``cancel`` (``POST
/v1/requests/{id}/cancel``) or ``drain_timeout``; ``request_rejected_total`` the completions
requests refused before admission, by the error code (``server_full`` for 429, ``draining`` for 503,
else the HTTP status, such as ``400``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "course:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StateCollector:
    """Gauges read from the back end's ``stats()`` at scrape time, so they are never stale."""

    def __init__(self, backend, draining):
        self.backend, self.draining = backend, draining

    def collect(self):
        stats = self.backend.stats()  # a back end may leave out counts it does not keep
        for name, key, doc in (
            ("num_requests_running", "running", "Requests generating now."),
            ("num_requests_waiting", "queued", "Requests admitted and waiting to be scheduled."),
            ("slots_used", "slots_used", "Admission slots taken (queued, running or being sent)."),
            ("slots_total", "slots_total", "Admission slots (--max-requests); more get HTTP 429."),
        ):
            if key in stats:
                yield GaugeMetricFamily(PREFIX + name, doc, value=stats[key])
        yield GaugeMetricFamily(PREFIX + "draining", "1 while the server drains: new requests get HTTP 503.",
                                value=1 if self.draining() else 0)
        if stats.get("kv_blocks_total"):
            used = 1 - stats["kv_blocks_free"] / stats["kv_blocks_total"]
            yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
                                    value=used)
        for name, key, doc in (  # vLLM's spec_decode_num_draft_tokens and _accepted_tokens
            ("spec_decode_num_draft_tokens", "spec_draft_tokens", "Speculative draft tokens verified."),
            ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Speculative draft tokens accepted."),
        ):
            if key in stats:
                yield CounterMetricFamily(PREFIX + name, doc, value=stats[key])
        replay = stats.get("stack_prefix_cache")  # --stack with a learner's prefix cache
        if replay:
            family = CounterMetricFamily(PREFIX + "stack_prefix_cache_admissions",
                                         "Admissions replayed on the learner's prefix cache, by whether its hits agreed.",
                                         labels=["result"])
            for result in ("agreed", "disagreed"):
                family.add_metric([result], replay[result])
            yield family


class ServerMetrics:
    """The metrics of one app, in their own registry."""

    def __init__(self, backend, draining=lambda: False):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(backend, draining))
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token of a finished request.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.aborted = Counter(PREFIX + "request_aborted", "Admitted requests stopped early, by why.",
                               ["reason"], registry=r)
        self.rejected = Counter(PREFIX + "request_rejected", "Completions requests refused before admission.",
                                ["reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
