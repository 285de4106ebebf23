"""Where ours' time goes: a ladder of partial pipelines, timed in the same rounds as ours.

A pipeline's stages overlap (reading runs ahead of decoding, decoding ahead of TensorFlow), so
timing each stage alone and adding the times up says nothing about the wall time. Instead a
scenario times *prefixes* of ours' pipeline as ``stage`` paths, in the same alternating rounds
as every other path: for a pull reader "read the bytes only", then "read and decode, no
TensorFlow", then ours whole. Each part of the breakdown is what adding that stage costs on top
of the prefix before it (median against median), so the parts add up to ours' measured time:

* a prefix that is slower than a longer one (a stage the pipeline hides entirely, or noise
  between repetitions) is capped at the longer one's time, so that part is 0 and no part is
  negative; ``stage_seconds`` keeps the uncapped medians;
* a prefix that is faster than a shorter one before it (the added stage overlaps the earlier
  ones entirely, or noise) gives a part of 0 marked ``hidden``: the parts before it are then
  the larger for it, so read them as upper bounds;
* a prefix that could not run (``ok: false``) is merged into the next part, whose name then
  says so (``node_buffer+tensors``).

The consumer's wait for input is measured directly, inside ours' own timed repetitions: the
time its loop spent blocked on the next batch (including creating the iterator), which for a
consumer that does no work of its own is nearly all of it. A training step that takes longer
than the input does per batch would have waited correspondingly less.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

__all__ = ["Step", "ladder"]


class Step:
    """One rung of the ladder: the prefix of ours' pipeline that ends with this part.

    Attributes:
        part: the part's name in the breakdown (``read``, ``decode``, ``to_tf``, ...).
        what: one line saying what the part covers.
        stage: the ``stage`` path that times the prefix ending here, or ``None`` for the last
            rung (ours itself) or for a ceiling path's result (``result``).
        result: the name of a non-stage path (a ceiling) timing this prefix instead.
    """

    def __init__(self, part: str, what: str, *, stage: str | None = None, result: str | None = None) -> None:
        self.part = part
        self.what = what
        self.stage = stage
        self.result = result


def _prefix_seconds(step: Step, out: dict[str, Any]) -> float | None:
    if step.stage is not None:
        got = (out.get("stages") or {}).get(step.stage)
        return float(got["seconds"]) if got and got["ok"] else None
    if step.result is not None:
        got = next((r for r in out["results"] if r["path"] == step.result), None)
        return float(got["seconds"]) if got and got["ok"] and got["seconds"] > 0 else None
    return None


def ladder(
    out: dict[str, Any],
    ours: str,
    steps: Sequence[Step],
    *,
    waits: Sequence[float] = (),
    firsts: Sequence[float] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The breakdown object of ``ours`` in the scenario object ``out``.

    Args:
        out: the scenario's JSON object (``results`` and ``stages`` filled in).
        ours: the name of ours' path; its median seconds are the measured time.
        steps: the rungs in pipeline order; the last one is ours itself (no stage/result).
        waits: the consumer's wait for input in each timed repetition of ours.
        firsts: the seconds to the first batch in each timed repetition of ours.
        extra: more fields for the object (e.g. the node counters of the push path).

    Returns:
        ``{"path", "measured_seconds", "parts": [{"part", "seconds", "share", "what"}],
        "sum_seconds", "stage_seconds", "consumer_wait_seconds", "consumer_wait_share",
        "first_batch_seconds", "method"}``, or None when ours did not run.
    """
    res = next((r for r in out["results"] if r["path"] == ours), None)
    if res is None or not res["ok"] or res["seconds"] <= 0:
        return None
    total = float(res["seconds"])
    parts: list[dict[str, Any]] = []
    stage_seconds: dict[str, float | None] = {}
    before = 0.0
    merged: list[Step] = []
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        raw = total if last else _prefix_seconds(step, out)
        stage_seconds[step.stage or step.result or ours] = raw
        merged.append(step)
        if raw is None:  # this prefix could not be timed: its part joins the next one
            continue
        upto = min(max(before, raw), total)
        part = {
            "part": "+".join(s.part for s in merged),
            "seconds": upto - before,
            "share": (upto - before) / total,
            "what": "; ".join(s.what for s in merged),
        }
        if raw > total:  # the prefix alone took longer than ours whole: the part is capped
            part["capped"] = True
        elif raw < before:  # faster than the shorter prefix before it: this part reads 0
            part["hidden"] = True
        parts.append(part)
        before = upto
        merged = []
    wait = statistics.median(waits) if waits else None
    obj: dict[str, Any] = {
        "path": ours,
        "measured_seconds": total,
        "parts": parts,
        "sum_seconds": sum(p["seconds"] for p in parts),
        "stage_seconds": stage_seconds,
        "consumer_wait_seconds": wait,
        "consumer_wait_share": (wait / total) if wait is not None else None,
        "first_batch_seconds": statistics.median(firsts) if firsts else None,
        "method": (
            "each part is the median time of ours' pipeline up to and including that stage "
            "minus the median up to the stage before, from the same alternating repetitions "
            "(benchmarks/breakdown.py); consumer wait: time ours' consumer spent blocked on "
            "the next batch, median over the timed repetitions"
        ),
    }
    if extra:
        obj.update(extra)
    return obj
