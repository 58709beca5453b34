"""Compare per-rank environment snapshots (pure): which keys differ and which ranks hold which value."""
from __future__ import annotations

from distcheck.contract.findings import Finding, format_ranks

UNSET = "<unset>"


def value_groups(snapshots: dict[int, dict[str, str]], key: str) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank in sorted(snapshots):
        groups.setdefault(snapshots[rank].get(key, UNSET), []).append(rank)
    return groups


def _describe(groups: dict[str, list[int]]) -> str:
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return "; ".join(f"{format_ranks(ranks)}: {value!r}" for value, ranks in ordered)


def diff_env(snapshots: dict[int, dict[str, str]], host_specific: frozenset[str] = frozenset()) -> list[Finding]:
    """One env_mismatch finding per key whose value is not the same on every rank (host-specific keys skipped).

    The blamed ranks are those outside the most common value (all ranks when no value has a strict majority).
    """
    keys = sorted({k for snap in snapshots.values() for k in snap})
    findings = []
    for key in keys:
        if key in host_specific:
            continue
        groups = value_groups(snapshots, key)
        if len(groups) == 1:
            continue
        ordered = sorted(groups.values(), key=lambda r: (-len(r), r[0]))
        majority = ordered[0]
        total = len(snapshots)
        blamed = [r for r in snapshots if r not in majority] if len(majority) * 2 > total else list(snapshots)
        label = key.removeprefix("env.")
        kind = "environment variable" if key.startswith("env.") else "setting"
        findings.append(Finding("env_mismatch", blamed, f"{kind} {label} differs across ranks: {_describe(groups)}",
                                {"key": label, "values": {v: r for v, r in groups.items()}}))
    return findings


def render_env_table(snapshots: dict[int, dict[str, str]], host_specific: frozenset[str] = frozenset()) -> str:
    """Compact text: keys with one value once, differing or host-specific keys with their rank groups."""
    keys = sorted({k for snap in snapshots.values() for k in snap})
    width = max((len(k) for k in keys), default=0)
    lines = []
    for key in keys:
        groups = value_groups(snapshots, key)
        if len(groups) == 1:
            lines.append(f"{key:<{width}}  {next(iter(groups))}")
        else:
            tag = "(host-specific) " if key in host_specific else "(DIFFERS) "
            lines.append(f"{key:<{width}}  {tag}{_describe(groups)}")
    return "\n".join(lines)
