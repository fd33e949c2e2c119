"""lit_rlhf against more than one peer: the run order within a repeat, the faster TRL release of each
workload, the summary a script reads and its tables. Pure Python, like report.py.

A run of compare.py keeps, per workload, one dict per repeat, ``{implementation: result}``; the first
implementation (A, lit_rlhf) is compared with each of the workload's peers (B = ``trl``, TRL 1.12.0, and
for W1 GRPO and W2 RM/DPO also C = ``trl-new``, the newest TRL release) on the runs of the same repeat.
The headline figures of a workload are against its faster peer, the one with the higher median
wall-clock throughput over the repeats; the figures against every peer are kept beside them.
"""

from __future__ import annotations

import statistics

from common import PPO
from report import THROUGHPUT_UNITS, base_workload, ppo_table, rm_table, throughput

# The workloads run against the newest TRL as well (W3 and control PPO need PPOTrainer, which left TRL
# after 1.12.0; control RM is a fixed-length control on a tiny GPT-2). Their bf16 rows follow the base row.
NEW_PEER_WORKLOADS = ("W1_grpo", "W2_rm", "W2_dpo")

# Targets of issue 28 for the headline ratios (throughput lit/faster TRL, peak RSS lit/faster TRL).
TARGETS = {
    "W1_grpo": (">= 2.5x", "<= 0.7x"),
    "W2_rm": (">= 2.0x", ""),
    "W2_dpo": (">= 3.0x", ""),
    "W3_ppo": (">= 2.5x", "<= 0.7x"),
    "control_ppo": (">= 1.0x", "<= 1.0x"),
    "control_rm": (">= 1.0x", ""),
}


def workload_peers(workload: str, b: str, c: str | None) -> list[str]:
    """The peers of ``workload``: ``b``, and ``c`` where the newest TRL runs it (NEW_PEER_WORKLOADS)."""
    if c is not None and base_workload(workload) in NEW_PEER_WORKLOADS:
        return [b, c]
    return [b]


def run_order(impls: list[str], repeat: int) -> list[str]:
    """The order of the runs of repeat ``repeat``: ``impls`` rotated by one place per repeat (A B C, B C A,
    C A B, ...), so that each implementation runs first, in the middle and last alike and load from other
    jobs on a shared machine hits all of them alike. For two implementations: A B, B A, A B, ..."""
    shift = repeat % len(impls)
    return impls[shift:] + impls[:shift]


def pairs(repeats: list[dict[str, dict]], a: str, b: str) -> list[tuple[dict, dict]]:
    """The (A, B) result pairs of the repeats that ran both ``a`` and ``b``."""
    return [(rep[a], rep[b]) for rep in repeats if a in rep and b in rep]


def median_throughput(workload: str, repeats: list[dict[str, dict]], impl: str) -> float:
    """The median wall-clock throughput of ``impl`` over the repeats (report.throughput's unit)."""
    return statistics.median(throughput(workload, rep[impl]) for rep in repeats if impl in rep)


def faster_peer(workload: str, repeats: list[dict[str, dict]], peers: list[str]) -> str:
    """The peer with the highest median throughput on ``workload`` (the first listed on a tie)."""
    return max(peers, key=lambda peer: (median_throughput(workload, repeats, peer), -peers.index(peer)))


def ratio_stats(workload: str, result_pairs: list[tuple[dict, dict]]) -> dict:
    """Medians over the repeat pairs of A/B: ``throughput_ratio`` (wall clock, > 1 = A faster) and
    ``rss_ratio`` (peak RSS, < 1 = A smaller), their min and max, the unit and the number of pairs."""
    speed = [throughput(workload, a) / throughput(workload, b) for a, b in result_pairs]
    rss = [a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in result_pairs]
    return dict(
        throughput_ratio=statistics.median(speed),
        rss_ratio=statistics.median(rss),
        throughput_ratio_range=[min(speed), max(speed)],
        rss_ratio_range=[min(rss), max(rss)],
        throughput_unit=THROUGHPUT_UNITS[base_workload(workload)],
        repeats=len(result_pairs),
    )


def summary(runs: dict[str, list[dict[str, dict]]], a: str, peers: dict[str, list[str]]) -> dict[str, dict]:
    """``{workload: {"throughput_ratio", "rss_ratio", ..., "peer", "peers", "median_throughput"}}``.

    The top-level ratios (ratio_stats) are against ``peer``, the faster of the workload's peers by median
    throughput; ``peers`` holds ratio_stats against each peer, ``median_throughput`` each
    implementation's median throughput.
    """
    out = {}
    for workload, repeats in runs.items():
        names = peers[workload]
        best = faster_peer(workload, repeats, names)
        against = {peer: ratio_stats(workload, pairs(repeats, a, peer)) for peer in names}
        out[workload] = dict(
            **against[best],
            peer=best,
            peers=against,
            median_throughput={impl: median_throughput(workload, repeats, impl) for impl in (a, *names)},
        )
    return out


def _ratios(row: dict) -> str:
    (t0, t1), (r0, r1) = row["throughput_ratio_range"], row["rss_ratio_range"]
    return f"{row['throughput_ratio']:.2f} [{t0:.2f}-{t1:.2f}] | {row['rss_ratio']:.2f} [{r0:.2f}-{r1:.2f}]"


def summary_table(summ: dict[str, dict], a: str, labels: dict[str, str] | None = None) -> str:
    """The headline ratios of each workload (against its faster peer, with issue 28's targets), then the
    ratios against every peer."""
    labels = labels or {}
    peers = list(dict.fromkeys(peer for row in summ.values() for peer in row["peers"]))
    lines = [
        f"### Summary: {a} / the faster peer of each workload, medians over the repeats [min-max]",
        "",
        "| workload | faster peer | throughput ratio | peak RSS ratio | targets | throughput unit |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for workload, row in summ.items():
        targets = " / ".join(t for t in TARGETS.get(workload, ("", "")) if t)
        peer = labels.get(row["peer"], row["peer"])
        lines.append(f"| {workload} | {peer} | {_ratios(row)} | {targets} | {row['throughput_unit']} |")
    header = "".join(f" {a}/{labels.get(p, p)}: throughput | peak RSS |" for p in peers)
    lines += ["", f"Against each peer ({a} median throughput, then each peer's):", ""]
    lines.append(f"| workload |{header} median throughput |")
    lines.append("| --- |" + " --- | --- |" * len(peers) + " --- |")
    for workload, row in summ.items():
        cells = "".join(
            f" {_ratios(row['peers'][p])} |" if p in row["peers"] else " - | - |" for p in peers
        )
        medians = " / ".join(f"{labels.get(k, k)} {v:.3g}" for k, v in row["median_throughput"].items())
        lines.append(f"| {workload} |{cells} {medians} {row['throughput_unit']} |")
    return "\n".join(lines) + "\n"


def versions_by_impl(runs: dict[str, list[dict[str, dict]]]) -> dict[str, dict[str, str]]:
    """Package versions of each implementation, from its first run."""
    seen: dict[str, dict] = {}
    for repeats in runs.values():
        for rep in repeats:
            for impl, run in rep.items():
                seen.setdefault(impl, run.get("versions", {}))
    return seen


def impl_labels(versions: dict[str, dict[str, str]]) -> dict[str, str]:
    """Table labels: a TRL environment's implementation name with its release (``trl-new (1.16.0)``)."""
    return {impl: f"{impl} ({v['trl']})" if "trl" in v else impl for impl, v in versions.items()}


def versions_table(versions: dict[str, dict[str, str]], pythons: dict[str, str]) -> str:
    """One row per implementation: its python and the versions of trl, transformers and torch (and of
    accelerate or lit-rlhf and lightning)."""
    lines = [
        "### Environments",
        "",
        "| implementation | python | trl | transformers | torch | also |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for impl, vers in versions.items():
        also = ", ".join(f"{k} {v}" for k, v in vers.items() if k not in ("trl", "transformers", "torch"))
        cells = " | ".join(vers.get(k, "-") for k in ("trl", "transformers", "torch"))
        lines.append(f"| {impl} | {pythons.get(impl, '-')} | {cells} | {also} |")
    return "\n".join(lines) + "\n"


TITLES = {
    "W1_grpo": "W1 GRPO: K = 8 responses of <= 64 tokens (EOS-stopped) per prompt of 64-256 tokens, "
    "vocab 32k",
    "W3_ppo": "W3 PPO: responses of <= 64 tokens (EOS-stopped), prompts of 16-256 tokens, vocab 32k",
}


def tables(results: dict, a: str, labels: dict[str, str]) -> list[str]:
    """The detailed table of every workload against each of its peers; issue 28's targets (peers.TARGETS)
    beside the table against the workload's faster peer, the headline one."""
    out = []
    for row, repeats in results["runs"].items():
        name = base_workload(row)
        for peer in results["peers"][row]:
            result_pairs, b = pairs(repeats, a, peer), labels.get(peer, peer)
            headline = row == name and peer == results["summary"][row]["peer"]
            target, rss_target = TARGETS[name] if headline else ("", "")
            out.append(workload_table(row, result_pairs, a, b, target, rss_target))
    return out


def workload_table(row: str, result_pairs: list, a: str, b: str, target: str, rss_target: str) -> str:
    """One workload row's table of A against the peer labelled ``b`` (report.ppo_table or rm_table)."""
    name = base_workload(row)
    if name == "control_ppo":
        return ppo_table(result_pairs, a, b, PPO, rss_target=rss_target, target=target)
    if name in TITLES:
        title = f"{TITLES[name]}, {result_pairs[0][0]['actor_params'] / 1e6:.1f}M-parameter Llama actor"
        if row != name:
            title = f"{row}: {title}; bf16-mixed (lit_rlhf: Trainer precision bf16-mixed, TRL: bf16=True)"
        title = f"{title}; {a} vs {b}"
        return ppo_table(result_pairs, a, b, PPO, title, "response tokens/s", rss_target, target)
    if name == "control_rm":
        return rm_table(result_pairs, a, b, f"Reward model: hidden-64 2-layer GPT-2; {a} vs {b}", target)
    what = "Reward model (Llama classifier)" if name == "W2_rm" else "DPO (Llama causal LM)"
    title = (
        f"{name} {what}: prompts 64-512 tokens, chosen/rejected 16-128, vocab 32k, "
        f"{result_pairs[0][0]['params'] / 1e6:.1f}M parameters; {a} vs {b}"
    )
    return rm_table(result_pairs, a, b, title, target=target)
