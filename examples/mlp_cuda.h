/* train_mlp's GPU engine: the MLP's forward and backward on one CUDA
   device, cuBLAS for the matrix products and small kernels for the rest.

   examples/mlp_cuda.cu implements it for the GPU. examples/mlp_cuda_emu.c
   implements the very same engine on the host (the same matrix-product
   arguments through a reference column-major sgemm, the same kernel bodies
   as loops), so that train_mlp's GPU path is checked on a machine without
   one; examples/mlp_cuda_impl.h holds what the two share.

   Plain C declarations: train_mlp.c includes this without any CUDA header.

   The engine owns its activations (up to nb_max rows of each). Parameters
   and gradients are the caller's (fsdp_param / fsdp_grad views: device or
   managed memory), passed to each call; gradients are accumulated (+=), as
   the views expect. Every call is enqueued on the stream given at creation
   and returns 0, or -1 with the reason in mlp_cuda_error. Only
   mlp_cuda_head (which copies the logits to the host) and mlp_cuda_sync
   wait for the GPU. Host arrays (inputs, logits, their gradient) are
   ordinary host memory. One thread per engine; several engines may share a
   GPU. */
#ifndef MLP_CUDA_H
#define MLP_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlp_cuda mlp_cuda;

typedef struct mlp_cuda_desc {
    int device;      /* CUDA ordinal */
    void *stream;    /* a cudaStream_t (fsdp_cuda_stream_handle); NULL: the legacy stream */
    int nb_max;      /* rows per call, at most */
    int in, hid, out; /* in -> Linear(hid) -> GELU -> Linear(hid) -> LayerNorm -> GELU -> Linear(out) */
} mlp_cuda_desc;

/* NULL on failure, with the reason in msg. */
mlp_cuda *mlp_cuda_create(const mlp_cuda_desc *desc, char *msg, size_t nmsg);
/* Waits for the engine's work, then frees it. */
void mlp_cuda_destroy(mlp_cuda *e);
const char *mlp_cuda_error(const mlp_cuda *e);

/* The forward pass, in this order, over nb rows. x, logits: host. */
int mlp_cuda_fc1(mlp_cuda *e, const float *x, const float *w, const float *b, int nb);
int mlp_cuda_fc2(mlp_cuda *e, const float *w, const float *b, int nb);
int mlp_cuda_norm(mlp_cuda *e, const float *gain, const float *beta, int nb);
/* Waits: the logits (nb x out) are on the host when it returns. */
int mlp_cuda_head(mlp_cuda *e, const float *w, const float *b, float *logits, int nb);

/* The backward pass after a forward over the same nb rows. dlogits: host. */
int mlp_cuda_head_backward(mlp_cuda *e, const float *dlogits, const float *w, float *gw,
                           float *gb, int nb);
int mlp_cuda_norm_backward(mlp_cuda *e, const float *gain, float *ggain, float *gbeta, int nb);
int mlp_cuda_fc2_backward(mlp_cuda *e, const float *w, float *gw, float *gb, int nb);
int mlp_cuda_fc1_backward(mlp_cuda *e, float *gw, float *gb, int nb);

/* Waits for everything enqueued so far; -1 if any of it failed. */
int mlp_cuda_sync(mlp_cuda *e);

#ifdef __cplusplus
}
#endif
#endif
