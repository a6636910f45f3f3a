// Row gather: out[n, c] = table[ids[n], c]. One thread per output element (grid-stride); a copy in the
// table's own dtype, so exact. ids are checked against the table's rows on the host (Indices::new).

template <typename T>
__device__ void embedding(const T* table, const unsigned* ids, T* out, i64 n, i64 d) {
    FOR_EACH(i, n * d) {
        i64 row = i / d, c = i - row * d;
        out[i] = table[(i64)ids[row] * d + c];
    }
}

#define EMBEDDING(TN, T) \
    extern "C" __global__ void embedding_##TN(const T* table, const unsigned* ids, T* out, i64 n, i64 d) { \
        embedding(table, ids, out, n, d); \
    }
EMBEDDING(f32, float)
EMBEDDING(bf16, bf16)
