"""Render a bench JSON (one scenario object, a list of them, or ``{"scenarios": [...]}``).

``markdown(doc)`` gives the table printed on stdout and pasted into the README; ``plot(doc,
png)`` draws rows/s per path, one panel of bars per (scenario, table), each bar labelled with
its ratio to ours.
Both read only the JSON, so a figure can be redrawn from an old run:
``python -m benchmarks.report bench.json --plot bench.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["scenarios_of", "markdown", "breakdown_lines", "bar_labels", "plot", "main"]


def scenarios_of(doc: Any) -> list[dict[str, Any]]:
    """The scenario objects in a bench JSON document, whatever its top-level shape."""
    if isinstance(doc, list):
        return [d for d in doc if isinstance(d, dict)]
    if isinstance(doc, dict) and "scenarios" in doc:
        return list(doc["scenarios"])
    if isinstance(doc, dict) and "scenario" in doc:
        return [doc]
    raise ValueError(
        "not a bench JSON document: expected a scenario object, a list of them or "
        f"{{'scenarios': [...]}}, got {type(doc).__name__}"
    )


def _fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _fmt_mb(x: float) -> str:
    """MB/s to three significant figures (a slow peer on tiny rows read 0.0 at one decimal)."""
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if x else "0"


def _ratio_cell(sc: dict[str, Any], res: dict[str, Any]) -> str:
    """For a peer/ceiling row: ours / this path (how many times faster ours is)."""
    if res.get("kind") == "ours":
        return "-"
    found = [
        (ours["path"], (ours.get("ratio_vs") or {}).get(res["path"]))
        for ours in sc.get("results", [])
        if ours.get("kind") == "ours"
    ]
    found = [(name, r) for name, r in found if r is not None]
    if len(found) == 1:
        return f"{found[0][1]:.2f}x"
    return ", ".join(f"{name} {r:.2f}x" for name, r in found) or "-"


def markdown(doc: Any) -> str:
    """One markdown table for every scenario in ``doc`` (ours first within each group)."""
    scenarios = scenarios_of(doc)
    head = scenarios[0] if scenarios else {}
    lines = []
    stack = head.get("stack") or (doc.get("stack") if isinstance(doc, dict) else None) or {}
    machine = head.get("machine") or (doc.get("machine") if isinstance(doc, dict) else None) or {}
    if stack:
        lines.append(
            f"Stack {stack.get('name') or ''}: Python {stack.get('python')}, "
            f"PySpark {stack.get('pyspark')}, TensorFlow {stack.get('tensorflow')}, "
            f"pyarrow {stack.get('pyarrow')}; machine {machine.get('cores')} cores, "
            f"{machine.get('memory_gb')} GB"
            + (f"; {doc['date']}" if isinstance(doc, dict) and doc.get("date") else "")
        )
        lines.append("")
    for sc in scenarios:
        data = sc.get("data")
        if data:
            files = data.get("files")
            fills = ", ".join(f"{k} -> {v!r}" for k, v in (data.get("fill") or {}).items())
            lines.append(
                f"Data: {data.get('url')} ({data.get('format')}, {files} file{'' if files == 1 else 's'}, "
                f"{data.get('rows', 0):,} of {data.get('total_rows', 0):,} rows, "
                f"{data.get('row_bytes', 0):,} bytes a row as tensors; columns "
                f"{', '.join(data.get('columns') or [])}" + (f"; nulls filled: {fills}" if fills else "") + ")"
            )
            lines.append("")
    lines.append("| scenario | table | path | kind | rows | rows/s | MB/s | ours / this | ok |")
    lines.append("|---|---|---|---|---:|---:|---:|---:|---|")
    order = {"ours": 0, "peer": 1, "ceiling": 2}
    for sc in scenarios:
        if sc.get("error") and not sc.get("results"):
            lines.append(
                f"| {sc['scenario']} | {sc.get('table', '')} | - | - | - | - | - | - | "
                f"scenario failed: {_cell(sc['error'])} |"
            )
            continue
        for res in sorted(sc.get("results", []), key=lambda r: order.get(r.get("kind"), 3)):
            ok = "yes" if res.get("ok") else f"no: {_cell(res.get('error') or '')}"
            rows = f"{res.get('rows') or sc.get('rows'):,}" if res.get("ok") else "-"  # (as the JSON: none)
            rate = _fmt_rate(res["rows_per_s"]) if res.get("ok") else "-"
            mbs = _fmt_mb(res["mb_per_s"]) if res.get("ok") else "-"
            lines.append(
                f"| {sc['scenario']} | {sc.get('table', '')} | {res['path']} | "
                f"{res.get('kind', '')} | {rows} | {rate} | {mbs} | {_ratio_cell(sc, res)} | {ok} |"
            )
    notes = _notes(scenarios, quick=bool(isinstance(doc, dict) and doc.get("quick")))
    if notes:
        lines.append("")
        lines.extend(notes)
    return "\n".join(lines) + "\n"


def _cell(text: str, limit: int = 120) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _notes(scenarios: list[dict[str, Any]], *, quick: bool = False) -> list[str]:
    from benchmarks.harness import unsteady_line, verdict

    out = []
    for sc in scenarios:
        for res in sc.get("results") or []:
            line = unsteady_line(res)
            if line:
                out.append(f"- {sc['scenario']}/{sc.get('table')}: {line}")
        mem = sc.get("memory")
        if mem:
            said = verdict(mem.get("within_target"), quick=quick)
            out.append(
                f"- {sc['scenario']}/{sc.get('table')}: consumer slowed {mem.get('slow_factor')}x, "
                f"node buffer peak {mem.get('peak_bytes', 0) / 2**20:.2f} MiB vs limit "
                f"{mem.get('limit_bytes', 0) / 2**20:.2f} MiB "
                f"({mem.get('peak_over_limit', 0):.2f}x; target <= 1.10x: {said})"
            )
        bd = sc.get("breakdown")
        if bd:
            out.extend(breakdown_lines(sc, bd))
        targets = sc.get("targets")
        fit = sc.get("fit")
        if targets:
            out.extend(_train_lines(sc, targets, quick=quick))
        elif fit:
            said = verdict(fit.get("within_target"), quick=quick)
            out.append(
                f"- {sc['scenario']}/{sc.get('table')}: Keras fit fed by push runs at "
                f"{fit.get('ratio', 0):.2f}x the in-memory fit (target >= 0.9x: {said})"
            )
    return out


def _train_lines(sc: dict[str, Any], targets: dict[str, Any], *, quick: bool = False) -> list[str]:
    """The train scenario's targets (with verdicts) and the cached node's memory."""
    from benchmarks.harness import verdict
    where = f"{sc['scenario']}/{sc.get('table')}"
    out = []
    for name, other in (("cache_vs_in_memory", "in-memory"),
                        ("cache_vs_petastorm_converter", "petastorm-converter")):
        t = targets.get(name) or {}
        if t.get("ratio") is None:
            out.append(f"- {where}: flight-push-cache vs {other}: not measured "
                       f"({_cell(t.get('why', ''), 100)})")
        else:
            said = verdict(t.get("within_target"), quick=quick, unsteady=t.get("unsteady"))
            out.append(
                f"- {where}: Keras fit for {sc.get('epochs')} epochs fed by flight-push-cache runs "
                f"at {t['ratio']:.2f}x {other} (target >= {t.get('target')}x: {said})"
            )
    b = sc.get("bound")
    if b:
        ours = f"; flight-push-cache is at {b['ours_of_best']:.0%} of it" if b.get("ours_of_best") else ""
        out.append(
            f"- {where}: bound: Spark alone hands the rows to Python in "
            f"{b['spark_handoff_seconds']:.2f} s ({b['spark_handoff_core_seconds']:.2f} core-s), so "
            f"on {b['cores']} cores no feed passes {b['best_cache_vs_in_memory']:.2f}x in-memory at "
            f"{sc.get('epochs')} epochs{ours}"
        )
        if b.get("best_flight_fed_vs_in_memory"):
            of = b.get("ours_of_flight_best")
            out.append(
                f"- {where}: bound over Flight: with the rows' bare do_put into a sink counted "
                f"({b['flight_handoff_seconds']:.2f} s, {b['flight_handoff_core_seconds']:.2f} "
                f"core-s), no Flight-fed fit passes {b['best_flight_fed_vs_in_memory']:.2f}x "
                f"in-memory" + (f"; flight-push-cache is at {of:.0%} of it" if of else "")
            )
    if sc.get("in_memory_vs_petastorm_converter"):
        out.append(f"- {where}: in-memory tensors (no feed at all) run at "
                   f"{sc['in_memory_vs_petastorm_converter']:.2f}x petastorm-converter: the most "
                   f"any feed can reach against it here")
    for node, n in ((sc.get("cache_memory") or {}).get("nodes") or {}).items():
        if "error" in n:
            continue
        out.append(
            f"- {where}: cached node {node} holds {int(n.get('cache_memory_bytes') or 0) / 2**20:.1f} "
            f"MiB in memory (bound {int(n.get('cache_bytes_limit') or 0) / 2**20:.0f} MiB), "
            f"{int(n.get('cache_spilled_bytes') or 0) / 2**20:.1f} MiB spilled; feed buffer peak "
            f"{int(n.get('buffer_peak_bytes') or 0) / 2**20:.1f} MiB"
        )
    return out


def breakdown_lines(sc: dict[str, Any], bd: dict[str, Any]) -> list[str]:
    """The short breakdown printed under the table: where ours' measured time went."""
    total = bd.get("measured_seconds") or 0.0
    parts = ", ".join(
        f"{p['part']} {p['seconds']:.3f} s ({100 * p['share']:.0f}%"
        f"{', capped' if p.get('capped') else ''}{', hidden' if p.get('hidden') else ''})"
        for p in bd.get("parts", [])
    )
    out = [
        f"- {sc['scenario']}/{sc.get('table')}: where {bd.get('path')}'s {total:.3f} s went: "
        f"{parts} (sum {bd.get('sum_seconds', 0.0):.3f} s)"
    ]
    if any(p.get("capped") for p in bd.get("parts", [])):
        out.append("  - capped: that stage alone took longer than ours whole (ours hides it, or "
                   "the runs were too short or noisy to tell; raise --limit or --reps)")
    if any(p.get("hidden") for p in bd.get("parts", [])):
        out.append("  - hidden: ours up to that stage ran faster than up to the stage before it, "
                   "so the stage overlaps the earlier ones entirely (or the runs were noisy); the "
                   "parts before it are upper bounds")
    wait = bd.get("consumer_wait_seconds")
    if wait is not None:
        out.append(
            f"  - a consumer doing nothing else waited {wait:.3f} s for input "
            f"({100 * (bd.get('consumer_wait_share') or 0):.0f}% of it"
            + (f"; first batch after {bd['first_batch_seconds']:.3f} s" if bd.get("first_batch_seconds") is not None else "")
            + "); a training step slower than the input per batch would have waited less"
        )
    metrics = bd.get("node_metrics") or {}
    if metrics:
        stall = sum(float(m.get("stall_seconds", 0.0) or 0.0) for m in metrics.values())
        peak = max((int(m.get("buffer_peak_bytes", 0) or 0) for m in metrics.values()), default=0)
        out.append(
            f"  - nodes (cumulative over all passes): pushing tasks stalled on full buffers "
            f"{stall:.2f} s, buffer peak {peak / 2**20:.1f} MiB"
        )
    return out


def bar_labels(sc: dict[str, Any]) -> list[str]:
    """The text on each of a scenario's bars: its rows/s and, for the other paths, how it
    compares with ours (``"500 rows/s\n0.25x ours"``), or ``n/a`` when it did not run."""
    ours = next((r.get("rows_per_s") or 0.0 for r in sc["results"]
                 if r.get("kind") == "ours" and r.get("ok")), 0.0)
    out = []
    for res in sc["results"]:
        rate = res.get("rows_per_s") or 0.0
        if not (res.get("ok") and rate > 0):
            out.append("n/a")
        elif res.get("kind") == "ours" or not ours:
            out.append(f"{_fmt_rate(rate)} rows/s")
        else:
            out.append(f"{_fmt_rate(rate)} rows/s\n{rate / ours:.2f}x ours")
    return out


def plot(doc: Any, png: str | Path) -> Path:
    """Draw rows/s per path into ``png``: one panel per (scenario, table), each on its own
    linear axis from zero, so bar heights compare as the ratios do (a log axis made a 0.88x
    peer look several times slower); each bar says its rows/s and its ratio to ours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [sc for sc in scenarios_of(doc) if sc.get("results")]
    colors = {"ours": "#1f77b4", "peer": "#ff7f0e", "ceiling": "#7f7f7f"}
    several_stacks = len({(sc.get("stack") or {}).get("name") for sc in scenarios}) > 1
    widths = [max(1, len(sc["results"])) for sc in scenarios] or [1]
    fig, axes = plt.subplots(
        1, len(widths), figsize=(max(6.0, 1.1 * sum(widths) + 1.0), 4.8),
        gridspec_kw={"width_ratios": widths}, squeeze=False,
    )
    for ax, sc in zip(axes[0], scenarios):
        rates = [(r.get("rows_per_s") or 0.0) if r.get("ok") else 0.0 for r in sc["results"]]
        top = max(rates) if any(rates) else 1.0
        for x, (res, rate, text) in enumerate(zip(sc["results"], rates, bar_labels(sc))):
            if rate > 0:
                ax.bar(x, rate, color=colors.get(res.get("kind"), "#2ca02c"), width=0.8)
            ax.text(x, rate + 0.01 * top, text, ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, top * 1.25)
        ax.set_xlim(-0.6, len(rates) - 0.4)  # a path that did not run keeps its slot
        ax.set_xticks(range(len(sc["results"])))
        ax.set_xticklabels([r["path"] for r in sc["results"]], rotation=45, ha="right", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        stack_name = (sc.get("stack") or {}).get("name") if several_stacks else None
        ax.set_title(f"{sc['scenario']} {sc.get('table', '')}" + (f" ({stack_name})" if stack_name else ""),
                     fontsize=8)
    for ax in axes[0][len(scenarios):]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("rows/s (median)")
    kinds = [k for k in colors if any(r.get("kind") == k and r.get("ok") for sc in scenarios for r in sc["results"])]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in kinds]
    axes[0][-1].legend(handles, kinds, loc="upper right", fontsize=7)  # (the kinds that ran)
    stacks = []
    for sc in scenarios:
        st = sc.get("stack") or {}
        text = (f"{st.get('name') or 'stack'}: PySpark {st.get('pyspark')}, "
                f"TF {st.get('tensorflow')}, pyarrow {st.get('pyarrow')}")
        if text not in stacks:
            stacks.append(text)
    machine = (scenarios[0].get("machine") or {}) if scenarios else {}
    fig.suptitle("dataplane bench (" + "; ".join(stacks) + f"; {machine.get('cores')} cores)", fontsize=8)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return png


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.report BENCH.json [--plot PNG]``: table on stdout, optional PNG."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    parser.add_argument("json", nargs="+", help="bench JSON file(s); several are concatenated")
    parser.add_argument("--plot", metavar="PNG", help="also draw the bar chart into PNG")
    args = parser.parse_args(argv)
    scenarios: list[dict[str, Any]] = []
    for path in args.json:
        scenarios.extend(scenarios_of(json.loads(Path(path).read_text())))
    sys.stdout.write(markdown(scenarios))
    if args.plot:
        plot(scenarios, args.plot)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
