"""`GET /metrics`: Prometheus text, in llama.cpp's server's names where it has one.

Figures are added up when a generation ends (on its generation thread, from the stats the engine
returns), so a scrape reads a few numbers under a lock of its own and never waits on the engine.
The gauges (requests generating and waiting, the prompt cache's bytes) are read at the scrape from
the scheduler, on the event loop. Counters only grow for the life of the server process.

llama.cpp's names (`llama-server --metrics`): llamacpp:prompt_tokens_total (prompt tokens
evaluated: those reused from a KV cache are not), llamacpp:prompt_seconds_total,
llamacpp:tokens_predicted_total, llamacpp:tokens_predicted_seconds_total,
llamacpp:requests_processing, llamacpp:requests_deferred and the speculation counters
llamacpp:spec_decode_num_drafts_total, ..._num_draft_tokens_total, ..._num_accepted_tokens_total.
edgespec's own are named edgespec_*.
"""
from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any, Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

# stats field -> (family name without _total, help), added up over every generation
TOTALS = {
    "prompt_evaluated": ("llamacpp:prompt_tokens", "Prompt tokens evaluated (those reused from a KV cache are not)."),
    "prompt_seconds": ("llamacpp:prompt_seconds", "Seconds spent evaluating prompts."),
    "generated": ("llamacpp:tokens_predicted", "Tokens generated."),
    "decode_seconds": ("llamacpp:tokens_predicted_seconds",
                       "Seconds spent generating after each answer's first token (which the prompt's pass gives)."),
    "drafts": ("llamacpp:spec_decode_num_drafts", "Rounds that verified a draft."),
    "drafted": ("llamacpp:spec_decode_num_draft_tokens", "Draft tokens verified by the target."),
    "accepted": ("llamacpp:spec_decode_num_accepted_tokens", "Draft tokens accepted by exact verification."),
    "reused_prompt_tokens": ("edgespec_prompt_tokens_reused",
                             "Prompt tokens not evaluated again: kept in the context or restored from the cache."),
    "restored_prompt_tokens": ("edgespec_prompt_tokens_restored", "Prompt tokens restored from the prompt cache."),
    "rounds": ("edgespec_rounds", "Speculative rounds (each verifies a draft, or decodes one token)."),
    "target_forwards": ("edgespec_target_passes", "Verifying passes of the target model."),
    "exact_cuts": ("edgespec_exact_cut_rounds",
                   "Rounds whose rows went in a pass apart from other sequences' (--parallel-exact)."),
}
# by_drafter entry field -> (family name, help), labelled by drafter ("none": rounds without a draft)
BY_DRAFTER = {
    "rounds": ("edgespec_drafter_rounds", "Rounds, by the drafter that chose the draft."),
    "drafted": ("edgespec_drafter_drafted_tokens", "Draft tokens verified, by drafter."),
    "accepted": ("edgespec_drafter_accepted_tokens", "Draft tokens accepted, by drafter."),
    "seconds": ("edgespec_drafter_seconds", "Seconds of the rounds each drafter chose (drafting and pass)."),
}


class ServerMetrics:
    """The server's figures. `record(stats)` from any thread when a generation ends; `render()`
    the Prometheus text. `scheduler()` gives the worker.Scheduler (None before the app starts)."""

    def __init__(self, scheduler: Callable[[], Any], model: str):
        self._scheduler = scheduler
        self.model = model
        self._lock = threading.Lock()
        self._totals: dict[str, float] = dict.fromkeys(TOTALS, 0)
        self._by_drafter: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(BY_DRAFTER, 0))
        self._reasons: Counter = Counter()
        self.registry = CollectorRegistry(auto_describe=False)  # this app's own, not the process-wide one
        self.registry.register(self)

    # -- adding up (generation threads) ---------------------------------------------------------
    def record(self, stats, reason: str) -> None:
        add = {"prompt_evaluated": max(0, stats.prompt_tokens - stats.reused_prompt_tokens),
               "drafts": sum(stats.accept_histogram)}
        for name in TOTALS:
            if name not in add:
                add[name] = getattr(stats, name, 0) or 0
        with self._lock:
            for name, value in add.items():
                self._totals[name] += value
            for drafter, d in (stats.by_drafter or {}).items():
                mine = self._by_drafter[drafter]
                for name in BY_DRAFTER:
                    mine[name] += d.get(name, 0) or 0
            self._reasons[reason or "unknown"] += 1

    def watch(self, opener: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`opener` (engine -> Stream, as worker.Job takes it) whose stream, when it ends for any
        reason (its end, a stop, a cancel, an error), records its stats."""
        def opened(engine):
            return _Recorded(opener(engine), self)
        return opened

    # -- a scrape (event loop) --------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        with self._lock:
            totals = dict(self._totals)
            by_drafter = {k: dict(v) for k, v in self._by_drafter.items()}
            reasons = dict(self._reasons)
        for name, (family, doc) in TOTALS.items():
            yield CounterMetricFamily(family, doc, value=totals[name])
        for name, (family, doc) in BY_DRAFTER.items():
            f = CounterMetricFamily(family, doc, labels=["drafter"])
            for drafter in sorted(by_drafter):
                f.add_metric([drafter], by_drafter[drafter][name])
            yield f
        f = CounterMetricFamily("edgespec_requests", "Generations ended, by finish reason.", labels=["finish_reason"])
        for reason in sorted(reasons):
            f.add_metric([reason], reasons[reason])
        yield f
        # llama.cpp's averages: tokens per second over everything so far
        for family, tokens, seconds, doc in (
                ("llamacpp:prompt_tokens_seconds", "prompt_evaluated", "prompt_seconds",
                 "Average prompt throughput (tokens/s)."),
                ("llamacpp:predicted_tokens_seconds", "generated", "decode_seconds",
                 "Average generation throughput (tokens/s).")):
            yield GaugeMetricFamily(family, doc, value=totals[tokens] / totals[seconds] if totals[seconds] else 0.0)
        yield from self._live()

    def _live(self):
        s = self._scheduler()
        ready = s is not None and s.state == "ready"
        yield GaugeMetricFamily("llamacpp:requests_processing", "Requests generating now.",
                                value=s.running if ready else 0)
        yield GaugeMetricFamily("llamacpp:requests_deferred", "Requests waiting for a place.",
                                value=s.waiting if ready else 0)
        info = GaugeMetricFamily("edgespec_model_info", "The model served (1), its drafter and parallel sequences.",
                                 labels=["model", "drafter", "state"])
        engine = s.engine if s is not None else None
        info.add_metric([self.model, getattr(engine, "mode", "") if engine is not None else "",
                         s.state if s is not None else "starting"], 1)
        yield info
        yield GaugeMetricFamily("edgespec_parallel", "Requests answered at once.", value=(s.parallel or 0) if s else 0)
        cache = getattr(engine, "cache", None)
        if cache is None:
            return
        # the prompt cache's own figures: plain attributes, read without its lock or the engine's
        for name, attr, doc in (("edgespec_prompt_cache_hits", "hits", "Conversations restored from the prompt cache."),
                                ("edgespec_prompt_cache_stores", "stores", "Conversations saved in the prompt cache."),
                                ("edgespec_prompt_cache_evictions", "evictions",
                                 "Conversations dropped from the prompt cache to make room.")):
            yield CounterMetricFamily(name, doc, value=getattr(cache, attr, 0))
        yield GaugeMetricFamily("edgespec_prompt_cache_bytes", "Bytes the prompt cache holds in host RAM.",
                                value=getattr(cache, "bytes", 0))
        yield GaugeMetricFamily("edgespec_prompt_cache_capacity_bytes", "The prompt cache's size (--cache-ram).",
                                value=getattr(cache, "capacity", 0))
        yield GaugeMetricFamily("edgespec_prompt_cache_entries", "Conversations the prompt cache holds.",
                                value=len(cache))


class _Recorded:
    """An engine Stream that hands its stats to the metrics once it is left (worker.Job uses
    `with stream:` and iterates it on the generation thread)."""

    def __init__(self, stream, metrics: ServerMetrics):
        self._stream, self._metrics = stream, metrics
        self._recorded = False

    def __enter__(self):
        self._stream.__enter__()
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        try:
            return self._stream.__exit__(*exc)
        finally:
            self._record()

    def __iter__(self):
        return iter(self._stream)

    def __getattr__(self, name):  # stats, finish_reason, tool_calls, cancel ...
        return getattr(self._stream, name)

    def _record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        stats = getattr(self._stream, "stats", None)
        if stats is not None:
            reason = getattr(self._stream, "finish_reason", None) or "cancelled"
            try:
                self._metrics.record(stats, reason)
            except Exception:  # a figure must never cost an answer
                import logging
                logging.getLogger("edgespec.server").exception("metrics: could not record a generation")
