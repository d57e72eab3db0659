"""Data-parallel (DDP) and fully sharded (FSDP2 ``fully_shard``) training on CPU with
packed activations: 2 processes, gloo, world size 2 (issue 21, CPU part).

Each case compares, on every rank, the packed FFN modules (ReLU, ReLU², ReGLU) or
``compress_saved_tensors`` around a dense model's forward against the same wrapper
around the dense model: losses, gradients and parameters bit-identical over a few
AdamW steps. The ranks run in ``tests/dist_worker.py``; all cases share one spawn
(starting two processes that import torch is most of the time), each rank writes
pass/fail per case to a result file, and each test below asserts that both ranks
passed its case.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")

import dist_worker  # noqa: E402

WORLD = 2
TIMEOUT_S = 240  # the whole spawn; a collective that hangs times out after 30 s itself


def _why_not_distributed():
    import torch.distributed as dist
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"cannot bind a TCP socket on 127.0.0.1 ({e})"
    return None


def _why_not_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"FSDP2 (torch.distributed.fsdp.fully_shard) is not in torch " \
               f"{torch.__version__}: {e}"
    return None


def _why_not_fsdp2_mixed():
    why = _why_not_fsdp2()
    if why:
        return why
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: F401
    except ImportError as e:
        return f"no FSDP2 MixedPrecisionPolicy in torch {torch.__version__}: {e}"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runnable():
    """The cases to spawn: those whose features this torch has."""
    names = list(dist_worker.DDP_CASES)
    if not _why_not_fsdp2():
        names += dist_worker.FSDP_CASES
    if not _why_not_fsdp2_mixed():
        names += dist_worker.FSDP_MP_CASES
    return names


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    """Spawn the 2 ranks once for every case; returns [results of rank 0, of rank 1] and
    what went wrong with the spawn (None if nothing)."""
    why = _why_not_distributed()
    if why:
        pytest.skip(why)
    import torch.multiprocessing as mp
    outdir = str(tmp_path_factory.mktemp("dist"))
    names = _runnable()
    start = time.monotonic()
    ctx = mp.start_processes(dist_worker.worker,
                             args=(WORLD, _free_port(), names, outdir),
                             nprocs=WORLD, join=False, start_method="spawn")
    problem = None
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() - start > TIMEOUT_S:
                problem = f"the ranks did not finish within {TIMEOUT_S} s"
                break
    except Exception as e:  # a rank died outside the per-case handling
        problem = f"a rank failed: {e}"
    finally:
        for p in ctx.processes:  # only the two processes started here
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for r in range(WORLD):
        path = os.path.join(outdir, f"rank{r}.json")
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append({})
    return results, problem


def _check(rank_results, name):
    results, problem = rank_results
    for r, res in enumerate(results):
        if name not in res:
            pytest.fail(f"rank {r} reported nothing for {name}"
                        + (f" ({problem})" if problem else ""))
        assert res[name]["ok"], f"rank {r}, {name}:\n{res[name].get('error')}"


@pytest.mark.parametrize("name", dist_worker.DDP_CASES)
def test_ddp_is_bit_identical(rank_results, name):
    _check(rank_results, name)


@pytest.mark.parametrize("name", dist_worker.FSDP_CASES + dist_worker.FSDP_MP_CASES)
def test_fsdp2_is_bit_identical(rank_results, name):
    """reshard_after_forward on and off; bf16 MixedPrecisionPolicy (fp32 reduce)."""
    why = _why_not_fsdp2_mixed() if name in dist_worker.FSDP_MP_CASES else _why_not_fsdp2()
    if why:
        pytest.skip(why)
    _check(rank_results, name)
