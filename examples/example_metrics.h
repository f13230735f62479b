/* The examples' --metrics FILE (train_gpt and train_mlp): one JSON object
   per logged step, one per line, flushed as it is written, so that a run
   that crashes keeps its record and `tail -f` follows it. A new run
   truncates the file; a resumed run (--resume) appends, so one file holds
   the whole run. Only the process of rank 0 writes. Fields:
     step, loss, lr, grad_norm, tokens_per_s (train_mlp: samples_per_s),
     peak_bytes and plan_bytes (rank 0's device memory: measured peak and
     the context's plan), train_s (training time so far), and
     heldout_accuracy at the steps that measured it. A value that is not a
     finite number is written as null. tools/plot_metrics.py draws them. */
#ifndef EXAMPLE_METRICS_H
#define EXAMPLE_METRICS_H

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#if defined(__GNUC__) || defined(__clang__)
#define EXAMPLE_METRICS_UNUSED __attribute__((unused)) /* each program uses a part */
#else
#define EXAMPLE_METRICS_UNUSED
#endif

/* Opens path for a run (append: a resumed run). NULL with a message on
   stderr when it cannot. */
EXAMPLE_METRICS_UNUSED static FILE *example_metrics_open(const char *prog, const char *path, int append)
{
    FILE *f = fopen(path, append ? "a" : "w");
    if (!f) fprintf(stderr, "%s: --metrics '%s': %s\n", prog, path, strerror(errno));
    return f;
}

EXAMPLE_METRICS_UNUSED static void example_metrics_num(FILE *f, const char *key, double v)
{
    if (isfinite(v)) fprintf(f, ",\"%s\":%.9g", key, v);
    else fprintf(f, ",\"%s\":null", key);
}

/* One step's record. rate_key names rate ("tokens_per_s", "samples_per_s");
   acc < 0: held-out accuracy not measured at this step. */
EXAMPLE_METRICS_UNUSED static void example_metrics_write(FILE *f, int step, double loss, double lr, double grad_norm,
                                  const char *rate_key, double rate, size_t peak, size_t plan,
                                  double train_s, double acc)
{
    if (!f) return;
    fprintf(f, "{\"step\":%d", step);
    example_metrics_num(f, "loss", loss);
    example_metrics_num(f, "lr", lr);
    example_metrics_num(f, "grad_norm", grad_norm);
    example_metrics_num(f, rate_key, rate);
    fprintf(f, ",\"peak_bytes\":%zu,\"plan_bytes\":%zu", peak, plan);
    example_metrics_num(f, "train_s", train_s);
    if (acc >= 0.0) example_metrics_num(f, "heldout_accuracy", acc);
    fputs("}\n", f);
    fflush(f);
}

/* A record of held-out accuracy alone, for a program that measures it
   after its last step (train_mlp). */
EXAMPLE_METRICS_UNUSED static void example_metrics_accuracy(FILE *f, int step, double acc)
{
    if (!f) return;
    fprintf(f, "{\"step\":%d", step);
    example_metrics_num(f, "heldout_accuracy", acc);
    fputs("}\n", f);
    fflush(f);
}

#endif
