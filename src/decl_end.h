#ifdef __cplusplus
}
#endif
#endif /* FSDP_H_INCLUDED */

