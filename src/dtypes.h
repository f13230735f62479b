/* ======================================================================== */
/* >>dtypes                                                                  */
/* ======================================================================== */

typedef enum fsdp_dtype {
    FSDP_DTYPE_DEFAULT = 0, /* f32 where a dtype is optional */
    FSDP_F32 = 1,
    FSDP_F64 = 2,
    FSDP_F16 = 3,
    FSDP_BF16 = 4,
    FSDP_U8 = 5,
    FSDP_I8 = 6,
    FSDP_I32 = 7,
    FSDP_I64 = 8,
    FSDP_DTYPE_COUNT = 9
} fsdp_dtype;

/* Bytes per element; 0 for an unknown dtype. */
FSDP_API size_t fsdp_dtype_size(fsdp_dtype dt);
/* "f32", "bf16", ...; "invalid" for an unknown dtype. */
FSDP_API const char *fsdp_dtype_name(fsdp_dtype dt);
/* 1 for f32, f64, f16, bf16. */
FSDP_API int fsdp_dtype_is_float(fsdp_dtype dt);

/* Conversions round to nearest even; NaN stays NaN (f32 -> 16 bits makes it
   quiet and keeps the sign), Inf stays Inf, overflow goes to Inf, f16
   subnormals are exact. 16 bits -> f32 is exact. */
FSDP_API uint16_t fsdp_f32_to_bf16(float f);
FSDP_API float fsdp_bf16_to_f32(uint16_t h);
FSDP_API uint16_t fsdp_f32_to_f16(float f);
FSDP_API float fsdp_f16_to_f32(uint16_t h);

/* Host conversion of n elements between float dtypes (the same dtype copies).
   Returns FSDP_INVALID_DTYPE for byte types of different kinds. dst and src
   must not overlap unless they are equal and the dtypes have one size
   (FSDP_INVALID_ARGS otherwise; the same dtype may overlap: a memmove on
   the host, but see fsdp_device_copy for devices). */
FSDP_API fsdp_result fsdp_convert(void *dst, fsdp_dtype dst_dt, const void *src,
                                  fsdp_dtype src_dt, size_t n);

