/* gptlab's CPU kernels, one translation unit: every job's file below, compiled once per variant
 * (gptlab/kernel_build.py: -DGL_VARIANT=... with that variant's target flags, -O3 -fopenmp) into
 * its own shared library; gptlab/kernels.py loads the best one this CPU can run, through ctypes.
 *
 *   simd.h         the vector primitives, one header per instruction set (simd_avx512.h,
 *                  simd_avx2.h, simd_neon.h, simd_portable.h) and what is written once above them
 *   common.h       bf16 conversions, scratch memory, the model description, shared prototypes
 *   cpu.c          gl_abi, gl_variant, gl_cpu_features (cpuid, HWCAP), scratch, huge pages,
 *                  gl_release_threads
 *   linear.c       gl_linear_f32, gl_linear_bf16: fp32 and bf16 weights
 *   quantized.c    gl_linear_i8 with 8-bit activations, and the activation quantizing both
 *                  quantized layers share; gl_quantize_rows_u8, gl_dequantize_i8
 *   quantized_i4.c gl_linear_i4: decoding's kernel and a prompt's; gl_dequantize_i4
 *   attention.c    gl_attend_one (a decoding step's attention over the KV cache), gl_attend_prompt
 *                  (a prompt's causal attention, on gemm.c's products), gl_argmax_f32
 *   decode_step.c  gl_decode_step: a whole model's forward of a few new tokens over its KV cache;
 *                  gl_gelu_tanh, its GELU, for the PyTorch forward's prompts, and
 *                  gl_gelu_tanh_backward, for training's
 *   loss.c         gl_softmax_xent: softmax cross-entropy, with what its gradient needs (training) or without (scoring)
 *   sampling.c     gl_top_p_keep: the top-p nucleus without sorting the vocabulary; gl_draw
 *   gemm.c         the blocked matrix product (Goto's loop nest) that the kinds below share, for
 *                  the training head's three products, long prompts and a prompt's attention
 *   gemm_f32.c     gl_sgemm: fp32 tiles and packing; gl_sgemm_bf16_b, gl_sgemm_bf16_ab: fp32
 *                  products of bf16-stored weights (and activations), widened as they are packed
 *   gemm_bf16.c    gl_gemm_bf16: products of bf16 pairs with vdpbf16ps (AVX512-BF16);
 *                  gl_sgemm_colmax: with the maxima of C's columns (the head's logits)
 *   gemm_nt.c      gl_sgemm_nt: a prompt's fp32 or bf16 layer with the weights read in place, never
 *                  packed
 *
 * Shapes are checked on the Python side.
 */
#include "cpu.c"
#include "linear.c"
#include "quantized.c"
#include "quantized_i4.c"
#include "gemm.c"
#include "gemm_f32.c"
#include "gemm_bf16.c"
#include "gemm_nt.c"
#include "attention.c"
#include "decode_step.c"
#include "loss.c"
#include "sampling.c"
