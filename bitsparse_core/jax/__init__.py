"""JAX adapter: format v1 in jax.numpy and custom_vjp FFN ops with packed residuals.

Needs ``jax`` (``pip install bitsparse_core[jax]``); ``import bitsparse_core``
alone never imports it. See docs/jax.md.
"""

from .codec import (JaxPacked, capacity_for, from_packed_tensor, mask_of, masked_pack, pack,
                    relu_bits, relu_pack_planes, unpack, unpack_masked)
from .ffn import (PackConfig, apply_stack, dense_block, gated_ffn, init_stack, packed_block,
                  relu2_ffn, relu_ffn)

__all__ = ["JaxPacked", "capacity_for", "from_packed_tensor", "mask_of", "masked_pack", "pack",
           "relu_bits", "relu_pack_planes", "unpack", "unpack_masked", "PackConfig",
           "apply_stack", "dense_block", "gated_ffn", "init_stack", "packed_block", "relu2_ffn",
           "relu_ffn"]
