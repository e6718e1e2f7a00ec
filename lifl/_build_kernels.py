"""cffi build script for lifl/kernels.c (run by setup.py at install time)."""

from pathlib import Path

from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef(
    """
    int64_t lifl_check_finite_range(const uint8_t *base, int32_t ntensors, const int64_t *begin,
                                    const int64_t *end, const int32_t *dtype, int64_t from_, int64_t to,
                                    int32_t *bad_tensor, int64_t *bad_elem);
    int lifl_fold(int32_t ntensors, const uint64_t *numel, const int32_t *acc_dtype, void *const *acc,
                  int32_t ninputs, const int32_t *in_dtype, const void *const *in_, const int64_t *weight,
                  int32_t init, int32_t frac_bits, double *max_abs);
    int lifl_finalize(int32_t ntensors, const uint64_t *numel, const int32_t *out_dtype, void *const *out,
                      const int32_t *acc_dtype, const void *const *acc, int64_t total, int32_t frac_bits);
    """
)
ffibuilder.set_source(
    "lifl._kernels",
    (Path(__file__).with_name("kernels.c")).read_text(),
    extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno"],
    libraries=["m"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
