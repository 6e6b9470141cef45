/* A small C shim over oneDNN 2.x's matmul primitive (Debian 12: libdnnl 2.6.3), so that the
 * Rust side never has to mirror oneDNN's large memory-descriptor struct. See
 * model/src/onednn.rs for the safe wrapper, the primitive cache and why.
 *
 * One primitive computes C[m, n] = alpha * A[m, k] B[k, n] (+ bias[n]) + beta * C with any
 * (positive) element strides for A, B and C, A and B both f32 or both bf16, C and the bias f32,
 * or the same for a batch of such products (up to two leading batch dimensions: attention's
 * [batch, heads]):
 *   - alpha is oneDNN's output scale, beta a "sum" post-op (dst = alpha*AB + beta*dst).
 *   - the bias (optional, dense [n], the same for every row) is oneDNN's matmul bias, added
 *     to each output as it is written: a Linear's bias without first filling C with it and
 *     reading it back (beta = 1). oneDNN 2.x applies the output scale after the bias
 *     (alpha * (AB + bias)), so the Rust side passes a bias only with alpha = 1.
 *   - The scratchpad is in user mode: each call allocates its own, so one primitive may be run
 *     from several threads at once (oneDNN's library scratchpad is shared state otherwise).
 *   - Each call first sets this thread's OpenMP team size to 1: Keel owns the threads (it cuts
 *     large GEMMs into single-threaded pieces itself), and libgomp's nthreads ICV is per
 *     thread, so it has to be set on every thread that calls in.
 * Every function returns a dnnl_status_t (0 = success). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

struct keel_matmul {
    dnnl_primitive_t prim;
    dnnl_memory_desc_t a_md, b_md, c_md, bias_md;
    int has_bias;
    size_t scratch_bytes;
    dnnl_memory_desc_t scratch_md;
};

static dnnl_engine_t keel_engine = NULL;
static dnnl_status_t keel_engine_status = dnnl_success;
static pthread_once_t keel_engine_once = PTHREAD_ONCE_INIT;

static void keel_make_engine(void) {
    keel_engine_status = dnnl_engine_create(&keel_engine, dnnl_cpu, 0);
}

#define CHECK(x)                                                                             \
    do {                                                                                     \
        dnnl_status_t s_ = (x);                                                              \
        if (s_ != dnnl_success) {                                                            \
            status = s_;                                                                     \
            goto done;                                                                       \
        }                                                                                    \
    } while (0)

/* Creates the primitive. bf16 != 0: A and B are bf16 (uint16 bit patterns); else f32.
 * bias != 0: the runs pass a dense f32 bias of C's last dimension (n) added to every row.
 * ndims (2 to 4) dimensions each: A [..., m, k], B [..., k, n], C [..., m, n], where the
 * leading (batch) dimensions of A and B are C's or 1 (broadcast); dims and strides (in
 * elements, outermost first) as oneDNN's matmul takes them. On success *out owns it, and
 * impl (impl_len bytes, NUL-terminated) names the implementation oneDNN chose. */
int keel_dnnl_matmul_create(int bf16, int ndims, const int64_t *a_dims, const int64_t *a_str,
                            const int64_t *b_dims, const int64_t *b_str, const int64_t *c_dims,
                            const int64_t *c_str, float alpha, float beta, int bias,
                            struct keel_matmul **out, char *impl, size_t impl_len) {
    dnnl_status_t status = dnnl_success;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t post_ops = NULL;
    dnnl_primitive_desc_t pd = NULL;
    struct keel_matmul *mm = NULL;
    if (ndims < 2 || ndims > 4) return dnnl_invalid_arguments;
    pthread_once(&keel_engine_once, keel_make_engine);
    if (keel_engine_status != dnnl_success) return keel_engine_status;
    mm = calloc(1, sizeof *mm);
    if (!mm) return dnnl_out_of_memory;
    dnnl_data_type_t in = bf16 ? dnnl_bf16 : dnnl_f32;
    dnnl_dims_t ad, as, bd, bs, cd, cs;
    for (int i = 0; i < ndims; i++) {
        ad[i] = a_dims[i], as[i] = a_str[i], bd[i] = b_dims[i], bs[i] = b_str[i];
        cd[i] = c_dims[i], cs[i] = c_str[i];
    }
    CHECK(dnnl_memory_desc_init_by_strides(&mm->a_md, ndims, ad, in, as));
    CHECK(dnnl_memory_desc_init_by_strides(&mm->b_md, ndims, bd, in, bs));
    CHECK(dnnl_memory_desc_init_by_strides(&mm->c_md, ndims, cd, dnnl_f32, cs));
    if (bias) {
        /* [1, ..., 1, n], dense: broadcast over every row (and batch). */
        dnnl_dims_t zd, zs;
        for (int i = 0; i < ndims; i++) zd[i] = 1, zs[i] = cd[ndims - 1];
        zd[ndims - 1] = cd[ndims - 1];
        zs[ndims - 1] = 1;
        CHECK(dnnl_memory_desc_init_by_strides(&mm->bias_md, ndims, zd, dnnl_f32, zs));
        mm->has_bias = 1;
    }
    dnnl_matmul_desc_t desc;
    CHECK(dnnl_matmul_desc_init(&desc, &mm->a_md, &mm->b_md, bias ? &mm->bias_md : NULL,
                                &mm->c_md));
    CHECK(dnnl_primitive_attr_create(&attr));
    CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user));
    if (alpha != 1.0f) CHECK(dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha));
    if (beta != 0.0f) {
        CHECK(dnnl_post_ops_create(&post_ops));
        CHECK(dnnl_post_ops_append_sum(post_ops, beta));
        CHECK(dnnl_primitive_attr_set_post_ops(attr, post_ops));
    }
    CHECK(dnnl_primitive_desc_create(&pd, &desc, attr, keel_engine, NULL));
    const dnnl_memory_desc_t *scratch = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    if (scratch) {
        mm->scratch_md = *scratch;
        mm->scratch_bytes = dnnl_memory_desc_get_size(scratch);
    }
    if (impl && impl_len > 0) {
        const char *name = NULL;
        impl[0] = 0;
        if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name) == dnnl_success && name) {
            strncpy(impl, name, impl_len - 1);
            impl[impl_len - 1] = 0;
        }
    }
    CHECK(dnnl_primitive_create(&mm->prim, pd));
    *out = mm;
    mm = NULL;
done:
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (post_ops) dnnl_post_ops_destroy(post_ops);
    if (attr) dnnl_primitive_attr_destroy(attr);
    free(mm);
    return status;
}

/* Runs it on this thread: c = alpha * a b (+ bias) + beta * c. bias: n floats when the
 * primitive was created with one, else ignored (may be NULL). */
int keel_dnnl_matmul_run(const struct keel_matmul *mm, const void *a, const void *b,
                         const float *bias, float *c) {
    dnnl_status_t status = dnnl_success;
    dnnl_stream_t stream = NULL;
    dnnl_memory_t am = NULL, bm = NULL, cm = NULL, sm = NULL, zm = NULL;
    void *scratch = NULL;
    omp_set_num_threads(1);
    CHECK(dnnl_stream_create(&stream, keel_engine, dnnl_stream_default_flags));
    CHECK(dnnl_memory_create(&am, &mm->a_md, keel_engine, (void *)a));
    CHECK(dnnl_memory_create(&bm, &mm->b_md, keel_engine, (void *)b));
    CHECK(dnnl_memory_create(&cm, &mm->c_md, keel_engine, c));
    dnnl_exec_arg_t args[5] = {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
    int nargs = 3;
    if (mm->scratch_bytes > 0) {
        scratch = malloc(mm->scratch_bytes);
        if (!scratch) {
            status = dnnl_out_of_memory;
            goto done;
        }
        CHECK(dnnl_memory_create(&sm, &mm->scratch_md, keel_engine, scratch));
        args[nargs].arg = DNNL_ARG_SCRATCHPAD;
        args[nargs++].memory = sm;
    }
    if (mm->has_bias) {
        if (!bias) {
            status = dnnl_invalid_arguments;
            goto done;
        }
        CHECK(dnnl_memory_create(&zm, &mm->bias_md, keel_engine, (void *)bias));
        args[nargs].arg = DNNL_ARG_BIAS;
        args[nargs++].memory = zm;
    }
    CHECK(dnnl_primitive_execute(mm->prim, stream, nargs, args));
    CHECK(dnnl_stream_wait(stream));
done:
    if (zm) dnnl_memory_destroy(zm);
    if (sm) dnnl_memory_destroy(sm);
    if (cm) dnnl_memory_destroy(cm);
    if (bm) dnnl_memory_destroy(bm);
    if (am) dnnl_memory_destroy(am);
    if (stream) dnnl_stream_destroy(stream);
    free(scratch);
    return status;
}

/* Frees a primitive made by keel_dnnl_matmul_create. */
void keel_dnnl_matmul_destroy(struct keel_matmul *mm) {
    if (!mm) return;
    if (mm->prim) dnnl_primitive_destroy(mm->prim);
    free(mm);
}
