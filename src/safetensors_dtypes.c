/* --- >>safetensors:dtypes safetensors dtypes ----------------------------- */

FSDP__DEF const char *fsdp__st_dtype_name(fsdp_dtype dt)
{
    switch (dt) {
    case FSDP_F32: return "F32";
    case FSDP_F64: return "F64";
    case FSDP_F16: return "F16";
    case FSDP_BF16: return "BF16";
    case FSDP_U8: return "U8";
    case FSDP_I8: return "I8";
    case FSDP_I32: return "I32";
    case FSDP_I64: return "I64";
    default: return NULL;
    }
}

FSDP__DEF fsdp_dtype fsdp__st_dtype(const char *s)
{
    int d;
    for (d = 1; d < FSDP_DTYPE_COUNT; d++) {
        const char *n = fsdp__st_dtype_name((fsdp_dtype)d);
        if (n && !strcmp(n, s)) return (fsdp_dtype)d;
    }
    return FSDP_DTYPE_DEFAULT;
}

