/* ======================================================================== */
/* >>safetensors                                                             */
/* ======================================================================== */

/* Plain safetensors files. save: writes sd's tensors (a piece of a larger
   tensor as a 1-D tensor of its numel) with checksums, atomically. load:
   reads a whole file into a FULL dict in host memory, validating the header
   (length, JSON, dtypes, shapes, offsets: inside the data, no overlap, no
   gap) and the checksums when present. Errors name the file.

   Checksums (CRC-32, in __metadata__): "fsdp.crc32.<name>" covers a
   tensor's bytes; "fsdp.layout_crc32" (since 0.6.0) covers the header
   itself: every tensor's name, dtype, shape and offsets and every metadata
   entry (the tensors' checksums, the save's identity and step). A file
   fsdp.h wrote is refused when its layout checksum does not match or a
   tensor's checksum is missing (one was removed). Files of earlier
   versions (fsdp.* metadata, no layout checksum) load as legacy; foreign
   files (Python's: no checksums) load unverified. fsdp_state_dict_verified
   says which.

   Hostile files: the header is at most FSDP_SAFETENSORS_MAX_HEADER bytes
   and FSDP_JSON_MAX_VALUES JSON values. A save refuses a header above
   FSDP_SAFETENSORS_MAX_WRITE_HEADER, the official reader's limit (100 MB,
   which is less than 100 MiB): no other reader would open the file. The
   reader keeps 100 MiB, so files earlier versions wrote still load.
   Parsing takes O(n log n) time in its size n (hashed lookups, sorts; no
   scan per key) and at most 24 bytes of memory per header byte (the text
   1, decoded strings 1, JSON nodes 16, counted before any is allocated,
   the tensors' records and lookup tables the rest) plus a few KiB,
   whatever the header holds; the data is read only after the whole header
   was checked. A sharded checkpoint's index.json has the same bounds. */
#define FSDP_SAFETENSORS_MAX_HEADER ((int64_t)100 << 20)
#define FSDP_SAFETENSORS_MAX_WRITE_HEADER ((int64_t)100000000)
#define FSDP_JSON_MAX_VALUES (1 << 24)

/* What a load verified (fsdp_state_dict_verified, fsdp_ckpt_verify). */
enum {
    FSDP_VERIFIED_DATA = 1u << 0,   /* every tensor's bytes matched its checksum */
    FSDP_VERIFIED_LAYOUT = 1u << 1, /* the header (and index) matched theirs */
    FSDP_VERIFIED_LEGACY = 1u << 2  /* written by fsdp.h before 0.6.0: data
                                       checksums, the layout unverified */
};

FSDP_API fsdp_result fsdp_safetensors_save(const char *path, const fsdp_state_dict *sd,
                                           fsdp_error *err);
FSDP_API fsdp_result fsdp_safetensors_load(const char *path, const fsdp_hooks *hooks,
                                           fsdp_state_dict **out, fsdp_error *err);
/* FSDP_VERIFIED_* of a dict fsdp_safetensors_load returned: LAYOUT|DATA for
   a file fsdp.h wrote, LEGACY|DATA for one of an earlier version, 0 for a
   foreign file (not verified) and for dicts built in memory. */
FSDP_API unsigned fsdp_state_dict_verified(const fsdp_state_dict *sd);

/* >>safetensors end (declarations) */

