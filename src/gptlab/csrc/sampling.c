/* Sampling in C: gl_top_p_keep, the nucleus without sorting the vocabulary, and gl_draw, the
 * draw from a row's probabilities. Sorting GPT-2's 50,257 probabilities took NumPy 2.2 ms a row
 * (torch.sort 3.5, torch.topk of the 4,096 most likely 0.7; AMD EPYC Zen 4), more than an int4
 * model's whole decoding step, whenever the 512 most likely tokens hold less than p (a flat
 * distribution). */
#include <float.h>

#include "common.h"

/* Buckets of probabilities by their float bits >> 19 (exponent and 4 mantissa bits: 1.0 is bucket
 * 2032): a higher bucket holds only larger values, so the nucleus's edge lies in one bucket, and
 * only that bucket's tokens are sorted. */
#define TOP_P_BUCKETS 2048

typedef struct {
    float p;
    int i;
} gl_ranked;

static int top_p_bucket(float p) {
    uint32_t bits;
    memcpy(&bits, &p, 4);
    const uint32_t b = bits >> 19;
    return b < TOP_P_BUCKETS ? (int)b : TOP_P_BUCKETS - 1; /* (probabilities are <= 1) */
}

/* Most likely first; equal probabilities in vocabulary order. */
static int by_rank(const void *a, const void *b) {
    const gl_ranked *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* keep[i] = whether token i is in the nucleus of probs (V): ranked most likely first, a token is
 * kept while the probability of those ranked before it is short of p (so the first always is).
 * spare: room for V ranked tokens. */
static void top_p_row(const float *probs, int V, double p, uint8_t *keep, gl_ranked *spare) {
    double mass[TOP_P_BUCKETS] = {0};
    for (int i = 0; i < V; i++) mass[top_p_bucket(probs[i])] += probs[i];
    double above = 0.0; /* the probability of the buckets above the edge's */
    int edge = TOP_P_BUCKETS - 1;
    while (edge >= 0 && above + mass[edge] < p) above += mass[edge--];
    if (edge < 0) { /* the whole vocabulary holds less than p (rounding): keep every token */
        memset(keep, 1, (size_t)V);
        return;
    }
    int n = 0;
    for (int i = 0; i < V; i++) {
        const int b = top_p_bucket(probs[i]);
        keep[i] = b > edge;
        if (b == edge) spare[n++] = (gl_ranked){probs[i], i};
    }
    qsort(spare, (size_t)n, sizeof(gl_ranked), by_rank);
    for (int j = 0; j < n; j++) {
        keep[spare[j].i] = above < p;
        above += spare[j].p;
    }
}

/* keep (M, V) bytes: top_p_row of each row of probs (M, V), non-negative, each row summing to ~1.
 * Returns 0, or -1 out of memory. */
int gl_top_p_keep(const float *probs, uint8_t *keep, int M, int V, double p) {
    gl_ranked *spare = malloc(sizeof(gl_ranked) * (size_t)V);
    if (!spare) return -1;
    for (int m = 0; m < M; m++) top_p_row(probs + (size_t)m * V, V, p, keep + (size_t)m * V, spare);
    free(spare);
    return 0;
}

/* out[m] = the id at which row m of probs (M, V) reaches u[m] of its sum: with the cumulative sums
 * in float64, in vocabulary order, the first id whose sum exceeds u[m] * the row's sum (at most
 * V - 1). The same arithmetic as gptlab.sampling.draw's PyTorch path (cumsum, searchsorted), so the
 * same id for the same u; in one call, where those took about ten operations, each cold after a
 * decoding step. Returns 0, or -3 when a row's sum is not finite and positive (out then means
 * nothing). */
int gl_draw(const float *probs, const double *u, int64_t *out, int M, int V) {
    for (int m = 0; m < M; m++) {
        const float *p = probs + (size_t)m * V;
        double total = 0.0;
        for (int i = 0; i < V; i++) total += p[i];
        if (!(total > 0.0) || total > DBL_MAX) return -3;
        const double at = u[m] * total;
        double sum = 0.0;
        int id = V - 1;
        for (int i = 0; i < V; i++) {
            sum += p[i];
            if (sum > at) {
                id = i;
                break;
            }
        }
        out[m] = id;
    }
    return 0;
}
