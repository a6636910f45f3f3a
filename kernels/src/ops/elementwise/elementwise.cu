// Elementwise kernels: one thread per output element (grid-stride), maths in f32.
// Operand index maps come in a Layout (prelude.cuh): stride[0], [1], [2] are the operands' strides over
// the output's index space (0 on broadcast axes).

// Op codes, mirrored in elementwise/cuda.rs.
#define UNARY_AFFINE 0   // v * p0 + p1 (scale: p1 = 0)
#define UNARY_CLAMP 1    // min(max(v, p0), p1)
#define UNARY_SILU 2
#define UNARY_GELU_TANH 3
#define BINARY_ADD 0
#define BINARY_SUB 1
#define BINARY_MUL 2
#define TERNARY_MODULATE 0   // x * (1 + q) + p
#define TERNARY_GATED 1      // x + p * q

__device__ __forceinline__ float unary_f(int op, float v, float p0, float p1) {
    switch (op) {
    case UNARY_AFFINE: return v * p0 + p1;
    case UNARY_CLAMP: return fminf(fmaxf(v, p0), p1);
    case UNARY_SILU: return silu_f32(v);
    default: {
        const float k = 0.7978845608028654f;  // sqrt(2/pi)
        return 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
    }
    }
}

template <typename T>
__device__ void unary(const T* x, T* out, i64 n, int op, float p0, float p1) {
    FOR_EACH(i, n) { st(out + i, unary_f(op, ld(x + i), p0, p1)); }
}

// out (contiguous, a's dtype) = a op b over the broadcast index space.
template <typename A, typename B>
__device__ void binary(const A* a, const B* b, A* out, i64 n, const Layout& l, int op) {
    FOR_EACH(i, n) {
        i64 ia, ib, unused;
        offsets(l, i, &ia, &ib, &unused);
        float x = ld(a + ia), y = ld(b + ib);
        float r = op == BINARY_ADD ? x + y : (op == BINARY_SUB ? x - y : x * y);
        st(out + i, r);
    }
}

// binary in words of V = 16 / sizeof(A) consecutive elements of the innermost axis: a and out move
// 16 bytes at a time and the index maths (one division per axis) runs once per word, not once per
// element. a is contiguous along the innermost axis; b is too (`b_inner`, V elements of b loaded as
// one piece) or is broadcast along it (one value for the word). The host checks that the innermost
// length and every stride of a (and of b when `b_inner`) are multiples of V, and that a, out (and b
// when `b_inner`) are 16-byte aligned; the same maths per element as `binary`.
template <typename A, typename B>
__device__ void binary_words(const A* a, const B* b, A* out, i64 n, const Layout& l, int op, int b_inner) {
    constexpr int V = 16 / sizeof(A);
    FOR_EACH(w, n / V) {
        const i64 i = w * V;
        i64 ia, ib, unused;
        offsets(l, i, &ia, &ib, &unused);
        float x[V], y[V], r[V];
        load_vec<A, V>(a + ia, x);
        if (b_inner) {
            load_vec<B, V>(b + ib, y);
        } else {
            const float v = ld(b + ib);
#pragma unroll
            for (int k = 0; k < V; ++k) y[k] = v;
        }
#pragma unroll
        for (int k = 0; k < V; ++k) r[k] = op == BINARY_ADD ? x[k] + y[k] : (op == BINARY_SUB ? x[k] - y[k] : x[k] * y[k]);
        store_word<A, V>(out + i, r);
    }
}

// out (contiguous, x's dtype and shape) = f(x, p, q) with x contiguous and p, q broadcast to it
// (stride[1], stride[2] of the layout). modulate: p = shift, q = scale -> x * (1 + scale) + shift;
// gated residual: p = y, q = gate -> x + y * gate.
template <typename X, typename P, typename Q>
__device__ void ternary(const X* x, const P* p, const Q* q, X* out, i64 n, const Layout& l, int op) {
    FOR_EACH(i, n) {
        i64 ix, ip, iq;
        offsets(l, i, &ix, &ip, &iq);
        float v = ld(x + ix), a = ld(p + ip), b = ld(q + iq);
        st(out + i, op == TERNARY_MODULATE ? v * (1.0f + b) + a : v + a * b);
    }
}

#define UNARY(TN, T) \
    extern "C" __global__ void unary_##TN(const T* x, T* out, i64 n, int op, float p0, float p1) { \
        unary(x, out, n, op, p0, p1); \
    }
UNARY(f32, float)
UNARY(bf16, bf16)

#define BINARY(AN, A, BN, B) \
    extern "C" __global__ void binary_##AN##_##BN(const A* a, const B* b, A* out, i64 n, Layout l, int op) { \
        binary(a, b, out, n, l, op); \
    }
FOR_TYPES2(BINARY)

#define BINARY_WORDS(AN, A, BN, B) \
    extern "C" __global__ void binary_words_##AN##_##BN(const A* a, const B* b, A* out, i64 n, Layout l, int op, \
                                                         int b_inner) { \
        binary_words(a, b, out, n, l, op, b_inner); \
    }
FOR_TYPES2(BINARY_WORDS)

#define TERNARY(XN, X, PN, P, QN, Q) \
    extern "C" __global__ void ternary_##XN##_##PN##_##QN(const X* x, const P* p, const Q* q, X* out, i64 n, \
                                                         Layout l, int op) { \
        ternary(x, p, q, out, n, l, op); \
    }
#define TERNARY_Q(XN, X, PN, P) TERNARY(XN, X, PN, P, f32, float) TERNARY(XN, X, PN, P, bf16, bf16)
FOR_TYPES2(TERNARY_Q)
