"""bench/train_gpt.py at its CPU size: the variants train bit-identically to dense, and
``--rounds`` runs the sequence again for timing, with per-round ratios to dense."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_bench

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def test_train_gpt_rounds_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "train_gpt.py"), "--small",
                          "--device", "cpu", "--variants", "dense,ours-nosign", "--steps", "2",
                          "--warmup", "1", "--profile-steps", "0", "--sparsity-every", "0",
                          "--rounds", "2", "--interleave", "2", "--interleave-block", "2",
                          "--interleave-streamed", "--out", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    variants = json.loads((tmp_path / "train_gpt.json").read_text())["variants"]
    ours, dense = variants["ours-nosign"], variants["dense"]
    assert ours["losses_bit_identical"] and ours["params_bit_identical"]
    assert len(dense["round_step_ms"]) == len(ours["round_step_ms"]) == 2
    assert dense["round_step_ms"][0] == dense["median_step_ms"]      # round 1 is the main run
    want = [o / d for o, d in zip(ours["round_step_ms"], dense["round_step_ms"])]
    assert ours["round_ratio_vs_dense"] == pytest.approx(want)
    md = (tmp_path / "train_gpt.md").read_text()
    assert "Rounds (the variant sequence run again" in md
    inter = json.loads((tmp_path / "train_gpt.json").read_text())["interleaved"]
    assert inter["status"] == "ok" and inter["turns"] == 2 and not inter["failed"]
    assert inter["block"] == 2 and "2 consecutive steps of every variant" in md
    assert inter["step_sync"] is False and "none between the timed steps" in md
    rec = inter["variants"]["ours-nosign"]
    assert rec["ratios"] == pytest.approx([o / d for o, d in zip(
        rec["step_ms"], inter["variants"]["dense"]["step_ms"])])
    assert "## Interleaved steps" in md
    assert inter["graphs_compiled"] == 0 and "torch.compile compiled 0 graphs" in md
    # host per phase of the timed turns, and the packed modules' counters over them (2
    # turns of a 2-layer model: a pack a layer and step; the CPU path never waits)
    phases = rec["host_phases_ms"]
    assert set(phases) == {"forward", "backward", "optimizer"} and min(phases.values()) > 0
    assert rec["capacity"]["packs_per_step"] == 2 and rec["capacity"]["waits_per_step"] == 0
    assert "capacity" not in inter["variants"]["dense"]
    assert "| ours-nosign | " in md.split("Host per phase in the timed turns")[1]


def test_reglu_gpt_trains_bit_identically_to_its_dense_form_on_cpu(tmp_path):
    """``--ffn reglu``: every layer's MLP a PackedReGLUFFN against the dense ReGLU with the
    same parameter names (the shared initial state loads into both); eager and compiled
    train bit-identically to their references, and the report names the MLP."""
    out = run_bench("train_gpt.py", "--small", "--device", "cpu", "--ffn", "reglu",
                    "--variants", "dense,ours-nosign,dense-compiled,ours-compiled", "--steps",
                    "2", "--warmup", "1", "--profile-steps", "0", "--sparsity-every", "1",
                    "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "train_gpt.json").read_text())
    assert summary["shape"]["ffn"] == "reglu"
    for name in ("ours-nosign", "ours-compiled"):
        rec = summary["variants"][name]
        assert rec["losses_bit_identical"] and rec["params_bit_identical"], name
        assert rec["capacity"]["max_density"] > 0, name      # the packed ReGLU ran
    assert summary["variants"]["dense"]["sparsity"]          # the gate's zeros, probed
    md = (tmp_path / "train_gpt.md").read_text()
    assert md.startswith("# GPT with ReGLU MLP") and "ReGLU MLP d_ff=256" in md


def test_interleaved_compiled_variants_compile_once_each_on_cpu(tmp_path):
    """The packed model compiled, trained in turns while its capacity settles from the
    full one to the densities it sees: one graph per compiled variant, no recompile; the
    frozen variant recompiles once, when it freezes."""
    out = run_bench("train_gpt.py", "--small", "--device", "cpu", "--variants",
                    "dense,dense-compiled,ours-compiled,ours-compiled-frozen", "--steps", "2",
                    "--warmup", "1",   # the frozen variant freezes before its third step
                    "--profile-steps", "0", "--sparsity-every", "0", "--interleave", "4",
                    "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "train_gpt.json").read_text())
    inter = summary["interleaved"]
    assert inter["status"] == "ok" and not inter["failed"]
    assert inter["graphs_compiled"] == 4
    assert summary["variants"]["ours-compiled"]["capacity"]["max_density"] > 0   # counts came back
    frozen = summary["variants"]["ours-compiled-frozen"]["capacity"]
    assert frozen["frozen"] and frozen["capacity_density"] < 1
    assert not summary["variants"]["ours-compiled"]["capacity"]["frozen"]


def test_copy_overlap_counts_copy_time_under_kernels():
    import types

    from torch.autograd import DeviceType
    sys.path.insert(0, str(ROOT / "bench"))
    from profile_syncs import copy_overlap

    def ev(name, start, end, dev=DeviceType.CUDA):
        return types.SimpleNamespace(name=name, device_type=dev,
                                     time_range=types.SimpleNamespace(start=start, end=end))
    events = [ev("gemm", 0, 100), ev("gemm", 150, 200),
              ev("Memcpy DtoH (Device -> Pinned)", 50, 170),     # 50 + 20 of 120 hidden
              ev("Memcpy HtoD (Pinned -> Device)", 300, 302),    # too short: a count
              ev("cudaLaunchKernel", 0, 500, DeviceType.CPU)]
    assert copy_overlap(events) == pytest.approx(70 / 120)
    assert copy_overlap(events[:2]) is None


def test_gpu_time_by_name_sums_each_kernels_time_per_step():
    import types

    from torch.autograd import DeviceType
    sys.path.insert(0, str(ROOT / "bench"))
    from profile_syncs import gpu_time_by_name

    def ev(name, start, end, dev=DeviceType.CUDA, annotation=False):
        return types.SimpleNamespace(name=name, device_type=dev, is_user_annotation=annotation,
                                     time_range=types.SimpleNamespace(start=start, end=end))
    events = [ev("gemm", 0, 300), ev("pack", 300, 400), ev("gemm", 400, 1000),
              ev("pack", 1000, 1100), ev("memset", 1100, 1102),
              ev("bench::step", 0, 1102, annotation=True),      # a range over the kernels
              ev("cudaLaunchKernel", 0, 5000, DeviceType.CPU)]   # host side: not counted
    rows = gpu_time_by_name(events, n_steps=2, rows=2)
    assert [r["name"] for r in rows] == ["gemm", "pack"]
    assert rows[0]["ms_per_step"] == pytest.approx(0.45)     # 900 us over 2 steps
    assert rows[1]["ms_per_step"] == pytest.approx(0.1) and rows[1]["runs_per_step"] == 1


def test_gpu_idle_by_next_puts_each_gap_on_the_work_that_ends_it():
    import types

    from torch.autograd import DeviceType
    sys.path.insert(0, str(ROOT / "bench"))
    from profile_syncs import gpu_idle_by_next

    def ev(name, start, end, annotation=False):
        return types.SimpleNamespace(name=name, device_type=DeviceType.CUDA,
                                     is_user_annotation=annotation,
                                     time_range=types.SimpleNamespace(start=start, end=end))
    # two streams: "side" overlaps "gemm", so the gap before "pack" counts from gemm's end
    events = [ev("gemm", 0, 300), ev("side", 100, 250), ev("pack", 340, 400),
              ev("cond", 460, 470), ev("pack", 500, 560), ev("gemm", 560, 900),
              ev("step", 0, 900, annotation=True)]     # a range: neither work nor a gap
    rows = gpu_idle_by_next(events, n_steps=2, rows=5)
    assert [r["name"] for r in rows] == ["pack", "cond"]
    assert rows[0]["idle_ms_per_step"] == pytest.approx(0.035)  # 40 + 30 us over 2 steps
    assert rows[0]["gaps_per_step"] == 1
    assert rows[1]["idle_ms_per_step"] == pytest.approx(0.03)   # 60 us over 2 steps


def test_step_split_report_names_what_paces_each_variant():
    """bench/step_split.py's table (its measurement needs a GPU): the side with the larger
    time paces the step, and a phase whose host time reached the sleep is flagged."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import step_split
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def row(host, gpu, full=False):
        r = {"step_ms": max(host, gpu) * 3}
        for p in step_split.PHASES:
            r.update({f"{p}_host_ms": host, f"{p}_gpu_ms": gpu, f"{p}_queue_full": full})
        return {**r, "host_ms": 3 * host, "gpu_ms": 3 * gpu}
    summary = {"device": "X", "shape": {"layers": 2, "d": 8, "d_ff": 32, "seq": 4, "batch": 1},
               "sleep_ms": 80, "turns": 3,
               "variants": {"a": row(10, 5), "b": row(4, 6), "c": row(70, 6, full=True)}}
    lines = {ln.split("|")[1].strip(): ln for ln in step_split.markdown(summary).splitlines()
             if ln.startswith("| ") and not ln.startswith("| variant")}
    assert lines["a"].endswith("| host |") and lines["b"].endswith("| GPU |")
    assert lines["c"].endswith("| host (queue full) |")
    assert "| 30.0 | 15.0 | 10.0 / 10.0 / 10.0 | 5.0 / 5.0 / 5.0 |" in lines["a"]


def test_pretraining_gives_every_variant_the_trained_weights_and_optimizer_state():
    """``--pretrain-steps``: the variants start from the dense model after N steps (its
    weights and AdamW state, which a variant's own steps then leave alone), and ours still
    trains bit for bit like dense from there."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_gpt as tg

    args = tg.parse_args(["--small", "--device", "cpu", "--sparsity-every", "0"])
    shape, device = tg.shape_and_device(args, tg.SMALL)
    initial = tg.initial_state(shape, args.seed)
    bench = tg.Bench(args, shape, tg.stdlib_bytes(limit=1 << 20), initial, device)
    record = tg.pretrain(bench, 3)
    assert record["steps"] == 3 and len(record["mlp_zeros"]) == shape.layers
    assert any(not torch.equal(bench.init_state[k], v) for k, v in initial.items())
    kept = {k: v.clone() for k, v in bench.init_opt_state["state"][0].items()}
    batches = tg.make_batches(bench.data, 2, shape.batch, shape.seq, args.seed)
    losses = {}
    for name in ("dense", "ours-nosign"):
        model, call, opt = tg.build(bench, name)
        assert int(opt.state_dict()["state"][0]["step"]) == 3
        for k, v in model.state_dict().items():
            assert torch.equal(v, bench.init_state[k].to(v.dtype)), k
        losses[name] = [float(tg.train_step(call, opt, x, y)) for x, y in batches]
    assert losses["dense"] == losses["ours-nosign"]
    for k, v in kept.items():       # the shared state is copied into each optimizer
        assert torch.equal(bench.init_opt_state["state"][0][k], v), k


@pytest.mark.gpu
def test_step_graph_variants_train_bit_identically_cuda(tmp_path):
    """The whole step captured with torch.cuda.graph (StepGraph): ours, with conditional
    nodes in its backwards and without (every backward recomputing), trains bit-identically
    to dense captured the same way, in the sequential run and in turns."""
    out = run_bench("train_gpt.py", "--small", "--device", "cuda", "--variants",
                    "dense,dense-stepgraph,ours-stepgraph,ours-stepgraph-recompute", "--steps", "3",
                    "--warmup", "1", "--profile-steps", "0", "--sparsity-every", "0",
                    "--interleave", "3", "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "train_gpt.json").read_text())
    for name in ("ours-stepgraph", "ours-stepgraph-recompute"):
        rec = summary["variants"][name]
        assert rec["losses_bit_identical"] and rec["params_bit_identical"], name
    inter = summary["interleaved"]
    assert inter["status"] == "ok" and not inter["failed"]
    assert inter["variants"]["ours-stepgraph"]["capacity"]["recaptures"] >= 0


def test_step_graph_settles_on_its_calls_then_captures_and_captures_again_where_told(
        monkeypatch):
    """StepGraph's protocol, with CUDA's graph and stream calls faked: its first ``settle``
    calls are eager steps on their own batches; the next captures the step once on static
    inputs and replays it; every later call copies its batch in and replays. Where
    ``adapt_to_replays`` answers nonzero after a replay, the next call captures again on
    the same static inputs (counted); a recompute variant never asks."""
    import contextlib
    import types
    sys.path.insert(0, str(ROOT / "bench"))
    import train_gpt as tg

    log = []

    class Graph:
        def replay(self):
            log.append(("replay", id(self)))

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    fake_cuda = types.SimpleNamespace(
        Stream=lambda: stream, current_stream=lambda: stream, CUDAGraph=Graph,
        stream=lambda s: contextlib.nullcontext(),
        graph=lambda g: contextlib.nullcontext(log.append(("capture", id(g)))))
    monkeypatch.setattr(tg.torch, "cuda", fake_cuda)
    answers = iter([0, 1, 0, 0, 1, 0, 0])
    monkeypatch.setattr(tg.bst, "adapt_to_replays", lambda model: next(answers))

    def step(model, opt, x, y):
        log.append(("step", int(x[0])))
        return x.sum()
    monkeypatch.setattr(tg, "train_step", step)

    graph = tg.StepGraph(model=None, opt=None, settle=3)
    batches = [torch.full((2,), float(i)) for i in range(10)]
    for x in batches:
        graph(x, x)
    kinds = [k for k, _ in log]
    assert kinds[:3] == ["step"] * 3 and [v for _, v in log[:3]] == [0, 1, 2]
    # call 4 captures (the step runs once, inside the capture) and replays; the answer
    # after call 5's replay makes call 6 capture again, as does the one after call 8's
    assert kinds[3:] == ["capture", "step", "replay", "replay", "capture", "step", "replay",
                         "replay", "replay", "capture", "step", "replay", "replay"]
    assert graph.recaptures == 2
    sx, sy, _ = graph.static
    assert torch.equal(sx, batches[-1])     # the static input holds the last call's batch
    assert log[4][1] == 3                   # captured on call 4's batch (then copied over)

    log.clear()
    monkeypatch.setattr(tg.bst, "adapt_to_replays",
                        lambda model: pytest.fail("a recompute step graph asked"))
    rec = tg.StepGraph(model=None, opt=None, settle=1, recompute=True)
    monkeypatch.setattr(tg.native, "no_conditional_nodes", contextlib.nullcontext)
    for x in batches[:3]:
        rec(x, x)
    assert [k for k, _ in log] == ["step", "capture", "step", "replay", "replay"]
    assert rec.recaptures == 0


def test_make_capturable_turns_a_loaded_adamw_state_capturable():
    """A state dict from a non-capturable AdamW, loaded into the step-graph variants'
    optimizer, says capturable=False (the saved groups win) and keeps integer-valued CPU
    step counts; ``make_capturable`` sets the flag and keeps each count as a float32 tensor
    on its parameter's device, as a capturable AdamW holds it. Only the step-graph
    variants ask for it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_gpt as tg

    model = torch.nn.Linear(4, 3)
    plain = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    plain.step()
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    opt.load_state_dict(plain.state_dict())
    assert not opt.param_groups[0]["capturable"]
    tg.make_capturable(opt)
    assert all(g["capturable"] for g in opt.param_groups)
    for p in model.parameters():
        step = opt.state[p]["step"]
        assert step.dtype == torch.float32 and step.device == p.device and float(step) == 1.0
    assert tg.StepGraph.of("dense", model, opt) is None
    assert tg.StepGraph.of("ours-stepgraph", model, opt).recompute is False
    assert tg.StepGraph.of("ours-stepgraph-recompute", model, opt).recompute is True
