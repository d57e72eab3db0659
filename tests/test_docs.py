"""Docs cannot drift from the results they cite.

Every measured figure in README.md and docs/*.md stands inside a region marked

    <!-- figures: bench/results/<file>, ... (checked by tests/test_docs.py) -->
    ...
    <!-- /figures -->

and is rendered here from the cited result file (JSON, or the session log
gpu_session.md) or from the format's size formula. Each rendered fragment must
appear in its doc verbatim (whitespace and line breaks aside), and no other
number may stand in a region: a figure typed by hand, or left behind by a new
run, fails the suite. After a new benchmark run, ``python3 tests/test_docs.py``
prints every fragment as the results now give it.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# the steps ours-compiled-frozen adapts before it freezes (train_gpt.py, read without torch)
FREEZE_AFTER = int(re.search(r"^FREEZE_AFTER = (\d+)$",
                             (ROOT / "bench" / "train_gpt.py").read_text(), re.M).group(1))
# the eager steps before a StepGraph's capture (train_gpt.py)
STEP_GRAPH_SETTLE = int(re.search(r"^STEP_GRAPH_SETTLE = (\d+)$",
                                  (ROOT / "bench" / "train_gpt.py").read_text(), re.M).group(1))
DOCS = ("README.md", "docs/guide.md", "docs/torch.md", "docs/jax.md")
MINUS = "\u2212"
REGION = re.compile(r"<!-- figures: (?P<sources>[^>]*?) \(checked by tests/test_docs\.py\) -->"
                    r"(?P<body>.*?)<!-- /figures -->", re.S)


@lru_cache(maxsize=None)
def result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def pct(ratio: float, digits: int = 1) -> str:
    """A time ratio as the docs write it: +2.0 %, −0.6 %."""
    v = round((ratio - 1) * 100, digits)
    return f"{'+' if v >= 0 else MINUS}{abs(v):.{digits}f} %"


def mib(x: float) -> str:
    return f"{x:.0f}"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def span(values, fmt="{:.0f}") -> str:
    return f"{fmt.format(min(values))}–{fmt.format(max(values))}"


def identical(*flags) -> str:
    return "bit-identical" if all(f is True for f in flags) else "NOT bit-identical"


# --------------------------------------------------------------------- sources
def gpu_session() -> dict:
    """The latest session's counts from the log bench/results/gpu_session.md."""
    text = (RESULTS / "gpu_session.md").read_text()
    latest = text.split("\n## ")[1]             # "## Latest (...)", the first section
    blocks = latest.split("```")[1::2]
    # the sanitizer's counts: this session's, or, where it did not run, the latest run's
    sanitized = next(i for i, sec in enumerate(text.split("\n## ")[1:])
                     if "ERROR SUMMARY" in sec)
    san = text.split("\n## ")[1 + sanitized]
    rerun = re.search(r"^\s*re-run .*?(\d+) passed", blocks[1], re.S) if len(blocks) > 1 else None
    return dict(passed=sum(int(n) for n in re.findall(r"(\d+) passed", blocks[0])),
                rerun=int(rerun[1]) if rerun else None,
                failed=sum(int(n) for n in re.findall(r"(\d+) failed", blocks[0])),
                errors=int(re.search(r"ERROR SUMMARY: (\d+) errors", san)[1]),
                hazards=int(re.search(r"(\d+) hazards", san)[1]),
                sanitizer_session=None if sanitized == 0 else san.split("(")[1].split(")")[0])


def torch_ffn():
    r = result("torch_ffn.json")
    c = r["config"]
    zeros = [s for k in r["kinds"].values() for s in k["sparsity_per_layer"]]
    return r, c, round(100 * sum(zeros) / len(zeros))


def jax_modes() -> dict:
    return {m["mode"]: m for m in result("jax_ffn.json")["modes"]}


def numba_over_cupy(codecs: dict, keys) -> tuple:
    """``(CuPy's rows, {key: Numba's time / CuPy's, row by row})`` of a codec bench."""
    cupy = [row for row in codecs["rows"] if row["backend"] == "cupy"]
    numba = {(row["dtype"], row["sparsity"]): row for row in codecs["rows"]
             if row["backend"] == "numba"}
    return cupy, {k: [numba[(row["dtype"], row["sparsity"])][k] / row[k] for row in cupy]
                  for k in keys}


def size_ratio(zeros: float, numel: int = 1 << 20) -> float:
    """Dense / packed bytes of a bf16 nosign tensor (the format's size formula)."""
    import bitsparse_core as bc
    nnz = round((1 - zeros) * numel)
    return numel * 2 / bc.packed_size((numel,), "bfloat16", "nosign", nnz)


# --------------------------------------------------------------- the fragments
FUSED_README_OPS = ("relu2_pack", "relu2_backward+square", "gated_backward")


def readme() -> list:
    g = gpu_session()
    bi = result("train_gpt_bitident.json")
    biv = bi["variants"]
    tg = result("train_gpt.json")
    tgv, tiv = tg["variants"], tg["interleaved"]
    sh = tg["shape"]
    hf = result("bench_hf.json")
    hv, hiv, hs = hf["variants"], hf["interleaved"]["variants"], hf["shape"]
    hf_zeros = round(100 * (1 - max(st["max_density"] for st in
                                    hv["converted"]["packed"]["modules"].values())))
    bu = result("train_gpt_budget.json")
    small = next(i for i in result("host_overhead.json")["inputs"] if i["size"] == "small")
    host_small = {be: [s["host_us"] for s in result("host_overhead.json")["summary"]
                       if s["backend"] == be and s["op"] != "torch_empty"
                       and s["mode"] != "callable"]
                  for be in ("cupy", "numba", "torch")}    # the bc.* calls (torch mode), x + x
    r, c, zeros = torch_ffn()
    t2 = r["kinds"]["relu2"]["variants"]
    jm = jax_modes()
    cd = result("codecs.json")
    cupy, slow = numba_over_cupy(cd, ("pack_exact_ms", "pack_fixed_ms", "unpack_ms"))
    bf16_90 = next(row for row in cupy if (row["dtype"], row["sparsity"]) == ("bfloat16", 0.9))
    # a variant whose profiled steps held a recompile (its capacity moved) counts the
    # compiler's syncs there; the table says so, and they are not the ops'
    recompiled = [name for name, v in tgv.items() if v.get("compiles", {}).get("profiled")]
    syncs = ops_syncs(tg)
    tokens = sh["seq"] * sh["batch"]
    g16r = result("train_gpt16.json")
    g16, g16s = g16r["variants"], g16r["shape"]
    g16c = g16["ours-nosign"]["capacity"]
    mh = result("module_host.json")
    mhr = {row["variant"]: row for row in mh["rows"]}
    fzv = result("fused.json")["variants"]
    h200_defaults = result("train_gpt_h200_pretrained_defaults.json")
    first = fzv["default"]["rows"][0]
    fz_shape, fz_density = "x".join(map(str, first["shape"])), first["density"]
    pick = lambda rows: {r["op"]: r for r in rows   # noqa: E731
                         if (r["shape"], r["density"]) == (first["shape"], fz_density)}
    fz, fz_before = pick(fzv["default"]["rows"]), pick(fzv["before"]["rows"])
    return [
        f"| GPU test suite (CuPy, Numba, PyTorch, JAX paths) | {g['passed']} passed"
        f"{'' if not g['failed'] else ', ' + str(g['failed']) + ' failed'}"
        f"{' (their cause fixed after the run, not yet re-run: see the log)' if g['failed'] and g['rerun'] is None else ''}"
        f"{'' if g['rerun'] is None else ' (each failure fixed or out of memory beside a JAX worker; their re-run: ' + str(g['rerun']) + ' passed)'}; compute-sanitizer "
        f"memcheck {g['errors']} errors, racecheck {g['hazards']} hazards"
        f"{'' if not g['sanitizer_session'] else ' (run of ' + g['sanitizer_session'] + ')'} "
        "| `bench/results/gpu_session.md` |",

        f"| {sh['layers']}-layer ReLU² GPT, d={sh['d']}, bf16, {tokens} tokens/step, "
        f"{bi['plan']['timed']} steps with math attention | losses and final parameters "
        f"{identical(*(biv[v][k] for v in ('ours-raw', 'ours-nosign', 'ours-offload', 'ours-offload-hold0') for k in ('losses_bit_identical', 'params_bit_identical')))}"
        f" to dense, offloaded (`offload=True`, either hold) too; peak {mib(biv['ours-raw']['peak_mib'])} / {mib(biv['ours-nosign']['peak_mib'])}"
        f" MiB (raw / nosign) vs {mib(biv['dense']['peak_mib'])} dense; step "
        f"{pct(biv['ours-raw']['step_ratio_vs_dense'], 0)} / "
        f"{pct(biv['ours-nosign']['step_ratio_vs_dense'], 0)} vs dense "
        f"{biv['dense']['median_step_ms']:.1f} ms | `bench/results/train_gpt_bitident.md` |",

        f"| same GPT, SDPA's fused attention, every variant's steps in turn ({tiv['turns']} "
        f"turns) | {syncs:.0f} host syncs per step from our ops"
        f"{' (' + ', '.join(recompiled) + ': a recompile in its profiled steps, not counted)' if recompiled else ''}; step "
        f"{pct(tiv['variants']['ours-nosign']['median_ratio'], 0)} vs dense, offloaded "
        f"{pct(tiv['variants']['ours-offload']['median_ratio'], 0)} (holding none on the "
        f"device: {pct(tiv['variants']['ours-offload-hold0']['median_ratio'], 0)}, keeping "
        f"{mib(tgv['ours-offload-hold0']['after_forward_mib'])} MiB after the forward vs "
        f"{mib(tgv['checkpoint']['after_forward_mib'])} checkpointed), checkpointing "
        f"{pct(tiv['variants']['checkpoint']['median_ratio'], 0)}, torch.compile'd "
        f"{pct(tiv['variants']['ours-compiled']['median_ratio_vs_own'], 0)} vs compiled dense; "
        f"peak {mib(tgv['ours-nosign']['peak_mib'])} MiB vs {mib(tgv['dense']['peak_mib'])} "
        f"dense, {mib(tgv['ours-offload']['peak_mib'])} offloaded, "
        f"{mib(tgv['checkpoint']['peak_mib'])} checkpointed | `bench/results/train_gpt.md` |",

        gpt12_settings_row(h200_defaults, "train_gpt_h200_pretrained_defaults",
                           f"trained {h200_defaults['pretrain']['steps']} steps first, under "
                           "PyTorch's default GEMM and determinism settings"),

        f"| transformers OPT (ReLU FFN) from a config, {hs['layers']} layers, d={hs['d']}, bf16, "
        f"{hs['seq'] * hs['batch']} tokens/step, steps in turn | `convert(model)` "
        f"{pct(hiv['converted']['median_ratio'], 0)}, `compress_saved_tensors` "
        f"{pct(hiv['hooks']['median_ratio'], 0)}, the library's checkpointing "
        f"{pct(hiv['checkpointing']['median_ratio'], 0)} vs plain; peak "
        f"{mib(hv['converted']['peak_mib'])} / {mib(hv['hooks']['peak_mib'])} / "
        f"{mib(hv['checkpointing']['peak_mib'])} MiB vs {mib(hv['plain']['peak_mib'])} plain "
        f"(a fresh model: {hf_zeros} % zeros in its FFN activations) | `bench/results/bench_hf.md` |",

        f"| one layer of the same GPT, the FFN op's host path in C++ (the default) against "
        f"Python | host time of one layer's forward and "
        f"backward ({mh['config']['tokens']} tokens): {mhr['packed-nosign']['train_x_dense']:.2f} × "
        f"dense's (C++) / {mhr['packed-python']['train_x_dense']:.2f} × (Python) "
        "| `bench/results/module_host.md` |",

        f"| {g16s['layers']}-layer GPT, d={g16s['d']}, {g16s['seq'] * g16s['batch']} tokens/step "
        f"(GPU-bound) | step {pct(g16['ours-nosign']['step_ratio_vs_dense'], 1)} vs dense "
        f"{g16['dense']['median_step_ms']:.1f} ms "
        f"({g16c['waits_per_step']:.0f} wait per step for a count not back yet; recomputing "
        f"instead: {pct(g16['ours-recompute']['step_ratio_vs_dense'], 1)}), checkpointing "
        f"{pct(g16['checkpoint']['step_ratio_vs_dense'], 1)}; peak "
        f"{mib(g16['ours-nosign']['peak_mib'])} MiB vs {mib(g16['dense']['peak_mib'])} dense, "
        f"{mib(g16['checkpoint']['peak_mib'])} checkpointed | `bench/results/train_gpt16.md` |",

        budget_row(bu, "train_gpt_budget", "same GPT"),

        f"| host time per call, {small['numel']}-element bf16 tensor | public `bc.*` API on "
        f"torch tensors (torch's stream and allocator): CuPy {span(host_small['cupy'], '{:.1f}')} µs, Numba "
        f"{span(host_small['numba'], '{:.1f}')} µs (torch's `x + x` on the same host: "
        f"{span(host_small['torch'], '{:.1f}')} µs) | `bench/results/host_overhead.md` |",

        f"| {c['layers']}-layer bf16 ReLU² FFN stack, d={c['d']}, f={c['f']}, {c['tokens']} "
        f"tokens, {zeros} % zeros (PyTorch) | peak {mib(t2['ours_nosign']['peak_mib'])} MiB vs "
        f"{mib(t2['dense']['peak_mib'])} dense and {mib(t2['checkpoint']['peak_mib'])} "
        f"checkpointed; step {pct(t2['ours_raw']['time_vs_dense'])} (raw) / "
        f"{pct(t2['ours_nosign']['time_vs_dense'])} (nosign) vs "
        f"{pct(t2['checkpoint']['time_vs_dense'])} checkpointed | `bench/results/torch_ffn.md` |",

        f"| same stack in JAX (jit) | activation memory {gib(jm['packed']['temp_size_in_bytes'])}"
        f" GiB vs {gib(jm['dense']['temp_size_in_bytes'])} plain, "
        f"{gib(jm['checkpoint']['temp_size_in_bytes'])} jax.checkpoint; step "
        f"{pct(jm['packed']['step_ms_median'] / jm['dense']['step_ms_median'])} vs "
        f"{pct(jm['checkpoint']['step_ms_median'] / jm['dense']['step_ms_median'])}; through "
        f"the project's kernels as XLA custom calls (`impl=\"ffi\"`): step "
        f"{pct(jm['packed-ffi']['step_ms_median'] / jm['dense']['step_ms_median'])}, "
        f"{gib(jm['packed-ffi']['temp_size_in_bytes'])} GiB; gradients "
        f"{identical(*(jm[m]['bit_identical_to_dense'] for m in ('packed', 'packed-ffi')))} "
        "to plain JAX's, and on batches that overflow the capacity (every layer recomputes) "
        f"{identical(*(jm[m]['bit_identical_to_dense'] for m in ('packed-overflow', 'packed-ffi-overflow')))} "
        "| `bench/results/jax_ffn.md` |",

        f"| codec kernels, 2^{int(math.log2(cd['numel']))} bf16 / fp8 elements | CuPy: unpack "
        f"{span([100 * row['unpack_frac_copy'] for row in cupy])} % (bf16 at "
        f"{100 * bf16_90['sparsity']:.0f} % zeros: {100 * bf16_90['unpack_frac_copy']:.0f} %), "
        f"fixed-capacity pack {span([100 * row['pack_fixed_frac_copy'] for row in cupy])} % of the "
        f"copy bandwidth ({cd['copy_bandwidth_Bps'] / 1e12:.2f} TB/s); unpack "
        f"{span([row['unpack_vs_nvcomp'] for row in cupy], '{:.1f}')}×, fixed-capacity pack "
        f"{span([row['pack_fixed_vs_nvcomp'] for row in cupy], '{:.1f}')}× nvCOMP's fastest "
        f"codec. Numba / CuPy time: fixed-capacity pack {span(slow['pack_fixed_ms'], '{:.2f}')}×, "
        f"unpack {span(slow['unpack_ms'], '{:.2f}')}×, exact pack "
        f"{span(slow['pack_exact_ms'], '{:.2f}')}× "
        "| `bench/results/codecs.md` |",

        codecs_8192x14336_row("codecs_8192x14336"),

        f"| fused ops of a training step, bf16 {fz_shape}, {100 * fz_density:.0f} % nonzeros (a "
        "fresh gpt12 FFN activation) | "
        + ", ".join(f"`{op}` {fz[op]['us']:.1f} µs ({100 * fz[op]['of_copy']:.0f} %)"
                    for op in FUSED_README_OPS)
        + " of the copy bandwidth; `relu_pack` / `relu2_pack` "
        + " / ".join(f"{fz_before[op]['us'] / fz[op]['us']:.2f}×" for op in ("relu_pack", "relu2_pack"))
        + f" faster at {fzv['default']['pack_rounds']} rounds per warp than at "
        + f"{fzv['before']['pack_rounds']} (same run)"
        + " | `bench/results/fused.md` |",
        gated_kernels_row("fused_h200_s63"),
    ]


def gated_kernels_row(stem: str) -> str:
    """ReGLU's one-kernel pack and product (``bench_fused.py``) against the ways before,
    the same run: the trained density's row of the gpt12 shape."""
    rows = {r["op"]: r for r in result(f"{stem}.json")["variants"]["default"]["rows"]
            if r["shape"] == [8192, 4096] and r["density"] == 0.1}
    pairs = (("gated_pack", "gated_pack_by_relu_mul", "relu(g)'s pack and `torch.mul`"),
             ("gated_product", "gated_product_by_decodes", "two decodes and a product"))
    same = all(rows[a]["digest"] == rows[b]["digest"] for a, b, _ in pairs)
    return ("| ReGLU's kernels, bf16 8192x4096, 10 % nonzeros | "
            + "; ".join(f"`{a}` {rows[a]['us']:.1f} µs vs {rows[b]['us']:.1f} for {what} "
                        f"({rows[b]['us'] / rows[a]['us']:.2f}×)" for a, b, what in pairs)
            + ("; outputs byte-identical" if same else "; outputs differ")
            + f" | `bench/results/{stem}.md` |")


def codecs_8192x14336_row(stem: str) -> str:
    """The README's row of a codec run at issue 20's shape (``stem``.json)."""
    c8 = result(f"{stem}.json")
    assert c8["numel"] == 8192 * 14336
    cupy, slow = numba_over_cupy(c8, ("pack_fixed_ms", "unpack_ms"))
    frac = lambda key, keep: span([100 * r[key] for r in cupy if keep(r["dtype"])])  # noqa: E731
    return (f"| codec kernels, bf16 / fp8 [8192, 14336] elements "
            f"| CuPy: fixed-capacity pack {frac('pack_fixed_frac_copy', lambda d: d == 'bfloat16')} % "
            f"(bf16) / {frac('pack_fixed_frac_copy', lambda d: d != 'bfloat16')} % "
            f"(fp8) of the copy bandwidth ({c8['copy_bandwidth_Bps'] / 1e12:.2f} TB/s), unpack "
            f"{frac('unpack_frac_copy', lambda d: True)} %. Numba / CuPy time: "
            f"fixed-capacity pack {span(slow['pack_fixed_ms'], '{:.2f}')}×, unpack "
            f"{span(slow['unpack_ms'], '{:.2f}')}× "
            f"| `bench/results/{stem}.md` |")


def ci(v: dict, key: str = "median_ratio_ci95") -> str:
    """A 95 % interval of a median ratio as the docs write it: +1.3 % to +4.0 %."""
    return f"{pct(v[key][0])} to {pct(v[key][1])}"


def gpt12_turns_row(tg: dict, stem: str, run: str = "another run") -> str:
    """A GPT run of eager and compiled variants in many turns (no checkpointing); ``run``
    says which."""
    tiv = tg["interleaved"]["variants"]
    return (f"| same GPT, eager and torch.compile'd, steps in turn ({tg['interleaved']['turns']} "
            f"turns, {run}) | torch.compile'd "
            f"{pct(tiv['ours-compiled']['median_ratio_vs_own'])} "
            f"({ci(tiv['ours-compiled'], 'median_ratio_vs_own_ci95')}) vs compiled dense; eager "
            f"{pct(tiv['ours-nosign']['median_ratio'])} ({ci(tiv['ours-nosign'])}) vs dense "
            f"| `bench/results/{stem}.md` |")


def gpt12_ratios(tg: dict) -> str:
    """A GPT run in turns with checkpointing: its turns, dense's step and the three ratios,
    as the trained-model rows write them."""
    tiv = tg["interleaved"]["variants"]
    return (f"({tg['interleaved']['turns']} turns; dense's step "
            f"{tiv['dense']['median_step_ms']:.0f} ms) | step "
            f"{pct(tiv['ours-nosign']['median_ratio'])} ({ci(tiv['ours-nosign'])}) vs dense, "
            f"checkpointing {pct(tiv['checkpoint']['median_ratio'])}, torch.compile'd "
            f"{pct(tiv['ours-compiled']['median_ratio_vs_own'])} "
            f"({ci(tiv['ours-compiled'], 'median_ratio_vs_own_ci95')}) vs compiled dense")


def gpt12_pretrained_row(tg: dict, stem: str) -> str:
    """The GPT run from the dense model trained first (``--pretrain-steps``), in turns."""
    tgv, pre = tg["variants"], tg["pretrain"]
    zeros = statistics.mean(pre["mlp_zeros"])
    return (f"| same GPT trained {pre['steps']} steps first ({100 * zeros:.0f} % zeros in the MLP "
            f"activations), steps in turn {gpt12_ratios(tg)}; kept "
            f"after the forward {mib(tgv['ours-nosign']['after_forward_mib'])} MiB vs "
            f"{mib(tgv['dense']['after_forward_mib'])} dense, "
            f"{mib(tgv['checkpoint']['after_forward_mib'])} checkpointed "
            f"| `bench/results/{stem}.md` |")


def gpt12_settings_row(tg: dict, stem: str, what: str) -> str:
    """A trained-model GPT run in turns under other settings (``what``): the ratios and the
    whole run's peak beside the timed steps' own."""
    tgv = tg["variants"]
    ours = tgv["ours-nosign"]
    return (f"| same, {what} {gpt12_ratios(tg)}; peak "
            f"{mib(ours['peak_mib'])} MiB ({mib(ours['timed_peak_mib'])} in the timed steps) vs "
            f"{mib(tgv['dense']['peak_mib'])} dense, {mib(tgv['checkpoint']['peak_mib'])} "
            f"checkpointed | `bench/results/{stem}.md` |")


def gpt12_frozen_row(tg: dict, stem: str, what: str) -> str:
    """A trained-model GPT run in turns with ``ours-compiled-frozen`` beside ours-compiled:
    the ratios, and the frozen variant's against compiled dense."""
    frozen = tg["interleaved"]["variants"]["ours-compiled-frozen"]
    return (f"| same, {what} {gpt12_ratios(tg)}; with the capacities frozen after "
            f"{FREEZE_AFTER} steps (`freeze_capacity`) {pct(frozen['median_ratio_vs_own'])} "
            f"({ci(frozen, 'median_ratio_vs_own_ci95')}) | `bench/results/{stem}.md` |")


def gpt12_graphed_row(tg: dict, stem: str, what: str,
                      ops: str = "our ops between them") -> str:
    """A trained-model GPT run in turns with ``dense-graphed`` and ``ours-graphed``
    (``mode="reduce-overhead"``) beside the rest: the ratios, and ours-graphed's against
    dense compiled the same way; ``ops``: where the ops ran (inside since session 61)."""
    tiv = tg["interleaved"]["variants"]
    graphed = tiv["ours-graphed"]
    return (f"| same, {what} {gpt12_ratios(tg)}; under `mode=\"reduce-overhead\"` (inductor's "
            f"CUDA graphs, {ops}) {pct(graphed['median_ratio_vs_own'])} "
            f"({ci(graphed, 'median_ratio_vs_own_ci95')}) vs dense compiled the same way, "
            f"{pct(graphed['median_ratio'])} vs dense eager where compiled dense (default mode) "
            f"took {pct(tiv['dense-compiled']['median_ratio'])} "
            f"| `bench/results/{stem}.md` |")


def gpt12_stepgraph_row(tg: dict, stem: str, what: str) -> str:
    """A trained-model GPT run in turns with whole steps captured with ``torch.cuda.graph``
    (``dense-stepgraph``, ``ours-stepgraph``, ``ours-stepgraph-recompute``) beside the rest:
    ours' captured step against dense's, with conditional nodes in its backwards and with
    every backward recomputing."""
    tiv = tg["interleaved"]["variants"]
    ours, rec = tiv["ours-stepgraph"], tiv["ours-stepgraph-recompute"]
    return (f"| same, {what} {gpt12_ratios(tg)}; the whole step captured with "
            f"`torch.cuda.graph` {pct(ours['median_ratio_vs_own'])} "
            f"({ci(ours, 'median_ratio_vs_own_ci95')}) vs dense captured the same way "
            f"({pct(rec['median_ratio_vs_own'])} where every captured backward recomputes), "
            f"{pct(ours['median_ratio'])} vs dense eager where compiled dense took "
            f"{pct(tiv['dense-compiled']['median_ratio'])} | `bench/results/{stem}.md` |")


def gpt12_all_graphs_row(tg: dict, stem: str, what: str) -> str:
    """A trained-model GPT run in turns with every graph mode beside the rest: inductor's
    CUDA graphs with the ReLU² ops inside them, then the whole step captured with
    ``torch.cuda.graph`` (its backwards' conditional nodes, and every one recomputing)."""
    tiv = tg["interleaved"]["variants"]
    ours, rec = tiv["ours-stepgraph"], tiv["ours-stepgraph-recompute"]
    graphed = gpt12_graphed_row(tg, stem, what, "our ops inside them")
    graphed = graphed[:graphed.rindex(" | `bench/results/")]
    return (f"{graphed}; the whole step captured with `torch.cuda.graph` "
            f"{pct(ours['median_ratio_vs_own'])} ({ci(ours, 'median_ratio_vs_own_ci95')}) vs "
            f"dense captured the same way ({pct(rec['median_ratio_vs_own'])} where every "
            f"captured backward recomputes) | `bench/results/{stem}.md` |")


def gpt12_graph_modes_row(tg: dict, stem: str, what: str) -> str:
    """A trained-model GPT run in turns of eager, inductor's CUDA graphs and the whole step
    captured with ``torch.cuda.graph`` (no checkpointing): each of ours against its dense
    twin, and the step graph's recaptures."""
    tiv = tg["interleaved"]["variants"]
    eager, graphed, step = tiv["ours-nosign"], tiv["ours-graphed"], tiv["ours-stepgraph"]
    return (f"| same, {what} ({tg['interleaved']['turns']} turns; dense's step "
            f"{tiv['dense']['median_step_ms']:.0f} ms) | step {pct(eager['median_ratio'])} "
            f"({ci(eager)}) vs dense; under `mode=\"reduce-overhead\"` "
            f"{pct(graphed['median_ratio_vs_own'])} ({ci(graphed, 'median_ratio_vs_own_ci95')}) "
            f"vs dense compiled the same way; the whole step captured with `torch.cuda.graph` "
            f"after {STEP_GRAPH_SETTLE} eager steps on their own batches "
            f"{pct(step['median_ratio_vs_own'])} ({ci(step, 'median_ratio_vs_own_ci95')}) vs "
            f"dense captured the same way, {step['capacity']['recaptures']} captures again, "
            f"{step['capacity']['replay_recomputes_per_step']:.2f} replays a step recomputing "
            f"| `bench/results/{stem}.md` |")


def gpt12_reglu_row(tg: dict, stem: str, what: str) -> str:
    """The trained GPT with a ReGLU MLP in turns: ours on the C++ host path and on the
    Python one against dense, compiled and under ``reduce-overhead`` against dense
    compiled the same way, and what the forward keeps."""
    tiv, tgv, pre = tg["interleaved"]["variants"], tg["variants"], tg["pretrain"]
    zeros = statistics.mean(pre["mlp_zeros"])
    ours, comp = tiv["ours-nosign"], tiv["ours-compiled"]
    python = (f" ({pct(tiv['ours-python']['median_ratio'])} on the Python host path)"
              if "ours-python" in tiv else "")
    graphed = tiv.get("ours-graphed")
    graphed = (f", under `mode=\"reduce-overhead\"` {pct(graphed['median_ratio_vs_own'])} "
               f"({ci(graphed, 'median_ratio_vs_own_ci95')}) vs dense compiled the same way"
               if graphed else "")
    return (f"| {tg['shape']['layers']}-layer ReGLU GPT (d_ff {tg['shape']['d_ff']}) trained "
            f"{pre['steps']} steps first ({100 * zeros:.0f} % zeros in the gate's ReLU), {what} "
            f"({tg['interleaved']['turns']} turns; dense's step "
            f"{tiv['dense']['median_step_ms']:.0f} ms) | step {pct(ours['median_ratio'])} "
            f"({ci(ours)}) vs dense{python}; "
            f"torch.compile'd {pct(comp['median_ratio_vs_own'])} "
            f"({ci(comp, 'median_ratio_vs_own_ci95')}) vs compiled dense{graphed}; kept "
            f"after the forward {mib(tgv['ours-nosign']['after_forward_mib'])} MiB vs "
            f"{mib(tgv['dense']['after_forward_mib'])} dense; {ops_syncs(tg):.0f} host syncs per "
            f"step from our ops | `bench/results/{stem}.md` |")


def ops_syncs(tg: dict) -> float:
    """Host syncs per step the profiler counted in our variants (stream, event and device
    synchronizes, blocking copies, items of device tensors), leaving out any variant whose
    profiled steps held a recompile (the compiler's syncs, not the ops')."""
    return sum(v["syncs"]["per_step"][k] for name, v in tg["variants"].items()
               if name.startswith("ours") and not v.get("compiles", {}).get("profiled")
               for k in ("cudaStreamSynchronize", "cudaEventSynchronize",
                         "cudaDeviceSynchronize", "cudaMemcpy", "item of a device tensor"))


def gpt12_syncs_row(tg: dict, stem: str, what: str) -> str:
    """:func:`gpt12_settings_row` with the host syncs per step from our ops."""
    row = gpt12_settings_row(tg, stem, what)
    cut = row.rindex(" | `bench/results/")
    return f"{row[:cut]}; {ops_syncs(tg):.0f} host syncs per step from our ops{row[cut:]}"


def budget_row(bu: dict, stem: str, what: str) -> str:
    """A memory-budget run (``train_gpt.py --budget``): the largest batch of each variant
    and tokens/s of ours and checkpointing at the largest both fit."""
    tp = bu["throughput"]
    ours, ck = tp["ours-nosign"]["tokens_per_s"], tp["checkpoint"]["tokens_per_s"]
    return (f"| {what} within {mib(bu['budget_mib'])} MiB ({bu['config']['budget_factor']} × "
            f"dense's peak) | largest batch: dense {bu['largest_batch']['dense']}, ours (nosign) "
            f"{bu['largest_batch']['ours-nosign']}, checkpointing "
            f"{bu['largest_batch']['checkpoint']}; at batch {bu['common_batch']} ours {ours:.0f} "
            f"tokens/s vs checkpointing {ck:.0f} ({pct(ours / ck, 0)}) | `bench/results/{stem}.md` |")


def bitident_row(bi: dict, stem: str, what: str) -> str:
    """A bit-identity run (``--bitident-steps``, math attention): whether every packed
    variant's losses and final parameters equal dense's, and their step and peak."""
    v = bi["variants"]
    ours = [n for n in v if n != "dense"]
    same = identical(*(v[n][k] for n in ours for k in ("losses_bit_identical",
                                                       "params_bit_identical")))
    return (f"| {what}, {bi['plan']['timed']} steps with math attention | losses and final "
            f"parameters {same} to dense ({', '.join(ours)}); step "
            f"{pct(v['ours-nosign']['step_ratio_vs_dense'], 0)} (nosign) vs dense "
            f"{v['dense']['median_step_ms']:.1f} ms; peak {mib(v['ours-nosign']['peak_mib'])} "
            f"MiB vs {mib(v['dense']['peak_mib'])} | `bench/results/{stem}.md` |")


def host_overhead_paths_row(name: str) -> str:
    """A host_overhead run with modes ``torch`` (the C++ path of the public ops) and
    ``stream`` (the Python path, same stream and allocator): the 4096-element host times."""
    res = result(f"{name}.json")
    small = next(i for i in res["inputs"] if i["size"] == "small")
    ops = [s for s in res["summary"] if s["target_us"] is not None]

    def host(backend, mode):
        return [s["host_us"] for s in ops if s["backend"] == backend and s["mode"] == mode]
    adds = [s["host_us"] for s in res["summary"] if s["op"] == "torch_add"]
    met = [s for s in ops if s["backend"] == "cupy" and s["mode"] == "torch"]
    return (f"| host time per call, {small['numel']}-element bf16 tensor, public `bc.*` API on "
            f"torch tensors | CuPy through the C++ host path (the default) "
            f"{span(host('cupy', 'torch'), '{:.1f}')} µs ({sum(s['state'] == 'met' for s in met)} "
            f"of {len(met)} targets met), the same calls on the Python host path "
            f"{span(host('cupy', 'stream'), '{:.1f}')} µs, Numba "
            f"{span(host('numba', 'torch'), '{:.1f}')} µs (torch's `x + x`: "
            f"{span(adds, '{:.1f}')} µs) | `bench/results/{name}.md` |")


def readme_h100() -> list:
    """The rows of the README's second table: the H100 runs (``*_h100.json``)."""
    hf = result("bench_hf_h100.json")
    hiv = hf["interleaved"]["variants"]
    hv = hf["variants"]
    tg = result("train_gpt_h100.json")
    tiv, tgv, sh = tg["interleaved"]["variants"], tg["variants"], tg["shape"]
    ff = result("torch_ffn_h100.json")
    kinds = {k: v["variants"] for k, v in ff["kinds"].items()}
    ffn = "; ".join(
        f"{'ReLU²' if kind == 'relu2' else 'ReLU'} {pct(v['ours_raw']['time_vs_dense'])} (raw) / "
        f"{pct(v['ours_nosign']['time_vs_dense'])} (nosign) vs "
        f"{pct(v['checkpoint']['time_vs_dense'])} checkpointed"
        for kind, v in kinds.items())
    return [
        f"| transformers OPT as above, steps in turn ({hf['interleaved']['turns']} turns) | "
        f"`convert(model)` {pct(hiv['converted']['median_ratio'])} (95 % interval of the "
        f"median {ci(hiv['converted'])}), `compress_saved_tensors` "
        f"{pct(hiv['hooks']['median_ratio'])} ({ci(hiv['hooks'])})"
        + (f", checkpointing {pct(hiv['checkpointing']['median_ratio'])}"
           if "checkpointing" in hiv else "")
        + " vs plain; peak "
        f"{mib(hv['converted']['peak_mib'])} / {mib(hv['hooks']['peak_mib'])} MiB vs "
        f"{mib(hv['plain']['peak_mib'])} plain | `bench/results/bench_hf_h100.md` |",

        f"| {sh['layers']}-layer ReLU² GPT as above, SDPA's fused attention, steps in turn "
        f"({tg['interleaved']['turns']} turns) | step {pct(tiv['ours-nosign']['median_ratio'])} "
        f"({ci(tiv['ours-nosign'])}) vs dense, checkpointing "
        f"{pct(tiv['checkpoint']['median_ratio'])}, torch.compile'd "
        f"{pct(tiv['ours-compiled']['median_ratio_vs_own'])} "
        f"({ci(tiv['ours-compiled'], 'median_ratio_vs_own_ci95')}) vs compiled dense; peak "
        f"{mib(tgv['ours-nosign']['peak_mib'])} MiB vs {mib(tgv['dense']['peak_mib'])} dense "
        "| `bench/results/train_gpt_h100.md` |",

        gpt12_turns_row(result("train_gpt_h100_60turns.json"), "train_gpt_h100_60turns"),
        *(gpt12_turns_row(result(f"train_gpt_h100_60turns_{host}_host.json"),
                          f"train_gpt_h100_60turns_{host}_host", run)
          for host, run in (("fast", "a fast host: dense's step 26 ms"),
                            ("slow", "a slow host: dense's step 37 ms"))),
        gpt12_pretrained_row(result("train_gpt_h100_pretrained.json"),
                             "train_gpt_h100_pretrained"),
        gpt12_settings_row(result("train_gpt_h100_pretrained_defaults.json"),
                           "train_gpt_h100_pretrained_defaults",
                           "under PyTorch's default GEMM and determinism settings"),
        gpt12_settings_row(result("train_gpt_h100_pretrained_initial.json"),
                           "train_gpt_h100_pretrained_initial",
                           "PyTorch's defaults and the packed modules' `initial_density=0.1`"),
        *(gpt12_frozen_row(result(f"train_gpt_h100_frozen_{host}_host.json"),
                           f"train_gpt_h100_frozen_{host}_host", f"PyTorch's defaults, {what}")
          for host, what in (("slow", "a slow host"), ("mid", "another host"))),
        *(gpt12_graphed_row(result(f"train_gpt_h100_s58_trained_graphed{suffix}.json"),
                            f"train_gpt_h100_s58_trained_graphed{suffix}",
                            f"PyTorch's defaults, {what}")
          for suffix, what in (("", "a host the GPU paces"), ("_slow_host", "a slow host"))),

        gpt12_stepgraph_row(result("train_gpt_h100_s59_stepgraph.json"),
                            "train_gpt_h100_s59_stepgraph", "PyTorch's defaults, a slow host"),
        gpt12_all_graphs_row(result("train_gpt_h100_s61_graphed.json"),
                             "train_gpt_h100_s61_graphed", "PyTorch's defaults, a host the GPU paces"),
        gpt12_graph_modes_row(result("train_gpt_h100_s62_graphs.json"),
                              "train_gpt_h100_s62_graphs",
                              "PyTorch's defaults, a host the GPU paces, in session 62"),
        gpt12_reglu_row(result("train_gpt_h100_s62_reglu.json"), "train_gpt_h100_s62_reglu",
                        "PyTorch's defaults"),
        gpt12_syncs_row(result("train_gpt_h100_s64_relu2.json"), "train_gpt_h100_s64_relu2",
                        "PyTorch's defaults, a host the GPU paces, in session 64"),
        gpt12_reglu_row(result("train_gpt_h100_s64_reglu.json"), "train_gpt_h100_s64_reglu",
                        "PyTorch's defaults, on session 63's kernels"),
        budget_row(result("train_gpt_budget_h100_s64_trained.json"),
                   "train_gpt_budget_h100_s64_trained", "the ReLU² GPT trained "
                   f"{result('train_gpt_budget_h100_s64_trained.json')['pretrain']['steps']} "
                   "steps first"),
        bitident_row(result("train_gpt_bitident_h100_s64_reglu.json"),
                     "train_gpt_bitident_h100_s64_reglu", "the ReGLU GPT"),

        f"| {ff['config']['layers']}-layer bf16 FFN stack as above, median of "
        f"{ff['config']['steps']} steps in turn | {ffn} | `bench/results/torch_ffn_h100.md` |",

        codecs_8192x14336_row("codecs_8192x14336_h100"),
        host_overhead_paths_row("host_overhead_h100_s57_fast_host"),
    ]


def guide() -> list:
    import bitsparse_core as bc
    from bitsparse_core.spec import format as fmt
    lay = bc.layout((1 << 20,), "bfloat16", "nosign")
    offsets = 100 * lay.offsets[1] / lay.mask[1]
    r, c, zeros = torch_ffn()
    t2 = r["kinds"]["relu2"]["variants"]
    jm = jax_modes()
    biv = result("train_gpt_bitident.json")["variants"]
    tg = result("train_gpt.json")
    tgv, sh = tg["variants"], tg["shape"]
    bu = result("train_gpt_budget.json")
    cd = result("codecs.json")
    tiv = tg["interleaved"]["variants"]
    mhr = {row["variant"]: row for row in result("module_host.json")["rows"]}
    return [
        f"plus {fmt.ALIGN}-byte alignment and the chunk offsets ({offsets:.1f} % of the mask at "
        f"the default {1 << fmt.DEFAULT_CHUNK_LOG2}-element chunks).",

        f"At 80 % zeros a bf16 activation shrinks {size_ratio(0.8):.2f}× with `nosign`; at 90 % "
        f"zeros {size_ratio(0.9):.2f}×, at 99 % {size_ratio(0.99):.2f}× (the format's size "
        "formula for a 2^20-element tensor with exactly that fraction of zeros, which "
        "`bitsparse demo` measures; `bc.packed_size(shape, dtype, encoding, nnz)` gives any "
        "other size).",

        "pack and unpack against the device copy bandwidth measured in the same run "
        f"({cd['copy_bandwidth_Bps'] / 1e9:.0f} GB/s), the naive PyTorch version and nvCOMP "
        f"{cd['nvcomp'][0]['version']}.",

        f"{c['layers']} layers, d = {c['d']}, f = {c['f']}, {c['tokens']} tokens, bf16, {zeros} % "
        f"zeros. ReLU²: peak {mib(t2['ours_nosign']['peak_mib'])} MiB packed vs "
        f"{mib(t2['dense']['peak_mib'])} dense and {mib(t2['checkpoint']['peak_mib'])} with "
        f"per-layer checkpointing, at {pct(t2['ours_raw']['time_vs_dense'])} (raw) / "
        f"{pct(t2['ours_nosign']['time_vs_dense'])} (nosign) step time (checkpointing: "
        f"{pct(t2['checkpoint']['time_vs_dense'])}).",

        f"activation memory {gib(jm['packed']['temp_size_in_bytes'])} GiB packed vs "
        f"{gib(jm['dense']['temp_size_in_bytes'])} GiB plain, "
        f"{pct(jm['packed']['step_ms_median'] / jm['dense']['step_ms_median'])} step time "
        f"(jax.checkpoint: {gib(jm['checkpoint']['temp_size_in_bytes'])} GiB, "
        f"{pct(jm['checkpoint']['step_ms_median'] / jm['dense']['step_ms_median'])}); packed "
        f"through the project's kernels (`impl=\"ffi\"`): "
        f"{gib(jm['packed-ffi']['temp_size_in_bytes'])} GiB, "
        f"{pct(jm['packed-ffi']['step_ms_median'] / jm['dense']['step_ms_median'])}.",

        f"{sh['layers']} layers, d = {sh['d']}, {sh['seq'] * sh['batch']} tokens per step, bf16. "
        f"With math attention the losses and final parameters of the packed runs are "
        f"{identical(*(biv[v][k] for v in ('ours-raw', 'ours-nosign') for k in ('losses_bit_identical', 'params_bit_identical')))}"
        f" to dense's over {len(biv['dense']['losses'])} steps "
        "([train_gpt_bitident.md](../bench/results/train_gpt_bitident.md)). With SDPA's fused "
        f"attention a packed step takes "
        f"{pct(tg['interleaved']['variants']['ours-nosign']['median_ratio'], 0)} (nosign) over "
        f"dense's, steps taken in turn, at a peak of {mib(tgv['ours-nosign']['peak_mib'])}"
        f" MiB vs {mib(tgv['dense']['peak_mib'])}; under a {mib(bu['budget_mib'])} MiB budget "
        f"packing fits batch {bu['largest_batch']['ours-nosign']} where dense fits "
        f"{bu['largest_batch']['dense']} ([train_gpt_budget.md](../bench/results/train_gpt_budget.md)).",

        f"The FFN op's host path in C++ is the default (the Python path, "
        f"`native.python_path()`, costs {mhr['packed-python']['train_x_dense']:.2f} × dense's "
        f"host time per layer against {mhr['packed-nosign']['train_x_dense']:.2f} ×: "
        "[module_host.md](../bench/results/module_host.md)); under `torch.compile` ours took "
        f"{pct(tiv['ours-compiled']['median_ratio_vs_own'], 1)} over compiled dense's "
        "([train_gpt.md](../bench/results/train_gpt.md)).",
    ]


def torch_md() -> list:
    r, c, zeros = torch_ffn()
    kinds = r["kinds"]
    rows = []
    for kind, label in (("relu", "ReLU"), ("relu2", "ReLU²")):
        v = kinds[kind]["variants"]
        order = ("dense", "checkpoint", "save_on_cpu", "ours_raw", "ours_nosign")
        rows.append(f"| {label} peak MiB | " + " | ".join(mib(v[n]["peak_mib"]) for n in order)
                    + " |")
        rows.append(f"| {label} step ms | " + " | ".join(
            f"{v[n]['median_ms']:.1f}" + (f" ({pct(v[n]['time_vs_dense'])})"
                                         if n.startswith("ours") else "") for n in order) + " |")
    dense_act = c["tokens"] * c["f"] * 2 / 2**20          # one bf16 activation, MiB
    per_layer = {(k, enc): dense_act * (2 if k == "relu2" else 1)
                 - kinds[k]["variants"][f"ours_{enc}"]["bytes_saved_mib"] / c["layers"]
                 for k in ("relu", "relu2") for enc in ("raw", "nosign")}
    L = c["layers"]
    slack = max(abs(v["dense"]["saved_mib"] - v[n]["saved_mib"] - v[n]["bytes_saved_mib"])
                for v in (k["variants"] for k in kinds.values()) for n in ("ours_raw", "ours_nosign"))
    return [
        f"{L}-layer bf16 FFN stack, d = {c['d']}, f = {c['f']}, {c['tokens']} tokens, "
        f"{zeros} % zero activations, torch {r['torch']}, median of {c['steps']} steps after "
        f"{c['warmup']} warm-up steps.",
        *rows,
        "The memory left allocated after the forward differs from dense by what packing "
        f"saves, to within {slack:.0f} MiB. In this run that is {L} × ({dense_act:.0f} MiB dense − "
        f"{per_layer['relu', 'raw']:.0f} MiB packed) with raw and {L} × ({dense_act:.0f} − "
        f"{per_layer['relu', 'nosign']:.0f}) with nosign for ReLU; for ReLU², whose dense "
        f"version keeps both `relu(a)` and its square, {L} × ({2 * dense_act:.0f} − "
        f"{per_layer['relu2', 'raw']:.0f}) and {L} × ({2 * dense_act:.0f} − "
        f"{per_layer['relu2', 'nosign']:.0f}).",
    ]


def jax_md() -> list:
    r = result("jax_ffn.json")
    jm = jax_modes()
    c = r["config"]
    cd = result("codecs.json")
    dense_ms = jm["dense"]["step_ms_median"]
    co = r["codec"]
    ops = [("elementwise `t + 1` (a copy)", "copy"),
           ("`pack` (relu, mask, offsets, 15-bit value stream)", "pack"),
           ("`unpack`", "unpack"), ("mask only", "mask"),
           ("FFI `pack` (the CUDA kernel as a custom call)", "ffi pack"),
           ("FFI `unpack`", "ffi unpack")]
    labels = {"dense": "plain JAX", "checkpoint": "`jax.checkpoint` per block",
              "packed": f"packed, density bound {c['density']}",
              "packed-ffi": f"packed through the FFI, bound {c['density']}",
              "packed-overflow": f"packed, bound {c['overflow_density']} (every layer overflows)",
              "packed-ffi-overflow": f"packed through the FFI, bound {c['overflow_density']} "
                                     "(every layer overflows)"}
    table = []
    for mode in ("dense", "checkpoint", "packed", "packed-ffi", "packed-overflow",
                 "packed-ffi-overflow"):
        m = jm[mode]
        same = m.get("bit_identical_to_dense")
        table.append(f"| {labels[mode]} | {gib(m['temp_size_in_bytes'])} | "
                     f"{m['step_ms_median']:.1f} | "
                     + ("–" if mode == "dense" else pct(m["step_ms_median"] / dense_ms))
                     + f" | {'–' if same is None else ('yes' if same else 'no')} |")
    pos = r["positive_fraction"]
    elems = co["elements"]
    block_in = c["tokens"] * c["d"] * 2 / 2**20
    saved = jm["dense"]["temp_size_in_bytes"] - jm["packed"]["temp_size_in_bytes"]
    cupy_fixed = [100 * row["pack_fixed_frac_copy"] for row in cd["rows"]
                  if row["backend"] == "cupy"]
    ffi = jm["packed-ffi"]
    return [
        f"On an H200 at full size, the codec adds "
        f"{pct(jm['packed']['step_ms_median'] / dense_ms)} to the step time over plain JAX. "
        f"`jax.checkpoint` adds {pct(jm['checkpoint']['step_ms_median'] / dense_ms)}",
        f"`impl=\"ffi\"` packs through the project's CUDA kernels as XLA custom calls: on the "
        f"H200 at full size its step takes {pct(ffi['step_ms_median'] / dense_ms)} over plain "
        f"JAX, at {gib(ffi['temp_size_in_bytes'])} GiB of temp memory (jax.numpy's pack: "
        f"{gib(jm['packed']['temp_size_in_bytes'])}), gradients "
        f"{identical(ffi['bit_identical_to_dense'])} to plain JAX's; its overflow run is "
        f"{identical(jm['packed-ffi-overflow']['bit_identical_to_dense'])}.",
        f"Measured on one [{c['tokens']}, {c['f']}] bf16 activation:",
        *[f"| {label} | {co[key]['ms']:.2f} ms | {co[key]['GBps']:.0f} GB/s |"
          for label, key in ops],
        f"This pack moves {co['pack']['GBps']:.0f} GB/s, "
        f"{100 * co['pack']['GBps'] / co['copy']['GBps']:.0f} % of what the copy reaches in the "
        f"same run; the CUDA kernels' fixed-capacity pack reaches "
        f"{span(cupy_fixed)} % of the copy bandwidth "
        f"([codecs.md](../bench/results/codecs.md), 2^{int(math.log2(cd['numel']))} elements), "
        f"so an FFI pack would be faster. But measured alone, packing costs {c['layers']} × {co['pack']['ms']:.2f} = "
        f"{c['layers'] * co['pack']['ms']:.1f} ms per step, yet the whole measured overhead is "
        f"{jm['packed']['step_ms_median'] - dense_ms:.1f} ms per step",
        f"The overflow run (capacity bound {c['overflow_density']} < the real "
        f"{max(pos):.2f}, so every layer recomputed) was "
        + ("bit-identical too." if jm["packed-overflow"]["bit_identical_to_dense"]
           else "**not** bit-identical."),
        f"{c['layers']} residual blocks `x + relu(x @ w1 + b1) @ w2`, bf16, d = {c['d']}, "
        f"f = {c['f']}, {c['tokens']} tokens. `b1` is calibrated per layer "
        f"for {100 - round(100 * sum(pos) / len(pos))} % negative pre-activations (measured: "
        f"{span([100 * p for p in pos], '{:.1f}')} % positive).",
        f"timed as the median of {c['steps']} steps after a warm-up.",
        f"The arguments (parameters and x, {gib(jm['dense']['argument_size_in_bytes'])} GiB)",
        *table,
        f"Packing cuts the step's temp memory by {saved / 2**30:.1f} GiB "
        f"({MINUS}{100 * saved / jm['dense']['temp_size_in_bytes']:.0f} %). The saved residual "
        f"per layer is {co['packed_plane_bytes'] / 2**20:.0f} MiB of planes plus the "
        f"{block_in:.0f} MiB block input. Plain JAX keeps `relu(a)` "
        f"({co['dense_bytes'] / 2**20:.0f} MiB) and the `a > 0` predicate "
        f"({elems / 2**20:.0f} MiB) besides that input. `jax.checkpoint` needs "
        f"{gib(jm['packed']['temp_size_in_bytes'] - jm['checkpoint']['temp_size_in_bytes'])} GiB "
        "less temp memory",
        f"The bound is per tensor: {c['density']} against a measured {max(pos):.2f} here.",
    ]


FRAGMENTS = {"README.md": lambda: readme() + readme_h100(), "docs/guide.md": guide,
             "docs/torch.md": torch_md, "docs/jax.md": jax_md}


# ----------------------------------------------------------------------- tests
def _flat(text: str) -> str:
    return " ".join(text.split())


def _regions(doc: str) -> list:
    return list(REGION.finditer((ROOT / doc).read_text()))


# What may stand in a region besides the fragments: code, links, and names with digits.
_NOT_FIGURES = [re.compile(p) for p in (
    r"`[^`]*`",                                 # inline code: paths, calls, 2^27 in code
    r"\]\([^)]*\)",                             # link targets
    r"!\[[^\]]*\]",                             # image alt texts
    r"\b[A-Za-z_][\w.\-]*\d[\w.\-]*",           # names: H200, bf16, fc1, e4m3fn, v1, x86
    r"§\d+",
)]


@pytest.mark.parametrize("doc", DOCS)
def test_every_fragment_is_quoted_verbatim(doc):
    text = _flat("".join(m["body"] for m in _regions(doc)))
    missing = [f for f in FRAGMENTS[doc]() if _flat(f) not in text]
    assert not missing, (f"{doc}: these figures, as {RESULTS.relative_to(ROOT)} now gives "
                         "them, are not in its figures regions:\n" + "\n".join(missing))


@pytest.mark.parametrize("doc", DOCS)
def test_no_unchecked_number_in_a_figures_region(doc):
    regions = _regions(doc)
    assert regions, f"{doc} has no figures region"
    fragments = sorted((_flat(f) for f in FRAGMENTS[doc]()), key=len, reverse=True)
    for m in regions:
        body = _flat(m["body"])
        for f in fragments:
            body = body.replace(f, " ")
        for pattern in _NOT_FIGURES:
            body = pattern.sub(" ", body)
        stray = re.findall(r"[^ ]*\d[^ ]*", body)
        assert not stray, f"{doc}: numbers no check produces: {stray}"
        for source in re.findall(r"bench/results/[\w.]+", m["sources"]):
            assert (ROOT / source).is_file(), f"{doc} cites {source}, which does not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_docs_do_not_cite_the_stale_numba_run(doc):
    assert "numba_codecs" not in (ROOT / doc).read_text()


def test_the_stale_numba_run_is_labelled():
    assert (RESULTS / "numba_codecs.md").read_text().startswith("> **Stale**")


def test_gpu_session_log_parses():
    """The latest GPU run parses; a failure it recorded must be named and said fixed (the
    README quotes the counts as they are)."""
    g = gpu_session()
    assert g["passed"] > 0
    if g["failed"]:
        latest = (RESULTS / "gpu_session.md").read_text().split("\n## ")[1]
        named = re.findall(r"`(tests/[\w/.]+::[\w\[\]-]+)`", latest)
        assert len(named) >= g["failed"] and "Fixed after the run" in latest, latest


@pytest.mark.parametrize("doc", DOCS)
def test_install_instructions_work_from_a_checkout(doc):
    """Nothing tells users to install from an index the package is not on."""
    text = (ROOT / doc).read_text()
    bad = re.findall(r"pip install [\"']?bitsparse_core\b", text)
    assert not bad, f"{doc}: {bad}"


def test_guide_extras_exist():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    named = set(re.findall(r'pip install -e "\.\[([\w,]+)\]"', (ROOT / "docs/guide.md").read_text()))
    assert named and all(e in extras for group in named for e in group.split(",")), named


def _commands(doc: str) -> list:
    """The ``bitsparse ...`` command lines of a doc's bash blocks (continuations joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S)
    lines = " ".join(blocks).replace("\\\n", " ").split("\n")
    return [line.split("#")[0].strip() for line in lines if line.strip().startswith("bitsparse ")]


@pytest.mark.parametrize("doc", DOCS)
def test_documented_command_lines_parse(doc):
    import shlex
    from bitsparse_core.cli import _parser
    for line in _commands(doc):
        try:
            _parser().parse_args(shlex.split(line)[1:])
        except SystemExit as exc:        # --version / --help exit 0; a bad option exits 2
            assert exc.code == 0, line


if __name__ == "__main__":
    for doc, make in FRAGMENTS.items():
        print(f"==== {doc}")
        for f in make():
            print(f)
            print()
    sys.exit(0)
