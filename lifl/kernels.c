/* lifl's memory-bound kernels: streaming finite checks, fused FedAvg folds, finalisation.
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

/* Index of the first non-finite element among n elements at p, or -1. Blocked so the common
 * all-finite case is a branch-free, vectorisable OR-reduction over the exponent bits. */
static int64_t first_nonfinite(const uint8_t *p, uint64_t n, int32_t dt) {
    const uint64_t B = 1024;
    for (uint64_t b = 0; b < n; b += B) {
        uint64_t len = n - b < B ? n - b : B;
        int bad = 0;
        if (dt == F32) {
            for (uint64_t i = 0; i < len; i++) {
                uint32_t x; memcpy(&x, p + (b + i) * 4, 4);
                bad |= (x & 0x7f800000u) == 0x7f800000u;
            }
        } else if (dt == F64) {
            for (uint64_t i = 0; i < len; i++) {
                uint64_t x; memcpy(&x, p + (b + i) * 8, 8);
                bad |= (x & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
            }
        } else if (dt == F16) {
            for (uint64_t i = 0; i < len; i++) {
                uint16_t x; memcpy(&x, p + (b + i) * 2, 2);
                bad |= (x & 0x7c00u) == 0x7c00u;
            }
        } else if (dt == BF16) {
            for (uint64_t i = 0; i < len; i++) {
                uint16_t x; memcpy(&x, p + (b + i) * 2, 2);
                bad |= (x & 0x7f80u) == 0x7f80u;
            }
        } else {
            return -1;
        }
        if (bad) {
            for (uint64_t i = 0; i < len; i++) {
                const uint8_t *q = p + (b + i) * itemsize(dt);
                double v;
                if (dt == F32) { float f; memcpy(&f, q, 4); v = f; }
                else if (dt == F64) memcpy(&v, q, 8);
                else { uint16_t h; memcpy(&h, q, 2); v = dt == F16 ? f16_to_f64(h) : bf16_to_f64(h); }
                if (!isfinite(v)) return (int64_t)(b + i);
            }
        }
    }
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
        if (dt != F16 && dt != BF16 && dt != F32 && dt != F64) { cursor = hi; continue; }
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

#define BLK 1024

/* Store a block of accumulators; fresh accumulators bypass the cache (nothing will read them
 * before the next input arrives, and it saves the read-for-ownership of the destination). */
static inline void store_block(double *dst, const double *src, uint64_t len, int stream) {
#if defined(__SSE2__)
    if (stream && ((uintptr_t)dst & 15) == 0) {
        uint64_t i = 0;
        for (; i + 2 <= len; i += 2) _mm_stream_pd(dst + i, _mm_load_pd(src + i));
        for (; i < len; i++) dst[i] = src[i];
        return;
    }
#endif
    (void)stream;
    memcpy(dst, src, len * sizeof(double));
}

static int add_float_block(double *restrict acc, const uint8_t *restrict x, int32_t dt, double w, uint64_t len) {
    switch (dt) {
    case F32:
        for (uint64_t i = 0; i < len; i++) { float v; memcpy(&v, x + 4 * i, 4); acc[i] += w * (double)v; }
        return 0;
    case F64:
        if (w == 1.0) {
            for (uint64_t i = 0; i < len; i++) { double v; memcpy(&v, x + 8 * i, 8); acc[i] += v; }
        } else {
            for (uint64_t i = 0; i < len; i++) { double v; memcpy(&v, x + 8 * i, 8); acc[i] += w * v; }
        }
        return 0;
    case F16:
        for (uint64_t i = 0; i < len; i++) { uint16_t h; memcpy(&h, x + 2 * i, 2); acc[i] += w * f16_to_f64(h); }
        return 0;
    case BF16:
        for (uint64_t i = 0; i < len; i++) { uint16_t h; memcpy(&h, x + 2 * i, 2); acc[i] += w * bf16_to_f64(h); }
        return 0;
    default:
        return -1;
    }
}

static int fold_float(double *acc, uint64_t n, int32_t ninputs, int32_t stride, const int32_t *dt,
                      const void *const *in, const int64_t *weight, int init) {
    double tmp[BLK] __attribute__((aligned(64)));
    for (uint64_t b = 0; b < n; b += BLK) {
        uint64_t len = n - b < BLK ? n - b : BLK;
        if (init) memset(tmp, 0, len * sizeof(double));
        else memcpy(tmp, acc + b, len * sizeof(double));
        for (int32_t j = 0; j < ninputs; j++) {
            int32_t d = dt[(int64_t)j * stride];
            const uint8_t *x = (const uint8_t *)in[(int64_t)j * stride] + b * itemsize(d);
            if (add_float_block(tmp, x, d, (double)weight[j], len)) return -1;
        }
        store_block(acc + b, tmp, len, init);
    }
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

/* For every tensor t: acc[t] = (init ? 0 : acc[t]) + sum_j weight[j] * in[j][t], in one pass
 * over memory. Accumulators are F64 for float tensors and I128 for integer ones; inputs are
 * either client updates (their own dtype, weight = sample count) or partial sums (accumulator
 * dtype, weight 1). in/in_dtype are [ninputs][ntensors]. Returns 0, or -1 on a bad dtype. */
int lifl_fold(int32_t ntensors, const uint64_t *numel, const int32_t *acc_dtype, void *const *acc,
              int32_t ninputs, const int32_t *in_dtype, const void *const *in, const int64_t *weight,
              int32_t init) {
    for (int32_t t = 0; t < ntensors; t++) {
        int rc;
        if (acc_dtype[t] == F64)
            rc = fold_float((double *)acc[t], numel[t], ninputs, ntensors, in_dtype + t, in + t, weight, init);
        else if (acc_dtype[t] == I128)
            rc = fold_int((__int128 *)acc[t], numel[t], ninputs, ntensors, in_dtype + t, in + t, weight, init);
        else
            rc = -1;
        if (rc) return rc;
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

/* out[t] = acc[t] / total in the model's dtype, one rounding per element. */
int lifl_finalize(int32_t ntensors, const uint64_t *numel, const int32_t *out_dtype, void *const *out,
                  const void *const *acc, int64_t total) {
    if (total <= 0) return -1;
    double inv = 1.0 / (double)total;
    for (int32_t t = 0; t < ntensors; t++) {
        uint64_t n = numel[t];
        uint8_t *o = (uint8_t *)out[t];
        int32_t d = out_dtype[t];
        if (d == I32 || d == I64) {
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
        const double *a = (const double *)acc[t];
        switch (d) {
        case F64:
            for (uint64_t i = 0; i < n; i++) { double v = a[i] * inv; memcpy(o + 8 * i, &v, 8); }
            break;
        case F32:
            for (uint64_t i = 0; i < n; i++) { float v = (float)(a[i] * inv); memcpy(o + 4 * i, &v, 4); }
            break;
        case F16:
            for (uint64_t i = 0; i < n; i++) { uint16_t v = f64_to_f16(a[i] * inv); memcpy(o + 2 * i, &v, 2); }
            break;
        case BF16:
            for (uint64_t i = 0; i < n; i++) { uint16_t v = f64_to_bf16(a[i] * inv); memcpy(o + 2 * i, &v, 2); }
            break;
        default:
            return -1;
        }
    }
    return 0;
}
