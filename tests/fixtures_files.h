/* fixtures_files.h - the file helpers the checkpoint tests share (test_ckpt,
   test_integrity, test_hostile): whole-file reads and writes, finding,
   patching and damaging a file, copying and removing a tree.
   POSIX (dirent, unlink, rmdir). Static inline functions only. */
#ifndef FSDP_TESTS_FIXTURES_FILES_H
#define FSDP_TESTS_FIXTURES_FILES_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The whole file, NUL-terminated in *out (free it); its length, or -1. */
static inline long read_file(const char *path, char **out)
{
    FILE *f = fopen(path, "rb");
    long n;
    *out = NULL;
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = (char *)malloc((size_t)n + 1);
    if (fread(*out, 1, (size_t)n, f) != (size_t)n) n = -1;
    else (*out)[n] = 0;
    fclose(f);
    return n;
}

static inline int write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f) return 0;
    ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

static inline void rm_rf(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *de;
    char sub[1400];
    if (!d) {
        unlink(path);
        return;
    }
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        snprintf(sub, sizeof sub, "%.1100s/%.255s", path, de->d_name);
        rm_rf(sub);
    }
    closedir(d);
    rmdir(path);
}

static inline int write_text(const char *path, const char *text)
{
    return write_file(path, text, strlen(text));
}

/* A safetensors file from a header and a data section, as given: nothing
   is checked, so that a test can write what the library must refuse. */
static inline int write_safetensors_raw(const char *path, const char *header, const void *data,
                                        size_t n)
{
    unsigned char len8[8];
    size_t h = strlen(header), k;
    FILE *f = fopen(path, "wb");
    int ok;
    if (!f) return 0;
    for (k = 0; k < 8; k++) len8[k] = (unsigned char)((uint64_t)h >> (8 * k));
    ok = fwrite(len8, 1, 8, f) == 8 && fwrite(header, 1, h, f) == h &&
         (!n || fwrite(data, 1, n, f) == n);
    return fclose(f) == 0 && ok;
}

/* The path (dir/name) of the first entry of dir whose name contains sub,
   in out; 0 where there is none or it does not fit. */
static inline int find_path(const char *dir, const char *sub, char *out, size_t n)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    int found = 0;
    while (!found && d && (de = readdir(d)) != NULL)
        if (strstr(de->d_name, sub)) {
            found = (size_t)snprintf(out, n, "%.1000s/%.255s", dir, de->d_name) < n;
        }
    if (d) closedir(d);
    return found;
}

/* Replaces the first occurrence of a by b (the same length) in a file,
   binary or not. 0 where a is not there. */
static inline int patch_first(const char *path, const char *a, const char *b)
{
    char *buf = NULL;
    long n = read_file(path, &buf), i;
    size_t m = strlen(a);
    int ok = 0;
    if (n > 0 && m == strlen(b))
        for (i = 0; i + (long)m <= n; i++) /* binary files: no strstr */
            if (!memcmp(buf + i, a, m)) {
                memcpy(buf + i, b, m);
                ok = write_file(path, buf, (size_t)n);
                break;
            }
    free(buf);
    return ok;
}

/* Flips bits of a file's last byte (in a checkpoint: data, so the checksum
   fails). */
static inline int corrupt_last_byte(const char *path)
{
    FILE *f = fopen(path, "r+b");
    long n;
    int c, ok;
    if (!f) return 0;
    ok = fseek(f, -1, SEEK_END) == 0 && (n = ftell(f)) > 0 && (c = fgetc(f)) != EOF &&
         fseek(f, n, SEEK_SET) == 0 && fputc(c ^ 0x5a, f) != EOF;
    return fclose(f) == 0 && ok;
}

/* to, removed first, as a copy of the tree from */
static inline int copy_tree(const char *from, const char *to)
{
    char cmd[3400];
    snprintf(cmd, sizeof cmd, "rm -rf '%.1000s' && cp -r '%.1000s' '%.1000s'", to, from, to);
    return system(cmd) == 0;
}

#endif
