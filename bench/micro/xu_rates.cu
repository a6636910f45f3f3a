// Issue rates of the instructions the FP8 attention's softmax runs (MUFU.EX2, F2FP to e4m3 and
// f16x2, the packed f16x2 exponential), alone and mixed, for one warp per SM sub-partition: cycles
// per warp instruction. Build and run on the GPU machine: nvcc -arch=sm_90a -O3 -o xu_rates
// xu_rates.cu && ./xu_rates (scripts/gpu-xu-rates.sh). A measurement aid, not part of the product.
#include <cstdio>
#include <cuda_fp16.h>

constexpr int ITERS = 4096, CH = 16;

template <int OP>
__global__ void bench(float* sink, long long* cycles) {
    float x[CH];
    unsigned u[CH];
    for (int j = 0; j < CH; ++j) { x[j] = 0.001f * (threadIdx.x + j); u[j] = 0x3c003c00u + j; }
    unsigned acc = 0;
    __syncwarp();
    const long long t0 = clock64();
    for (int i = 0; i < ITERS; ++i) {
#pragma unroll
        for (int j = 0; j < CH; ++j) {
            if (OP == 0) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x[j]));
            if (OP == 1) { unsigned short r; asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x[j]), "f"(x[(j + 1) % CH])); acc ^= r; }
            if (OP == 2) asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(u[j]));
            if (OP == 3) { unsigned r; asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x[j]), "f"(x[(j + 1) % CH])); acc ^= r; }
            if (OP == 4) { unsigned short r; asm volatile("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(u[j])); acc ^= r; }
            if (OP == 5) {  // 2 ex2 + 1 e4m3 conversion: the softmax's mix
                asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x[j]));
                if (j % 2) { unsigned short r; asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x[j - 1]), "f"(x[j])); acc ^= r; }
            }
            if (OP == 6) asm volatile("fma.rn.f32 %0, %0, 1.0001, 0.5;" : "+f"(x[j]));
        }
    }
    const long long t1 = clock64();
    float s = acc;
    for (int j = 0; j < CH; ++j) s += x[j] + __uint_as_float(u[j]);
    sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x % 32 == 0) cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = t1 - t0;
}

template <int OP>
void run(const char* name, int warps_per_smsp, float per_iter) {
    const int blocks = 132, threads = 128 * warps_per_smsp;
    float* sink; long long* cyc;
    cudaMalloc(&sink, blocks * threads * 4);
    cudaMalloc(&cyc, blocks * threads / 32 * 8);
    bench<OP><<<blocks, threads>>>(sink, cyc);
    bench<OP><<<blocks, threads>>>(sink, cyc);
    cudaDeviceSynchronize();
    long long host[132 * 32];
    cudaMemcpy(host, cyc, blocks * threads / 32 * 8, cudaMemcpyDeviceToHost);
    double mean = 0;
    for (int i = 0; i < blocks * threads / 32; ++i) mean += host[i];
    mean /= blocks * threads / 32;
    // cycles per warp instruction per sub-partition = elapsed / (instructions of all its warps)
    printf("%-34s warps/SMSP %d: %6.2f cycles per warp instruction per SMSP\n", name, warps_per_smsp,
           mean / (ITERS * CH * per_iter * warps_per_smsp));
    cudaFree(sink); cudaFree(cyc);
}

int main() {
    for (int w : {1, 2, 4}) {
        run<0>("ex2.approx.ftz.f32 (MUFU)", w, 1.0f);
        run<1>("cvt e4m3x2.f32 (F2FP)", w, 1.0f);
        run<2>("ex2.approx.f16x2", w, 1.0f);
        run<3>("cvt f16x2.f32", w, 1.0f);
        run<4>("cvt e4m3x2.f16x2", w, 1.0f);
        run<5>("2 ex2 + 1 e4m3 cvt (per ex2)", w, 1.0f);
        run<6>("fma.rn.f32", w, 1.0f);
    }
    return 0;
}
