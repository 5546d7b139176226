"""Routing requests to replicas: round robin, least loaded, prefix-aware (chapter 14).

A fleet of replicas behind one address needs a router, and with prefix caching (chapter 10) where a
request lands decides what it costs: a replica that recently served the same system prompt has its
blocks cached and prefills only the rest. Three policies, simulated on one workload:

* **round robin**: each request to the next replica. Even load, but every replica sees every prefix,
  so each cache holds a little of everything and hits rarely once there are more prefixes than a
  cache holds.
* **least loaded**: to the replica with the fewest requests in flight (load-aware). Evens out bursts
  and long requests; blind to caches, so it hits about as rarely as round robin.
* **prefix-aware**: every request with the same prefix to the same replica (a hash of the prefix),
  so each replica's cache holds its share of the prefixes and hits often. A popular prefix then
  loads one replica more than the others. **With a load bound** (consistent hashing with bounded
  loads, Mirrokni, Thorup and Zadimoghaddam, SODA 2018): when the prefix's replica holds more than
  ``1 + epsilon`` times the mean load, the request goes to the least loaded one instead, giving up
  that hit to keep the load even. Production routers mix the two signals in the same spirit: SGLang's
  router matches a request against an approximate prefix tree of each worker's recent requests and
  falls back to the least loaded worker when the loads are out of balance (LMSYS blog, "SGLang v0.4",
  December 2024).

The simulation (:func:`simulate_routing`) is discrete: one arrival per tick, each request holds its
replica for ``service_ticks`` ticks, each replica's cache holds ``cache_prefixes`` prefixes in LRU
order, and a hit saves the prefix's tokens. Popularity follows a Zipf law over the prefixes (a few
tenants send most requests).
"""

from __future__ import annotations

import collections
import hashlib
import random
from dataclasses import dataclass

from ._validate import positive_int, positive_number

__all__ = ["POLICIES", "RoutingResult", "simulate_routing", "zipf_prefixes"]

POLICIES = ("round robin", "least loaded", "prefix-aware", "prefix-aware, load-bounded")


@dataclass(frozen=True)
class RoutingResult:
    policy: str
    hit_rate: float  # the fraction of prompt tokens found in a cache
    peak_load_ratio: float  # the most requests in flight on one replica over the mean, at the worst tick once full
    served: tuple[int, ...]  # requests each replica served


def zipf_prefixes(n_requests: int, n_prefixes: int, exponent: float = 1.1, seed: int = 0) -> list[int]:
    """The prefix of each request, drawn with probability proportional to ``1 / rank**exponent``."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** positive_number("exponent", exponent) for rank in range(positive_int("n_prefixes",
                                                                                                    n_prefixes))]
    return rng.choices(range(n_prefixes), weights=weights, k=positive_int("n_requests", n_requests))


def _home(prefix: int, replicas: int) -> int:
    """The replica a prefix hashes to (a stable hash, as a router's must be across restarts)."""
    return int.from_bytes(hashlib.blake2b(str(prefix).encode(), digest_size=8).digest(), "big") % replicas


def simulate_routing(policy: str, prefixes: list[int], *, replicas: int, cache_prefixes: int, prefix_tokens: int,
                     suffix_tokens: int, service_ticks: int, epsilon: float = 0.25) -> RoutingResult:
    """Route ``prefixes`` (one request each, one per tick) with ``policy`` (module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")
    replicas, capacity = positive_int("replicas", replicas), positive_int("cache_prefixes", cache_prefixes)
    prefix_tokens, suffix_tokens = positive_int("prefix_tokens", prefix_tokens), positive_int("suffix_tokens",
                                                                                            suffix_tokens)
    service_ticks = positive_int("service_ticks", service_ticks)
    caches = [collections.OrderedDict() for _ in range(replicas)]
    finishing = collections.deque()  # (tick it ends, replica)
    load = [0] * replicas
    served = [0] * replicas
    hit_tokens = peak_ratio = 0.0
    for tick, prefix in enumerate(prefixes):
        while finishing and finishing[0][0] <= tick:
            load[finishing.popleft()[1]] -= 1
        least = min(range(replicas), key=lambda r: (load[r], r))
        if policy == "round robin":
            target = tick % replicas
        elif policy == "least loaded":
            target = least
        else:
            target = _home(prefix, replicas)
            mean = (sum(load) + 1) / replicas
            if policy == "prefix-aware, load-bounded" and load[target] + 1 > (1 + epsilon) * mean:
                target = least
        cache = caches[target]
        if prefix in cache:
            hit_tokens += prefix_tokens
            cache.move_to_end(prefix)
        else:
            cache[prefix] = True
            if len(cache) > capacity:
                cache.popitem(last=False)
        load[target] += 1
        served[target] += 1
        finishing.append((tick + service_ticks, target))
        if tick >= service_ticks:  # once the fleet is full: the first requests alone say nothing of balance
            peak_ratio = max(peak_ratio, max(load) / (sum(load) / replicas))
    total = len(prefixes) * (prefix_tokens + suffix_tokens)
    return RoutingResult(policy, hit_tokens / total, peak_ratio, tuple(served))
