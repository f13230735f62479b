/*
   Revision history, one line per version (every change: CHANGELOG.md)
       next   launchers and a TCP rendezvous, stalls named, Hugging Face directories, GPU fixes
       0.6.0  torch 2.x optimizer bits, unset parameters refused, layout tables, LoRA units
       0.5.0  MPI and Gloo backends, the CUDA device and NCCL, CPU offload
       0.4.0  state dicts and safetensors checkpoints
       0.3.0  the ZeRO optimizer
       0.2.0  the runtime (all strategies, mixed precision, prefetch, planned memory), optimizers
       0.1.0  core: errors, dtypes, CPU device, local backend, model, flat parameters, wrapping
*/

/*
   ------------------------------------------------------------------------------
   MIT License

   Copyright (c) 2026 the fsdp.h authors

   Permission is hereby granted, free of charge, to any person obtaining a copy
   of this software and associated documentation files (the "Software"), to deal
   in the Software without restriction, including without limitation the rights
   to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
   copies of the Software, and to permit persons to whom the Software is
   furnished to do so, subject to the following conditions:

   The above copyright notice and this permission notice shall be included in all
   copies or substantial portions of the Software.

   THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
   IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
   FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
   AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
   LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
   OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
   SOFTWARE.
   ------------------------------------------------------------------------------
*/
