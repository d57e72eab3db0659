"""Step times of several training variants measured turn by turn, for ratios the host's
drift does not decide.

The device machine's host runs at speeds that drift by up to 1.8x over seconds to
minutes (bench/NOTES.md, session 8), and a training step of a model this size is bound
by the host. Variants timed one after another (or in rounds of whole runs) then differ
by whatever the host did in between: one gpt12 pair of runs gave ours / dense 0.97,
another 1.67, for the same code. Here every variant's model lives at once, and each
*turn* runs one step of every variant, the order rotated from turn to turn, with a
device sync around each step. A variant's ratio to the reference is taken within each
turn (steps a fraction of a second apart) and the median over turns is reported.

A turn may run each variant for a *block* of consecutive steps instead of one: the
block's first step is left untimed and the turn's time is the mean of the rest. A single
step follows another variant's, whose code and data have just filled the host's caches;
a user's loop runs one model step after step. Blocks measure that steady state and keep
the turns' protection from drift (session 56 in bench/NOTES.md). With ``step_sync``
off, a block's timed steps run without the device sync between them, as a loop that
does not read its loss every step runs them: the host may then run ahead of the GPU,
and a step's time is the block's span over its steps (the GPU's pace where the GPU is
the slower side, where a sync around every step adds the host's lead-in to each).

Peaks are not measured here (every model is resident at once); the benches take them,
and bit identity, from their ordinary sequential runs.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable


def median_interval(values, level: float = 0.95):
    """A distribution-free confidence interval of the median of ``values``: the order
    statistics ``x_(j) <= x_(n+1-j)`` (1-based, sorted) with the largest ``j`` for which
    ``P(j <= B <= n - j) >= level``, B binomial(n, 1/2) (the number of values below the
    true median). ``(low, high, coverage)``, or None for too few values (n < 6 at 95 %)."""
    x = sorted(values)
    n = len(x)
    best = None
    for j in range(1, n // 2 + 1):
        coverage = sum(math.comb(n, i) for i in range(j, n - j + 1)) / 2 ** n
        if coverage < level:
            break
        best = (x[j - 1], x[n - j], coverage)
    return best


def timed_steps(turn: int, warmup: int, block: int) -> range:
    """The step indices of ``turn`` that are timed: none in a warm-up turn; in a block of
    more than one step, all but its first."""
    if turn < warmup:
        return range(0)
    first = turn * block + (1 if block > 1 else 0)
    return range(first, (turn + 1) * block)


def run_turns(steps: dict, reference: str, turns: int, warmup: int,
              sync: Callable[[], None], check_time: Callable[[str], None] | None = None,
              own_references: dict | None = None, block: int = 1,
              step_sync: bool = True) -> dict:
    """Time ``turns`` turns of ``steps`` (``{name: step(i)}``, each running training step
    ``i`` of its variant) after ``warmup`` untimed turns, each variant ``block``
    consecutive steps a turn (:func:`timed_steps` says which are timed; a turn's time is
    their mean; without ``step_sync``, their span from the sync after the block's first
    step to the one after its last, over their number). Returns per variant its step and
    host times in ms, and for the others the per-turn ratios to ``reference`` and their
    median; ``own_references`` (``{name: its reference}``, e.g. a compiled variant's
    compiled baseline) adds the same against that variant's own. ``check_time(where)``
    may raise to cut the run short (the turns timed so far are kept)."""
    if block < 1:
        raise ValueError(f"block={block} must be at least 1")
    if not step_sync and block < 2:
        raise ValueError("step_sync=False needs a block of at least 2 steps (one untimed)")
    own_references = {n: r for n, r in (own_references or {}).items()
                      if r != reference and r in steps and n in steps}
    if reference not in steps:
        raise ValueError(f"reference {reference!r} is not among the variants {list(steps)}")
    names = list(steps)
    times = {n: [] for n in names}
    host = {n: [] for n in names}
    done = 0
    for i in range(warmup + turns):
        if check_time is not None:
            try:
                check_time(f"interleaved turn {i}")
            except Exception:   # noqa: BLE001 -- the bench's time limit: keep what was timed
                break
        k = i % len(names)
        turn = {}
        timed = timed_steps(i, warmup, block)
        for name in names[k:] + names[:k]:
            turn[name] = (_block_synced(steps[name], i, block, timed, sync) if step_sync
                          else _block_streamed(steps[name], i, block, timed, sync))
        if i >= warmup:
            done += 1
            for name, (t, h) in turn.items():
                times[name].append(1e3 * t)
                host[name].append(1e3 * h)
    out = {"turns": done, "warmup": warmup, "block": block, "step_sync": step_sync,
           "reference": reference, "variants": {}}
    for name in names:
        rec = {"step_ms": times[name], "host_ms": host[name],
               "median_step_ms": statistics.median(times[name]) if times[name] else None,
               "median_host_ms": statistics.median(host[name]) if host[name] else None}
        if name != reference:
            ratios = [a / b for a, b in zip(times[name], times[reference]) if b]
            rec["ratios"] = ratios
            rec["median_ratio"] = statistics.median(ratios) if ratios else None
            rec["median_ratio_ci95"] = median_interval(ratios)
        own = own_references.get(name)
        if own is not None and own != name:
            ratios = [a / b for a, b in zip(times[name], times[own]) if b]
            rec["own_reference"] = own
            rec["median_ratio_vs_own"] = statistics.median(ratios) if ratios else None
            rec["median_ratio_vs_own_ci95"] = median_interval(ratios)
        out["variants"][name] = rec
    return out


def _block_synced(step, turn: int, block: int, timed: range, sync) -> tuple:
    """(step s, host s) of a turn's block, a device sync around every step: the mean over
    its timed steps (0, 0 where none is)."""
    spent = []
    for j in range(turn * block, (turn + 1) * block):
        sync()
        t0 = time.perf_counter()
        step(j)
        t1 = time.perf_counter()
        sync()
        if j in timed:
            spent.append((time.perf_counter() - t0, t1 - t0))
    if not spent:
        return 0.0, 0.0
    return statistics.fmean(t for t, _ in spent), statistics.fmean(h for _, h in spent)


def _block_streamed(step, turn: int, block: int, timed: range, sync) -> tuple:
    """(step s, host s) of a turn's block whose timed steps run with no sync between them:
    the span from the sync after the untimed steps to the one after the last, and the
    host's time to issue them, each over their number."""
    first = turn * block
    sync()
    for j in range(first, timed.start if timed else first + block):
        step(j)
    sync()
    if not timed:
        return 0.0, 0.0
    t0 = time.perf_counter()
    for j in timed:
        step(j)
    t1 = time.perf_counter()
    sync()
    n = len(timed)
    return (time.perf_counter() - t0) / n, (t1 - t0) / n


def run_variants(names, make_step: Callable, reference: str, turns: int, warmup: int,
                 sync: Callable[[], None], check_time=None, own_references=None,
                 cleanup: Callable[[], None] | None = None, block: int = 1,
                 step_sync: bool = True) -> dict:
    """:func:`run_turns` over the variants ``make_step(name)`` builds (each ``step(i)``), all
    resident at once. A variant that fails to build is reported under ``failed`` and left
    out; a failure while stepping (an OOM with every model resident, say) is the result's
    ``status``. ``cleanup()`` runs once the steps are dropped."""
    steps, failed = {}, {}
    try:
        for name in names:
            try:
                steps[name] = make_step(name)
            except Exception as exc:  # noqa: BLE001 - reported beside the others' results
                failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if reference not in steps:
            return {"status": f"skipped: no {reference} variant to compare with",
                    "failed": failed}
        result = run_turns(steps, reference, turns, warmup, sync, check_time, own_references,
                           block, step_sync)
    except Exception as exc:  # noqa: BLE001 - the phase's result, not the run's end
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:300]}", "failed": failed}
    finally:
        steps.clear()
        if cleanup is not None:
            cleanup()
    result.update(status="ok", failed=failed)
    for name, rec in result["variants"].items():
        if name != reference:
            own = (f", × {rec['own_reference']} {_f(rec['median_ratio_vs_own'], '.3f')}"
                   if rec.get("own_reference") else "")
            print(f"interleaved  {name:<15} × {reference} {_f(rec['median_ratio'], '.3f')}{own}  "
                  f"({result['turns']} turns)", flush=True)
    return result


def markdown(result: dict, title: str = "Interleaved steps") -> list:
    """Lines of a Markdown section for :func:`run_turns`' result."""
    ref = result["reference"]
    block = result.get("block", 1)
    streamed = not result.get("step_sync", True)
    each = ("one step of every variant" if block == 1 else
            f"{block} consecutive steps of every variant, the first untimed and the turn's "
            + ("time the span of the rest over their number" if streamed
               else "time the mean of the rest"))
    syncs = ("a device sync around each block and after its first step, none between the "
             "timed steps" if streamed else "a device sync around each step")
    lines = [f"## {title}", "",
             f"Every variant resident at once; each turn runs {each} (the "
             f"order rotated each turn, {syncs}); {result['turns']} "
             f"timed turns after {result['warmup']} warm-up turns. × {ref}: the median over "
             f"turns of the ratio within a turn; its 95 % interval is distribution-free (order "
             f"statistics of the turns' ratios, `median_interval`).", "",
             f"| variant | median step (ms) | median host (ms) | × {ref} | × {ref}, quartiles "
             f"| × {ref}, 95 % interval of the median | × own reference (95 % interval) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, rec in result["variants"].items():
        r = rec.get("ratios") or []
        q = statistics.quantiles(r, n=4) if len(r) >= 2 else None
        own = (f"{_f(rec.get('median_ratio_vs_own'), '.3f')} ({rec['own_reference']}; "
               f"{_interval(rec.get('median_ratio_vs_own_ci95'))})"
               if rec.get("own_reference") else "-")
        lines.append(f"| {name} | {_f(rec['median_step_ms'])} | {_f(rec['median_host_ms'])} | "
                     f"{_f(rec.get('median_ratio'), '.3f') if name != ref else '-'} | "
                     f"{f'{q[0]:.3f} - {q[2]:.3f}' if q else '-'} | "
                     f"{_interval(rec.get('median_ratio_ci95')) if name != ref else '-'} | "
                     f"{own} |")
    return lines


def _interval(ci) -> str:
    return "-" if not ci else f"{ci[0]:.3f} - {ci[1]:.3f}"


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)
