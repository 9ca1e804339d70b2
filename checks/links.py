"""``dtrun doctor --links``: point-to-point bandwidth and latency between hosts, and the outlier.

The costliest cluster problems that are not hangs are one slow host or link (a NIC at
1 Gb/s among 100 Gb/s ones, a shaping rule, a bad cable): every collective runs at the
speed of its slowest link. Each probe keeps a link listener; one host at a time sends
to its destinations, one after another, so no two measurements share a NIC.

Which pairs (``plan``): every ordered pair up to ``ALL_PAIRS_MAX_HOSTS`` hosts; on
larger clusters a ring (each host sends to the next) plus a sample of random ordered
pairs, so each host is measured both sending and receiving at little cost.

What is named (``link_findings``): a pair is slow below the median bandwidth divided by
``SLOW_FACTOR``. A host whose measured sends (or receives) are all slow, two at least,
is the outlier; slow pairs it does not explain are named as pairs. A slow round trip
(above 5 × the median and 2 ms more) is named too. Every suspect pair is measured twice
(``suspects``, ``better``): a scheduler hiccup does not repeat, a 50 Mb/s link does.
"""
from __future__ import annotations

import random
import statistics
from collections import defaultdict
from typing import Mapping, Optional, Sequence

from dtrun.checks.result import OK, WARN, Finding

CHECK = "network"
ALL_PAIRS_MAX_HOSTS = 8
SLOW_FACTOR = 4.0  # a link below median / 4 is slow (1 Gb/s among 10 or 100 Gb/s; 25 among 100)
RTT_FACTOR = 5.0  # a round trip above median * 5 and RTT_MIN_EXTRA_MS more is slow
RTT_MIN_EXTRA_MS = 2.0
MAX_BYTES = 32 << 20
MAX_SECONDS = 0.3
PINGS = 10
MAX_SAMPLE = 4096


def plan(names: Sequence[str], sample: Optional[int] = None, seed: int = 0) -> list[tuple[str, str]]:
    """The ordered (sender, receiver) pairs to measure (pure, deterministic for a seed)."""
    n = len(names)
    if n < 2:
        return []
    if n <= ALL_PAIRS_MAX_HOSTS and sample is None:
        return [(a, b) for a in names for b in names if a != b]
    pairs = [(names[i], names[(i + 1) % n]) for i in range(n)]
    if n == 2:
        pairs = [(names[0], names[1]), (names[1], names[0])]
    want = n if sample is None else sample
    ring = set(pairs)
    others = [(a, b) for a in names for b in names if a != b and (a, b) not in ring]
    rng = random.Random(seed)
    pairs += rng.sample(others, min(want, len(others)))
    return pairs


def _fmt_rate(mbps: float) -> str:
    return f"{mbps / 1000:.1f} Gb/s" if mbps >= 1000 else f"{mbps:.0f} Mb/s"


def slow_pairs(results: Mapping[tuple[str, str], dict]) -> tuple[Optional[float], list[tuple[str, str]]]:
    """(median bandwidth in Mb/s, pairs below median / SLOW_FACTOR) of the measured pairs."""
    rates = [r["mbps"] for r in results.values() if r.get("mbps")]
    if len(rates) < 2:
        return None, []
    median = statistics.median(rates)
    return median, [p for p, r in results.items() if r.get("mbps") and r["mbps"] < median / SLOW_FACTOR]


def _slow_rtts(results: Mapping[tuple[str, str], dict]) -> tuple[Optional[float], list[tuple[str, str]]]:
    rtts = [r["rtt_ms"] for r in results.values() if r.get("rtt_ms") is not None]
    if len(rtts) < 2:
        return None, []
    median = statistics.median(rtts)
    return median, [p for p, r in results.items() if r.get("rtt_ms") is not None
                    and r["rtt_ms"] > max(median * RTT_FACTOR, median + RTT_MIN_EXTRA_MS)]


def suspects(results: Mapping[tuple[str, str], dict]) -> list[tuple[str, str]]:
    """Pairs to measure again before naming anything: slow bandwidth, slow round trip, or an error."""
    out = dict.fromkeys(slow_pairs(results)[1] + _slow_rtts(results)[1])
    out.update(dict.fromkeys(p for p, r in results.items() if r.get("error")))
    return list(out)


def better(first: dict, second: dict) -> dict:
    """The better of two measurements of one pair: the higher bandwidth, the lower round trip."""
    if first.get("error") or not first.get("mbps"):
        return second if not second.get("error") else first
    if second.get("error"):
        return first
    out = dict(first)
    out["mbps"] = max(first["mbps"], second.get("mbps") or 0)
    rtts = [r for r in (first.get("rtt_ms"), second.get("rtt_ms")) if r is not None]
    out["rtt_ms"] = min(rtts) if rtts else None
    return out


def link_findings(results: Mapping[tuple[str, str], dict], names: Sequence[str]) -> list[Finding]:
    """Findings from {(sender, receiver): {"mbps", "rtt_ms", "error"}} (pure).

    The outlier host (or pair) gets a warning naming its rate against the median and a
    fix; every other measured host an ok line with its own figures.
    """
    findings: list[Finding] = []
    failed = {p: r for p, r in results.items() if r.get("error")}
    median, slow = slow_pairs(results)
    rtt_median, slow_rtt = _slow_rtts(results)
    sends, recvs = defaultdict(list), defaultdict(list)
    for a, b in results:
        if (a, b) not in failed:
            sends[a].append((a, b))
            recvs[b].append((a, b))
    blamed, unexplained = _blame(names, slow, sends, recvs)
    where = f"median {_fmt_rate(median)}" if median else ""
    for host, direction in blamed.items():
        mine = sends[host] if direction == "sending" else recvs[host]
        rates = sorted(results[p]["mbps"] for p in mine)
        shown = ", ".join(f"{a} → {b} {_fmt_rate(results[(a, b)]['mbps'])}" for a, b in mine[:4])
        more = f" (+{len(mine) - 4} more)" if len(mine) > 4 else ""
        findings.append(Finding(
            host, CHECK, WARN,
            f"slow link: {host} is the outlier {direction}, at {_fmt_rate(statistics.median(rates))} against the "
            f"{where} of all {len(results)} measured pairs ({shown}{more}); every collective runs at the speed of "
            f"its slowest link",
            f"on {host}: check the NIC's speed and duplex (ethtool DEV), a shaping or policing rule "
            f"(tc qdisc show dev DEV), the MTU (ip link) and the cable or switch port; or leave {host} out "
            f"(--exclude {host})"))
    for a, b in sorted(unexplained, key=lambda p: (names.index(p[0]), names.index(p[1]))):
        findings.append(Finding(
            a, CHECK, WARN,
            f"slow link: {a} → {b} at {_fmt_rate(results[(a, b)]['mbps'])} against the {where}, while both hosts "
            f"are fast with others",
            f"check the path between {a} and {b} (switch ports, routes, a policing rule; tc qdisc, ip route)"))
    for a, b in slow_rtt:
        if a in blamed or b in blamed:
            continue
        findings.append(Finding(
            a, CHECK, WARN,
            f"slow round trip: {a} → {b} takes {results[(a, b)]['rtt_ms']:.2f} ms against a median of "
            f"{rtt_median:.2f} ms",
            f"check the path between {a} and {b} (a congested or misrouted link)"))
    for (a, b), r in failed.items():
        findings.append(Finding(a, CHECK, WARN, f"link {a} → {b} could not be measured: {r['error']}",
                                "see the firewall column: the link test uses an ephemeral TCP port"))
    named = {f.host for f in findings}
    return findings + _ok_findings([h for h in names if h not in named], results, sends, recvs)


def _blame(names: Sequence[str], slow, sends, recvs) -> tuple[dict[str, str], set]:
    """({host: "sending" or "receiving"} for hosts all of whose links one way are slow, the slow pairs left)."""
    slow_set = set(slow)
    unexplained = set(slow)
    blamed: dict[str, str] = {}
    # The host with the most slow links first: it explains them, the rest are looked at again.
    for host in sorted(names, key=lambda h: -sum(1 for p in slow if h in p)):
        for direction, mine in (("sending", sends[host]), ("receiving", recvs[host])):
            if len(mine) >= 2 and all(p in slow_set for p in mine) and any(p in unexplained for p in mine):
                blamed[host] = direction
                unexplained -= set(mine)
                break
    return blamed, unexplained


def _ok_findings(hosts: Sequence[str], results, sends, recvs) -> list[Finding]:
    """An ok line with its own median rate and round trip for each host measured."""
    out = []
    for host in hosts:
        pairs = sends[host] + recvs[host]
        rates = [results[p]["mbps"] for p in pairs if results[p].get("mbps")]
        hrtts = [results[p]["rtt_ms"] for p in pairs if results[p].get("rtt_ms") is not None]
        if rates:
            out.append(Finding(host, CHECK, OK, f"links: {_fmt_rate(statistics.median(rates))} median over "
                                                f"{len(rates)} measured pair(s), round trip "
                                                f"{statistics.median(hrtts):.2f} ms"))
    return out


def summary(results: Mapping[tuple[str, str], dict], seconds: float) -> dict:
    """The links stage for the JSON report and the closing line."""
    median, slow = slow_pairs(results)
    rtts = [r["rtt_ms"] for r in results.values() if r.get("rtt_ms") is not None]
    return {"pairs": len(results), "seconds": round(seconds, 3), "median_mbps": median,
            "median_rtt_ms": statistics.median(rtts) if rtts else None,
            "slow_pairs": [list(p) for p in slow],
            "results": {f"{a} -> {b}": r for (a, b), r in results.items()}}
