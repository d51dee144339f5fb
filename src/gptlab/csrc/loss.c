/* Training's softmax cross-entropy and its gradient over rows of logits (gptlab.chunked_loss). */
#include "common.h"

/* For each of n rows of logits z (n, V), in place: z = softmax(z) - onehot(t) (the gradient of the
 * row's cross-entropy with respect to its logits) and loss[r] = logsumexp(z) - z[t]; a row whose
 * target is -100 (ignored) gets zeros and loss 0. Three passes over each row (max; exp and sum;
 * scale) where PyTorch's ops take five. Returns 0, or -3 when a target is outside [0, V) and not -100. */
int gl_softmax_xent(float *z, const int64_t *t, float *loss, int n, int V, int nthreads) {
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : bad)
    for (int r = 0; r < n; r++) {
        float *row = z + (size_t)r * V;
        if (t[r] < 0 || t[r] >= V) { /* -100: an ignored position (IGNORE_INDEX); else an error */
            bad |= t[r] != -100;
            memset(row, 0, sizeof(float) * V);
            loss[r] = 0.0f;
            continue;
        }
        const float target = row[t[r]];
        const int full = V - V % VW;
        vf vmax = vf_set1(-INFINITY);
        for (int i = 0; i < full; i += VW) vmax = vf_max(vmax, vf_load(row + i));
        if (full < V) vmax = vf_max(vmax, vf_load_part(row + full, V - full, -INFINITY));
        const float peak = vf_hmax(vmax);
        const vf vpeak = vf_set1(peak);
        vf vsum = vf_zero();
        for (int i = 0; i < V; i += VW) { /* the tail's missing lanes load as peak - 104: e^-104 = 0 in fp32 */
            vf e = vf_exp(vf_sub(V - i >= VW ? vf_load(row + i) : vf_load_part(row + i, V - i, peak - 104.0f), vpeak));
            vf_store_n(row + i, e, V - i);
            vsum = vf_add(vsum, e);
        }
        const float total = vf_sum(vsum);
        const vf inv = vf_set1(1.0f / total);
        for (int i = 0; i < V; i += VW) vf_store_n(row + i, vf_mul(vf_load_n(row + i, V - i), inv), V - i);
        row[t[r]] -= 1.0f;
        loss[r] = logf(total) + peak - target;
    }
    return bad ? -3 : 0;
}
