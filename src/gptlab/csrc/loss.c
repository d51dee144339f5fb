/* The softmax cross-entropy over a chunk of logits: training's, with its gradient
 * (gptlab.chunked_loss), and scoring's, without (gptlab.chunked_loss.token_logprobs). */
#include <omp.h>

#include "common.h"

/* The first min(n, VW) values of p, the rest `fill`. */
static inline vf load_or(const float *p, int n, float fill) { return n >= VW ? vf_load(p) : vf_load_part(p, n, fill); }

/* For n rows of logits stored transposed, z (V, n) with rows ldz >= n apart (column r holds row
 * r's logits: the layout W x^T gives, whose matrix products run faster here than x W^T, see
 * gptlab.chunked_loss; ldz > n keeps a 4 KB row stride off the caches' sets there):
 * loss[r] = logsumexp - z[t] (0 for a row whose target is -100, ignored) and, with grad, in place
 * z = exp(z - peak) and inv[r] = 1 / sum (0 for an ignored row), so that the gradient of each
 * row's cross-entropy with respect to its logits, softmax - onehot(t), is inv z - onehot(t): the
 * caller folds inv and the one-hot into the small products that follow (gptlab.chunked_loss), so
 * the logits are read twice and written once (max; exp and sum) where PyTorch's ops take five
 * passes. Each thread streams its own range of the V rows, vectorized across the n columns,
 * keeping its own maxima and sums per column, merged in thread order (so a result depends only
 * on nthreads). With grad 0 (scoring) z is only read. peak, when not NULL, gets each row's largest
 * logit (its target is the greedy token where z[t] equals it). peak_in, when not NULL, gives those
 * maxima (gl_sgemm_colmax found them as it wrote z) and the first pass is skipped: z is read once.
 * Returns 0, -1 out of memory, or -3 when a target is outside [0, V) and not -100 (nothing
 * written then). */
int gl_softmax_xent(float *z, long ldz, const int64_t *t, float *loss, float *peak_out, float *inv, int n, int V,
                    int grad, const float *peak_in, int nthreads) {
    for (int r = 0; r < n; r++)
        if ((t[r] < 0 || t[r] >= V) && t[r] != -100) return -3;
    const int np = (n + VW - 1) / VW * VW; /* columns padded to whole vectors */
    /* each thread's max, sum and the sum's compensation */
    float *part = malloc(sizeof(float) * (size_t)np * (3 * (size_t)nthreads + 3));
    if (!part) return -1;
    float *peak = part + (size_t)3 * nthreads * np, *total = peak + np, *target = total + np;
    for (int r = 0; r < n; r++) target[r] = t[r] == -100 ? 0.0f : z[(size_t)t[r] * ldz + r];
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const size_t v0 = (size_t)V * id / nt, v1 = (size_t)V * (id + 1) / nt;
        float *pmax = part + (size_t)id * np, *psum = part + (size_t)(nthreads + id) * np;
        float *pcomp = part + (size_t)(2 * nthreads + id) * np;
        for (int r = 0; r < np; r += VW) {
            vf_store(pmax + r, vf_set1(-INFINITY));
            vf_store(psum + r, vf_zero());
            vf_store(pcomp + r, vf_zero());
        }
        for (size_t v = v0; v < v1 && !peak_in; v++)
            for (int r = 0; r < n; r += VW)
                vf_store(pmax + r, vf_max(vf_load(pmax + r), load_or(z + v * ldz + r, n - r, -INFINITY)));
#pragma omp barrier
#pragma omp single
        for (int r = 0; r < np; r++) {
            float m = -INFINITY;
            for (int i = 0; i < nt; i++) m = fmaxf(m, part[(size_t)i * np + r]);
            peak[r] = r >= n ? 0.0f : peak_in ? peak_in[r] : m; /* padding lanes: exp(0 - 0), summed and never read */
        }
        for (size_t v = v0; v < v1; v++)
            for (int r = 0; r < n; r += VW) {
                vf e = vf_exp(vf_sub(load_or(z + v * ldz + r, n - r, 0.0f), vf_load(peak + r)));
                if (grad) vf_store_n(z + v * ldz + r, e, n - r);
                /* Kahan: a trained model's tens of thousands of tiny tail terms would otherwise
                 * fall below the sum's last bit (measured: log-probabilities ~5e-5 too high) */
                vf sum = vf_load(psum + r), y = vf_sub(e, vf_load(pcomp + r)), next = vf_add(sum, y);
                vf_store(pcomp + r, vf_sub(vf_sub(next, sum), y));
                vf_store(psum + r, next);
            }
#pragma omp barrier
#pragma omp single
        for (int r = 0; r < n; r++) {
            double sum = 0.0;
            for (int i = 0; i < nt; i++) sum += (double)part[(size_t)(nthreads + i) * np + r] - part[(size_t)(2 * nthreads + i) * np + r];
            total[r] = (float)sum;
            if (grad) inv[r] = t[r] != -100 ? 1.0f / sum : 0.0f; /* an ignored row's gradient is 0 */
        }
    }
    for (int r = 0; r < n; r++) {
        loss[r] = t[r] == -100 ? 0.0f : logf(total[r]) + peak[r] - target[r];
        if (peak_out) peak_out[r] = peak[r];
    }
    free(part);
    return 0;
}
