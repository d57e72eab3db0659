// The condition of a captured backward's conditional graph node (kernels/torch_host_graphs.h):
// one thread sets it to 1 where the pack's status word is zero (the block is clean: the
// node's first body reads it), else to 0 (the second body recomputes) and counts that
// replay in ``recomputes``, the policy's int64 in pinned host memory (null: not counted).
// A plain add, not an atomic one: a system-scope atomic on host memory needs a host that
// takes them, and one policy's captured backwards follow each other in a step (two adds at
// once would count one). The handle type is the driver's cudaGraphConditionalHandle, an
// unsigned 64-bit integer.
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);

extern "C" __global__ void bitsparse_set_condition(unsigned long long handle,
                                                   const unsigned int* status,
                                                   volatile long long* recomputes) {
  const bool clean = *status == 0u;
  cudaGraphSetConditional(handle, clean ? 1u : 0u);
  if (!clean && recomputes != nullptr) *recomputes = *recomputes + 1;
}
