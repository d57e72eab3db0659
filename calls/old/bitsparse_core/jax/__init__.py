"""JAX adapter: format v1 in jax.numpy and custom_vjp FFN ops with packed residuals.

Needs ``jax`` (``pip install 'jax>=0.4.30'``, or ``pip install '.[jax]'`` from a
checkout); importing this subpackage without it raises an ImportError saying so.
``import bitsparse_core`` alone never imports it. See docs/jax.md.
"""

try:
    import jax as _jax  # noqa: F401
except ImportError as exc:  # exercised by a test that hides jax
    raise ImportError("bitsparse_core.jax needs JAX: pip install 'jax>=0.4.30' ('jax[cuda12]' "
                      "for NVIDIA GPUs; from a checkout, pip install '.[jax]'); the rest of "
                      "bitsparse_core works without it") from exc

from .codec import (JaxPacked, capacity_for, from_packed_tensor, mask_of, masked_pack, pack,
                    relu_bits, relu_pack_planes, unpack, unpack_masked)
from .ffn import (PACKED_NAME, PackConfig, apply_stack, dense_block, gated_ffn, init_stack,
                  packed_block, relu2_ffn, relu_ffn)

__all__ = ["JaxPacked", "capacity_for", "from_packed_tensor", "mask_of", "masked_pack", "pack",
           "relu_bits", "relu_pack_planes", "unpack", "unpack_masked", "PACKED_NAME", "PackConfig",
           "apply_stack", "dense_block", "gated_ffn", "init_stack", "packed_block", "relu2_ffn",
           "relu_ffn"]
