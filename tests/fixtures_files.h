/* fixtures_files.h - the file helpers the checkpoint tests share (test_ckpt,
   test_integrity): whole-file reads and writes, and removing a tree.
   POSIX (dirent, unlink, rmdir). Static inline functions only. */
#ifndef FSDP_TESTS_FIXTURES_FILES_H
#define FSDP_TESTS_FIXTURES_FILES_H

#include <dirent.h>
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

#endif
