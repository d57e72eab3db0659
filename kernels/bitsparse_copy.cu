// The exact pack's shrink: the stored values (and the sign plane) copied from the
// worst-case tail into the exact-size allocation, both spans in one launch.
//
// A kernel rather than cuMemcpyAsync: the driver's device-to-device copy took ~20 us
// more than its bytes need on the H200 (bench/shrink_copy_probe.py, bench/NOTES.md),
// and the GPU waits for the shrink before the exact pack is done.
//
// Each span moves in whole 16-byte vectors when both of its addresses are 16-byte
// aligned (the tails' spans start on 64-byte boundaries), then byte by byte past the
// last whole vector, or byte by byte throughout when an address is not aligned.
// A span of 0 bytes is skipped. Grid-stride: any grid covers any size.

extern "C" __global__ void __launch_bounds__(BS_THREADS)
bitsparse_copy_spans(u64 dst0_ptr, u64 src0_ptr, u64 n0, u64 dst1_ptr, u64 src1_ptr, u64 n1) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 first = blockIdx.x * (u64)blockDim.x + threadIdx.x;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const u64 dst = s ? dst1_ptr : dst0_ptr, src = s ? src1_ptr : src0_ptr, n = s ? n1 : n0;
        const u64 nvec = ((dst | src) & 15ull) == 0ull ? n >> 4 : 0ull;
        const uint4* sv = reinterpret_cast<const uint4*>(src);
        uint4* dv = reinterpret_cast<uint4*>(dst);
        for (u64 i = first; i < nvec; i += stride) dv[i] = sv[i];
        for (u64 i = (nvec << 4) + first; i < n; i += stride)
            reinterpret_cast<u8*>(dst)[i] = reinterpret_cast<const u8*>(src)[i];
    }
}
