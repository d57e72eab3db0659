"""Run by tests/test_jax.py in a subprocess with two fake CPU devices (the XLA flag must
be set before JAX starts): the FFN stack under jit with its input sharded along the
tokens, dense against packed with ``PackConfig(shards=2)``. Prints one JSON line: the
collectives each compiled gradient holds and whether the gradients are bit-identical."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from bitsparse_core.jax import ffn  # noqa: E402

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def collectives(compiled_text: str) -> dict:
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", compiled_text)) for op in COLLECTIVES}


def main(kind: str, impl: str = "jnp") -> None:
    mesh = Mesh(jax.devices()[:2], ("data",))
    layers = ffn.init_stack(jax.random.PRNGKey(0), 2, 64, 192, kind=kind)
    x = jax.random.normal(jax.random.PRNGKey(1), (40, 64), jnp.float32).astype(jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    layers = jax.device_put(layers, NamedSharding(mesh, P()))
    cfg = ffn.PackConfig(density=0.4, chunk_log2=9, shards=2, impl=impl)

    def loss(layers, x, mode):
        out = ffn.apply_stack(layers, x, kind=kind, mode=mode, cfg=cfg)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    result = {}
    grads = {}
    for mode in ("dense", "packed"):
        fn = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        result[mode] = collectives(fn.lower(layers, x, mode).compile().as_text())
        grads[mode] = fn(layers, x, mode)
    leaves = [jax.tree_util.tree_leaves(grads[m]) for m in ("dense", "packed")]
    result["bit_identical"] = all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        for a, b in zip(*leaves))
    result["x_sharding"] = str(grads["packed"][1].sharding.spec)
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
