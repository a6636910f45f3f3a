// Counter-based normal samples, the kernel twin of kernels/src/rng.rs (keep the two in step):
// SplitMix64 of (SplitMix64(seed) ^ i), its 32-bit halves as uniforms u1 in (0, 1] and u2 in [0, 1),
// Box-Muller in f64, rounded to f32, then v * std + mean in f32 without contraction into an FMA (the
// CPU does a multiply, then an add). One thread per element, grid-stride.

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

template <typename T>
__device__ void random_normal(T* out, i64 n, unsigned long long seed, float mean, float std_dev) {
    const unsigned long long mixed = splitmix64(seed);
    FOR_EACH(i, n) {
        unsigned long long bits = splitmix64(mixed ^ (unsigned long long)i);
        double u1 = ((double)(bits >> 32) + 1.0) / 4294967296.0;
        double u2 = (double)(bits & 0xFFFFFFFFull) / 4294967296.0;
        double radius = sqrt(-2.0 * log(u1));
        float v = (float)(radius * cos(2.0 * 3.141592653589793 * u2));
        st(out + i, __fadd_rn(__fmul_rn(v, std_dev), mean));
    }
}

extern "C" __global__ void random_normal_f32(float* out, i64 n, unsigned long long seed, float mean,
                                             float std_dev) {
    random_normal(out, n, seed, mean, std_dev);
}
extern "C" __global__ void random_normal_bf16(bf16* out, i64 n, unsigned long long seed, float mean,
                                              float std_dev) {
    random_normal(out, n, seed, mean, std_dev);
}
