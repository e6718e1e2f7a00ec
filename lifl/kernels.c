/* lifl's memory-bound kernels: streaming finite checks, fused FedAvg folds (float, or fixed
 * point: quantised into integers), finalisation.
 *
 * dtype codes match lifl/format.py: F16=1 BF16=2 F32=3 F64=4 I32=5 I64=6 I128=7.
 * Inputs may be unaligned (tensor offsets inside a blob are arbitrary), so all loads go
 * through memcpy, which compilers turn into plain unaligned loads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { F16 = 1, BF16 = 2, F32 = 3, F64 = 4, I32 = 5, I64 = 6, I128 = 7 };

static int itemsize(int32_t dt) {
    switch (dt) {
    case F16: case BF16: return 2;
    case F32: case I32: return 4;
    case F64: case I64: return 8;
    case I128: return 16;
    default: return 0;
    }
}

static inline double f16_to_f64(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15), exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    double v;
    if (exp == 0) v = ldexp((double)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexp((double)(man | 0x400), (int)exp - 25);
    return sign ? -v : v;
}

static inline double bf16_to_f64(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return (double)f;
}

/* ---------- finite checks ---------- */

/* Whether any lane of the bytes [p, p + nbytes) (a multiple of 64) has (lane & mask) == value:
 * 16-bit lanes for F16/BF16, 32-bit lanes otherwise (F64 compares only the dwords holding its
 * exponent). Hand-vectorised: it runs on bytes just received, hot in L2, at ~50 GB/s here,
 * twice what the compiler made of the scalar loop. */
#if defined(__SSE2__)
static int any_lane_matches(const uint8_t *p, uint64_t nbytes, __m128i mask, __m128i value, int lanes16) {
    __m128i hit = _mm_setzero_si128();
    for (uint64_t i = 0; i < nbytes; i += 64) {
        __m128i a = _mm_and_si128(_mm_loadu_si128((const __m128i *)(p + i)), mask);
        __m128i b = _mm_and_si128(_mm_loadu_si128((const __m128i *)(p + i + 16)), mask);
        __m128i c = _mm_and_si128(_mm_loadu_si128((const __m128i *)(p + i + 32)), mask);
        __m128i d = _mm_and_si128(_mm_loadu_si128((const __m128i *)(p + i + 48)), mask);
        if (lanes16)
            hit = _mm_or_si128(hit, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi16(a, value), _mm_cmpeq_epi16(b, value)),
                                                 _mm_or_si128(_mm_cmpeq_epi16(c, value), _mm_cmpeq_epi16(d, value))));
        else
            hit = _mm_or_si128(hit, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi32(a, value), _mm_cmpeq_epi32(b, value)),
                                                 _mm_or_si128(_mm_cmpeq_epi32(c, value), _mm_cmpeq_epi32(d, value))));
    }
    return _mm_movemask_epi8(hit) != 0;
}
#endif

static int is_nonfinite(const uint8_t *q, int32_t dt) {
    if (dt == F32) { uint32_t x; memcpy(&x, q, 4); return (x & 0x7f800000u) == 0x7f800000u; }
    if (dt == F64) { uint64_t x; memcpy(&x, q, 8); return (x & 0x7ff0000000000000ull) == 0x7ff0000000000000ull; }
    uint16_t h; memcpy(&h, q, 2);
    return dt == F16 ? (h & 0x7c00u) == 0x7c00u : (h & 0x7f80u) == 0x7f80u;
}

/* Index of the first non-finite element among n elements at p, or -1. */
static int64_t first_nonfinite(const uint8_t *p, uint64_t n, int32_t dt) {
    int size = itemsize(dt);
    uint64_t start = 0;
#if defined(__SSE2__)
    uint64_t bulk = (n * size) & ~(uint64_t)63;
    __m128i mask, value;
    switch (dt) {
    case F32: mask = value = _mm_set1_epi32(0x7f800000); break;
    case F64: mask = _mm_set_epi32(0x7ff00000, 0, 0x7ff00000, 0); value = _mm_set_epi32(0x7ff00000, 1, 0x7ff00000, 1); break;
    case F16: mask = value = _mm_set1_epi16(0x7c00); break;
    default: mask = value = _mm_set1_epi16(0x7f80); break;
    }
    if (!any_lane_matches(p, bulk, mask, value, size == 2)) start = bulk / size; /* only the tail is left */
#endif
    for (uint64_t i = start; i < n; i++)
        if (is_nonfinite(p + i * size, dt)) return (int64_t)i;
    return -1;
}

/* Check the float elements that lie wholly inside [from, to) of a blob at base. The tensor
 * table (begin/end absolute offsets, in data order) covers the whole data section. Returns the
 * offset up to which the blob is checked (always an element boundary of a float tensor, so the
 * next call can resume there), or -1 with *bad_tensor/*bad_elem set on a NaN or Inf. */
int64_t lifl_check_finite_range(const uint8_t *base, int32_t ntensors, const int64_t *begin,
                                const int64_t *end, const int32_t *dtype, int64_t from, int64_t to,
                                int32_t *bad_tensor, int64_t *bad_elem) {
    int64_t cursor = from;
    for (int32_t t = 0; t < ntensors; t++) {
        if (end[t] <= cursor) continue;
        if (begin[t] >= to) break;
        int64_t hi = end[t] < to ? end[t] : to;
        int32_t dt = dtype[t];
        if (dt != F16 && dt != BF16 && dt != F32 && dt != F64) { cursor = hi; continue; } /* integers are always finite */
        int64_t sz = itemsize(dt);
        int64_t lo = cursor > begin[t] ? cursor : begin[t];
        int64_t lim = begin[t] + ((hi - begin[t]) / sz) * sz;
        if (lim > lo) {
            int64_t i = first_nonfinite(base + lo, (uint64_t)((lim - lo) / sz), dt);
            if (i >= 0) {
                *bad_tensor = t;
                *bad_elem = (lo - begin[t]) / sz + i;
                return -1;
            }
        }
        cursor = lim > lo ? lim : lo;
        if (lim < hi) return cursor; /* an element straddles `to`: resume from its start */
    }
    return cursor > to ? cursor : to;
}

/* ---------- folds ---------- */

/* dst[i] (op) w * x[i] over a float tensor stored as dtype dt; op is = or +=. */
#define FLOAT_BLOCK(NAME, OP)                                                                             \
    static int NAME(double *restrict dst, const uint8_t *restrict x, int32_t dt, double w, uint64_t len) { \
        switch (dt) {                                                                                     \
        case F32:                                                                                         \
            for (uint64_t i = 0; i < len; i++) { float v; memcpy(&v, x + 4 * i, 4); dst[i] OP w * (double)v; } \
            return 0;                                                                                     \
        case F64:                                                                                         \
            for (uint64_t i = 0; i < len; i++) { double v; memcpy(&v, x + 8 * i, 8); dst[i] OP w * v; }   \
            return 0;                                                                                     \
        case F16:                                                                                         \
            for (uint64_t i = 0; i < len; i++) { uint16_t h; memcpy(&h, x + 2 * i, 2); dst[i] OP w * f16_to_f64(h); } \
            return 0;                                                                                     \
        case BF16:                                                                                        \
            for (uint64_t i = 0; i < len; i++) { uint16_t h; memcpy(&h, x + 2 * i, 2); dst[i] OP w * bf16_to_f64(h); } \
            return 0;                                                                                     \
        default:                                                                                          \
            return -1;                                                                                    \
        }                                                                                                 \
    }
FLOAT_BLOCK(put_float_block, =)
FLOAT_BLOCK(add_float_block, +=)

/* Two inputs of the same dtype in one pass: o = (o +) wa*a + wb*b (into fold_blocked's scratch). */
#define PAIR_LOOPS(NAME, T)                                                                              \
    static void NAME##_put(double *restrict o, const uint8_t *restrict a, const uint8_t *restrict b,     \
                           double wa, double wb, uint64_t n) {                                           \
        for (uint64_t i = 0; i < n; i++) {                                                               \
            T x, y; memcpy(&x, a + sizeof(T) * i, sizeof(T)); memcpy(&y, b + sizeof(T) * i, sizeof(T));   \
            o[i] = wa * (double)x + wb * (double)y;                                                      \
        }                                                                                                \
    }                                                                                                    \
    static void NAME##_add(double *restrict o, const uint8_t *restrict a, const uint8_t *restrict b,     \
                           double wa, double wb, uint64_t n) {                                           \
        for (uint64_t i = 0; i < n; i++) {                                                               \
            T x, y; memcpy(&x, a + sizeof(T) * i, sizeof(T)); memcpy(&y, b + sizeof(T) * i, sizeof(T));   \
            o[i] += wa * (double)x + wb * (double)y;                                                     \
        }                                                                                                \
    }

PAIR_LOOPS(pair_f32, float)
PAIR_LOOPS(pair_f64, double)

static int fold_float(double *acc, uint64_t n, int32_t ninputs, int32_t stride, const int32_t *dt,
                      const void *const *in, const int64_t *weight, int init) {
    int fresh = init;
    for (int32_t j = 0; j < ninputs;) {
        int32_t da = dt[(int64_t)j * stride];
        const uint8_t *xa = (const uint8_t *)in[(int64_t)j * stride];
        double wa = (double)weight[j];
        if (j + 1 < ninputs && da == dt[(int64_t)(j + 1) * stride] && (da == F32 || da == F64)) {
            const uint8_t *xb = (const uint8_t *)in[(int64_t)(j + 1) * stride];
            double wb = (double)weight[j + 1];
            if (da == F32) (fresh ? pair_f32_put : pair_f32_add)(acc, xa, xb, wa, wb, n);
            else (fresh ? pair_f64_put : pair_f64_add)(acc, xa, xb, wa, wb, n);
            j += 2;
        } else {
            if ((fresh ? put_float_block : add_float_block)(acc, xa, da, wa, n)) return -1;
            j += 1;
        }
        fresh = 0;
    }
    return 0;
}

/* Float folds go a block at a time: each block of the accumulator is loaded once into a
 * float64 scratch that stays in L1, every input folded into it (fold_float), and stored once
 * (a fresh one with non-temporal stores). A pass per input (or pair) over the whole
 * accumulator streamed it from memory each time: with bf16 inputs and float64 sums, 18 bytes
 * of traffic per 2-byte element, and 8 inputs folded no faster than 1 (1.5 GB/s of update
 * bytes; 3.4 GB/s blocked, memcpy 6 GB/s: lifl.kernels.fold of 8 tensors of 2^25 elements). Float32
 * accumulators (a job's "accumulator": "float32", for bf16/fp16 updates where float64 is
 * waste) are summed in float64 in the scratch and rounded once per fold. */
#define ACC_BLOCK 2048
#define ACC_INPUTS 64

/* A fresh block of sums stored with non-temporal stores where aligned: its lines were never
 * read, so they need not be read in to be written (lines just read, in cache, would be slower). */
static inline void stream_f64(double *restrict dst, const double *restrict src, uint64_t len) {
    uint64_t i = 0;
#if defined(__SSE2__)
    if (((uintptr_t)dst & 15) == 0)
        for (; i + 2 <= len; i += 2) _mm_stream_pd(dst + i, _mm_loadu_pd(src + i));
#endif
    for (; i < len; i++) dst[i] = src[i];
}
static int fold_blocked(void *acc, int32_t acc_dtype, uint64_t n, int32_t ninputs, int32_t stride, const int32_t *dt,
                        const void *const *in, const int64_t *weight, int init) {
    double block[ACC_BLOCK];
    const void *at[ACC_INPUTS];
    int32_t dts[ACC_INPUTS];
    double *acc64 = (double *)acc;
    float *acc32 = (float *)acc;
    for (int32_t first = 0; first < ninputs; first += ACC_INPUTS) {  /* inputs in groups of a bounded scratch */
        int32_t count = ninputs - first < ACC_INPUTS ? ninputs - first : ACC_INPUTS;
        int fresh = init && first == 0;
        for (uint64_t off = 0; off < n; off += ACC_BLOCK) {
            uint64_t len = n - off < ACC_BLOCK ? n - off : ACC_BLOCK;
            for (int32_t j = 0; j < count; j++) {
                int64_t k = (int64_t)(first + j) * stride;
                dts[j] = dt[k];
                at[j] = (const uint8_t *)in[k] + off * (uint64_t)itemsize(dt[k]);
            }
            if (!fresh) {
                if (acc_dtype == F64) memcpy(block, acc64 + off, len * sizeof(double));
                else for (uint64_t i = 0; i < len; i++) block[i] = (double)acc32[off + i];
            }
            if (fold_float(block, len, count, 1, dts, at, weight + first, fresh)) return -1;
            if (acc_dtype == F64 && fresh) stream_f64(acc64 + off, block, len);
            else if (acc_dtype == F64) memcpy(acc64 + off, block, len * sizeof(double));
            else for (uint64_t i = 0; i < len; i++) acc32[off + i] = (float)block[i];
        }
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return 0;
}

static int fold_int(__int128 *acc, uint64_t n, int32_t ninputs, int32_t stride, const int32_t *dt,
                    const void *const *in, const int64_t *weight, int init) {
    for (uint64_t i = 0; i < n; i++) {
        __int128 s = 0;
        if (!init) memcpy(&s, acc + i, 16);
        for (int32_t j = 0; j < ninputs; j++) {
            int32_t d = dt[(int64_t)j * stride];
            const uint8_t *x = (const uint8_t *)in[(int64_t)j * stride];
            __int128 v;
            if (d == I32) { int32_t a; memcpy(&a, x + 4 * i, 4); v = a; }
            else if (d == I64) { int64_t a; memcpy(&a, x + 8 * i, 8); v = a; }
            else if (d == I128) memcpy(&v, x + 16 * i, 16);
            else return -1;
            s += v * (__int128)weight[j];
        }
        memcpy(acc + i, &s, 16);
    }
    return 0;
}

/* Fixed point (lifl/fixedpoint.py): a float input adds w * round(x * 2^frac_bits) to an integer
 * accumulator of its width, a partial sum (the accumulator's own dtype) adds itself. Sums wrap
 * modulo 2^width on purpose (unsigned arithmetic, as secure aggregation sums): the caller's
 * overflow bound guarantees that the true sums fit. The quantising pass also finds the largest
 * |x| of every input (max_abs[j]), from which the caller derives that bound.
 *
 * Rounding adds 1.5 * 2^52: for |s| <= 2^51 the sum lands where doubles are the integers, so
 * the FPU rounds s half to even, and the integer is the difference of the bit patterns. Unlike
 * llrint (one scalar cvtsd2si), this vectorises: the pass ran 3x faster. Larger |s| give wrong
 * integers, never undefined behaviour; the caller refuses any input whose max|q| reaches 2^51. */
#define ROUNDING_MAGIC 6755399441055744.0 /* 1.5 * 2^52 */
static inline uint64_t quantise(double v, double scale) {
    double t = v * scale + ROUNDING_MAGIC;
    uint64_t bits, magic_bits;
    double magic = ROUNDING_MAGIC;
    memcpy(&bits, &t, 8);
    memcpy(&magic_bits, &magic, 8);
    return bits - magic_bits;
}
static inline double f32_bits_to_f64(uint32_t b) { float v; memcpy(&v, &b, 4); return (double)v; }
static inline double f64_bits_to_f64(uint64_t b) { double v; memcpy(&v, &b, 8); return v; }

/* The loops read each float as its bits (BT) and track the largest magnitude as the largest bit
 * pattern with the sign cleared (monotonic for finite floats): integer maxima vectorise where
 * a double maximum keeps the loop scalar. */
#define QUANTISE(UT, BT, SIGN, DECODE)                                                                   \
    {                                                                                                    \
        BT mb = 0;                                                                                       \
        for (uint64_t i = 0; i < n; i++) {                                                               \
            BT b; memcpy(&b, x + sizeof(BT) * i, sizeof(BT));                                            \
            BT a = (BT)(b & (BT)~(SIGN));                                                                \
            mb = a > mb ? a : mb;                                                                        \
            UT q = (UT)(quantise(DECODE(b), scale) * w);                                                 \
            acc[i] = fresh ? q : (UT)(acc[i] + q);                                                       \
        }                                                                                                \
        m = DECODE(mb);                                                                                  \
    }

/* Two float inputs of the same dtype in one pass, as the float path pairs them: half the
 * accumulator traffic of two passes (this pass is memory-bound). */
#define QUANTISE_PAIR(UT, BT, SIGN, DECODE)                                                              \
    {                                                                                                    \
        BT mb = 0, mby = 0;                                                                              \
        for (uint64_t i = 0; i < n; i++) {                                                               \
            BT b, c; memcpy(&b, x + sizeof(BT) * i, sizeof(BT)); memcpy(&c, y + sizeof(BT) * i, sizeof(BT)); \
            BT a = (BT)(b & (BT)~(SIGN)), ay = (BT)(c & (BT)~(SIGN));                                    \
            mb = a > mb ? a : mb;                                                                        \
            mby = ay > mby ? ay : mby;                                                                   \
            UT q = (UT)(quantise(DECODE(b), scale) * w + quantise(DECODE(c), scale) * wy);               \
            acc[i] = fresh ? q : (UT)(acc[i] + q);                                                       \
        }                                                                                                \
        m = DECODE(mb);                                                                                  \
        my = DECODE(mby);                                                                                \
    }
#define F32_ARGS uint32_t, 0x80000000u, f32_bits_to_f64
#define F64_ARGS uint64_t, 0x8000000000000000ull, f64_bits_to_f64
#define F16_ARGS uint16_t, 0x8000u, f16_to_f64
#define BF16_ARGS uint16_t, 0x8000u, bf16_to_f64
#define EXPAND(MACRO, ...) MACRO(__VA_ARGS__)

/* max_abs[j] rises to input j's largest |x| in this run (m, my: what this run found). */
#define FIXED_FOLD(NAME, UT, ACC_DT)                                                                     \
    static int NAME(UT *restrict acc, uint64_t n, int32_t ninputs, int32_t stride, const int32_t *dt,    \
                    const void *const *in, const int64_t *weight, int init, double scale, double *max_abs) { \
        for (int32_t j = 0; j < ninputs;) {                                                              \
            int32_t first = j, d = dt[(int64_t)j * stride];                                                       \
            const uint8_t *restrict x = (const uint8_t *)in[(int64_t)j * stride];                        \
            uint64_t w = (uint64_t)weight[j];                                                            \
            int fresh = init && j == 0;                                                                  \
            double m = 0.0;                                                                              \
            if (j + 1 < ninputs && d == dt[(int64_t)(j + 1) * stride] && (d == F32 || d == F64)) {       \
                const uint8_t *restrict y = (const uint8_t *)in[(int64_t)(j + 1) * stride];              \
                uint64_t wy = (uint64_t)weight[j + 1];                                                   \
                double my = 0.0;                                                                         \
                if (d == F32) EXPAND(QUANTISE_PAIR, UT, F32_ARGS)                                        \
                else EXPAND(QUANTISE_PAIR, UT, F64_ARGS)                                                 \
                if (my > max_abs[j + 1]) max_abs[j + 1] = my;                                            \
                j += 2;                                                                                  \
            } else {                                                                                     \
                switch (d) {                                                                             \
                case ACC_DT:                                                                             \
                    for (uint64_t i = 0; i < n; i++) {                                                   \
                        UT v; memcpy(&v, x + sizeof(UT) * i, sizeof(UT));                                \
                        v = (UT)(v * w);                                                                 \
                        acc[i] = fresh ? v : (UT)(acc[i] + v);                                           \
                    }                                                                                    \
                    break;                                                                               \
                case F32: EXPAND(QUANTISE, UT, F32_ARGS) break;                                          \
                case F64: EXPAND(QUANTISE, UT, F64_ARGS) break;                                          \
                case F16: EXPAND(QUANTISE, UT, F16_ARGS) break;                                          \
                case BF16: EXPAND(QUANTISE, UT, BF16_ARGS) break;                                        \
                default: return -1;                                                                      \
                }                                                                                        \
                j += 1;                                                                                  \
            }                                                                                            \
            if (m > max_abs[first]) max_abs[first] = m;                                                  \
        }                                                                                                \
        return 0;                                                                                        \
    }
FIXED_FOLD(fold_fixed64, uint64_t, I64)
FIXED_FOLD(fold_fixed32, uint32_t, I32)

/* For every tensor t: acc[t] = (init ? 0 : acc[t]) + sum_j weight[j] * in[j][t], in one pass
 * over memory. Accumulators are F64 for float tensors (or I64/I32 under fixed point, which
 * quantises with frac_bits and raises max_abs[j] to input j's largest |float|) and I128 for
 * integer ones; inputs are either client updates (their own dtype, weight = sample count) or
 * partial sums (accumulator dtype, weight 1). in/in_dtype are [ninputs][ntensors]. Returns 0,
 * or -1 on a bad dtype. */
int lifl_fold(int32_t ntensors, const uint64_t *numel, const int32_t *acc_dtype, void *const *acc,
              int32_t ninputs, const int32_t *in_dtype, const void *const *in, const int64_t *weight,
              int32_t init, int32_t frac_bits, double *max_abs) {
    double scale = ldexp(1.0, frac_bits);
    for (int32_t t = 0; t < ntensors;) {
        /* Coalesce the following tensors that lie right after this one in every operand, with
         * the same dtypes: blobs usually list tensors in the same order, so a whole data
         * section folds as one long run instead of restarting the memory streams per tensor. */
        uint64_t n = numel[t];
        int32_t end = t + 1;
        while (end < ntensors && acc_dtype[end] == acc_dtype[t] &&
               (uint8_t *)acc[end] == (uint8_t *)acc[t] + n * itemsize(acc_dtype[t])) {
            int contiguous = 1;
            for (int32_t j = 0; j < ninputs && contiguous; j++) {
                int64_t a = (int64_t)j * ntensors;
                contiguous = in_dtype[a + end] == in_dtype[a + t] &&
                             (const uint8_t *)in[a + end] == (const uint8_t *)in[a + t] + n * itemsize(in_dtype[a + t]);
            }
            if (!contiguous) break;
            n += numel[end++];
        }
        int rc;
        if (acc_dtype[t] == F64 || acc_dtype[t] == F32)
            rc = fold_blocked(acc[t], acc_dtype[t], n, ninputs, ntensors, in_dtype + t, in + t, weight, init);
        else if (acc_dtype[t] == I128)
            rc = fold_int((__int128 *)acc[t], n, ninputs, ntensors, in_dtype + t, in + t, weight, init);
        else if (acc_dtype[t] == I64)
            rc = fold_fixed64((uint64_t *)acc[t], n, ninputs, ntensors, in_dtype + t, in + t, weight, init, scale, max_abs);
        else if (acc_dtype[t] == I32)
            rc = fold_fixed32((uint32_t *)acc[t], n, ninputs, ntensors, in_dtype + t, in + t, weight, init, scale, max_abs);
        else
            rc = -1;
        if (rc) return rc;
        t = end;
    }
    return 0;
}

/* ---------- finalisation ---------- */

/* Round x to a binary float with `bits` significant bits and minimum normal exponent `emin`
 * (round half to even), returning the exactly representable result as a double. This gives a
 * single rounding from the float64 average straight to F16/BF16, never via float32. */
static inline double round_to(double x, int bits, int emin) {
    if (x == 0.0 || !isfinite(x)) return x;
    int e;
    frexp(x, &e); /* x = m * 2^e, 0.5 <= |m| < 1 */
    int exp = e - 1 < emin ? emin : e - 1;
    double q = ldexp(1.0, exp - (bits - 1));
    return nearbyint(x / q) * q;
}

static inline uint16_t f64_to_f16(double x) {
    double r = round_to(x, 11, -14);
    uint16_t sign = signbit(r) ? 0x8000 : 0;
    double a = fabs(r);
    if (isnan(a)) return 0x7e00;
    if (a >= 65536.0) return sign | 0x7c00; /* rounded beyond the largest finite half */
    if (a < 6.103515625e-05) return sign | (uint16_t)(a * 16777216.0); /* subnormal: units of 2^-24 */
    int e;
    double m = frexp(a, &e); /* a = m * 2^e */
    uint16_t man = (uint16_t)((m * 2.0 - 1.0) * 1024.0);
    return sign | (uint16_t)((e - 1 + 15) << 10) | man;
}

static inline uint16_t f64_to_bf16(double x) {
    if (isnan(x)) return 0x7fc0;
    float f = (float)round_to(x, 8, -126); /* exact: already has bf16 precision (or overflows to inf) */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)(bits >> 16);
}

/* s / total rounded to nearest, ties to even; total > 0 */
static inline __int128 div_round_even(__int128 s, __int128 total) {
    __int128 q = s / total, r = s % total;
    if (r < 0) { q -= 1; r += total; }
    if (2 * r > total || (2 * r == total && (q & 1))) q += 1;
    return q;
}

/* Float outputs of one tensor: out[i] = VALUE (a double, in terms of i) in the model's dtype. */
#define WRITE_FLOATS(VALUE)                                                                              \
    switch (d) {                                                                                         \
    case F64: for (uint64_t i = 0; i < n; i++) { double v = (VALUE); memcpy(o + 8 * i, &v, 8); } break;  \
    case F32: for (uint64_t i = 0; i < n; i++) { float v = (float)(VALUE); memcpy(o + 4 * i, &v, 4); } break; \
    case F16: for (uint64_t i = 0; i < n; i++) { uint16_t v = f64_to_f16(VALUE); memcpy(o + 2 * i, &v, 2); } break; \
    case BF16: for (uint64_t i = 0; i < n; i++) { uint16_t v = f64_to_bf16(VALUE); memcpy(o + 2 * i, &v, 2); } break; \
    default: return -1;                                                                                  \
    }

/* out[t] = acc[t] / total in the model's dtype, one rounding per element. Fixed-point sums
 * (I64/I32 accumulators of float tensors, read as two's complement) are divided once by
 * total * 2^frac_bits, exactly a power of two times total, so the quotient is correctly rounded
 * whenever the sum has at most 53 significant bits. */
int lifl_finalize(int32_t ntensors, const uint64_t *numel, const int32_t *out_dtype, void *const *out,
                  const int32_t *acc_dtype, const void *const *acc, int64_t total, int32_t frac_bits) {
    if (total <= 0) return -1;
    double inv = 1.0 / (double)total, denom = ldexp((double)total, frac_bits);
    for (int32_t t = 0; t < ntensors; t++) {
        uint64_t n = numel[t];
        uint8_t *o = (uint8_t *)out[t];
        int32_t d = out_dtype[t], ad = acc_dtype[t];
        if (d == I32 || d == I64) {
            if (ad != I128) return -1;
            const uint8_t *a = (const uint8_t *)acc[t];
            for (uint64_t i = 0; i < n; i++) {
                __int128 s;
                memcpy(&s, a + 16 * i, 16);
                __int128 q = div_round_even(s, total);
                if (d == I32) { int32_t v = (int32_t)q; memcpy(o + 4 * i, &v, 4); }
                else { int64_t v = (int64_t)q; memcpy(o + 8 * i, &v, 8); }
            }
            continue;
        }
        if (ad == F64) {
            const double *a = (const double *)acc[t];
            WRITE_FLOATS(a[i] * inv)
        } else if (ad == F32) {
            const float *a = (const float *)acc[t];
            WRITE_FLOATS((double)a[i] * inv)
        } else if (ad == I64) {
            const int64_t *a = (const int64_t *)acc[t];
            WRITE_FLOATS((double)a[i] / denom)
        } else if (ad == I32) {
            const int32_t *a = (const int32_t *)acc[t];
            WRITE_FLOATS((double)a[i] / denom)
        } else {
            return -1;
        }
    }
    return 0;
}
