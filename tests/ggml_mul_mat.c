/* One MUL_MAT on ggml-cpu as llama.cpp runs it, for tests/record_llama_cpp_iq4_nl.py:
 * the matrix in the CPU_REPACK buffer (repacked where ggml repacks that type and shape) or
 * in a plain CPU buffer, the activations float32, the result float32.
 *
 *     ggml_mul_mat TYPE M K N REPACK(0|1) MATRIX_FILE ACTIVATIONS_FILE OUT_FILE
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

static void read_into(const char *path, void *dst, size_t n) {
    FILE *f = fopen(path, "rb");
    if (!f || fread(dst, 1, n, f) != n) { fprintf(stderr, "cannot read %zu bytes of %s\n", n, path); exit(1); }
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 9) { fprintf(stderr, "usage: %s TYPE M K N REPACK MATRIX ACTIVATIONS OUT\n", argv[0]); return 2; }
    int type = atoi(argv[1]), repack = atoi(argv[5]);
    int64_t m = atoll(argv[2]), k = atoll(argv[3]), n = atoll(argv[4]);
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, 2);
    ggml_backend_dev_t dev = ggml_backend_get_device(cpu);
    ggml_backend_dev_get_extra_bufts_t extra = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(cpu);
    for (ggml_backend_buffer_type_t *b = extra ? extra(dev) : NULL; repack && b && *b; b++)
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) buft = *b;
    if (repack && strcmp(ggml_backend_buft_name(buft), "CPU_REPACK") != 0) { fprintf(stderr, "no CPU_REPACK buffer\n"); return 1; }

    struct ggml_init_params params = { 16 * 1024 * 1024, NULL, true };
    struct ggml_context *cw = ggml_init(params), *cx = ggml_init(params);
    struct ggml_tensor *w = ggml_new_tensor_2d(cw, type, k, m);
    struct ggml_tensor *x = ggml_new_tensor_2d(cx, GGML_TYPE_F32, k, n);
    struct ggml_tensor *y = ggml_mul_mat(cx, w, x);
    ggml_backend_buffer_t bw = ggml_backend_alloc_ctx_tensors_from_buft(cw, buft);
    ggml_backend_buffer_set_usage(bw, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_alloc_ctx_tensors(cx, cpu);
    void *tmp = malloc(ggml_nbytes(w) > ggml_nbytes(y) ? ggml_nbytes(w) : ggml_nbytes(y));
    void *xb = malloc(ggml_nbytes(x));
    read_into(argv[6], tmp, ggml_nbytes(w));
    ggml_backend_tensor_set(w, tmp, 0, ggml_nbytes(w));
    read_into(argv[7], xb, ggml_nbytes(x));
    ggml_backend_tensor_set(x, xb, 0, ggml_nbytes(x));
    struct ggml_cgraph *graph = ggml_new_graph(cx);
    ggml_build_forward_expand(graph, y);
    if (ggml_backend_graph_compute(cpu, graph) != GGML_STATUS_SUCCESS) { fprintf(stderr, "compute failed\n"); return 1; }
    ggml_backend_tensor_get(y, tmp, 0, ggml_nbytes(y));
    FILE *f = fopen(argv[8], "wb");
    fwrite(tmp, 1, ggml_nbytes(y), f);
    fclose(f);
    return 0;
}
