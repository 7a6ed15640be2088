// llama.cpp's CPU MoE layer as a peer for bench/moe_cpu.py (issue #24): the graph llama.cpp builds for a routed
// expert layer (llama-graph.cpp, build_moe_ffn: MUL_MAT_ID for gate and up, SwiGLU, MUL_MAT_ID for down, the
// routing weights multiplied in, the top-k outputs summed with adds), on ggml's CPU backend with its own
// thread pool, over the very GGUF blocks our kernels read (the weight tensors point at the bench's arrays).
//
// Built against ggml's sources (llama.cpp's ggml/ directory) on the machine that runs the bench:
//   cmake -S <ggml> -B /tmp/ggml-build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=OFF \
//       -DBUILD_SHARED_LIBS=ON && cmake --build /tmp/ggml-build -j
//   cc -O2 -shared -fPIC bench/ggml_moe_peer.c -I<ggml>/include -L/tmp/ggml-build/src -lggml -lggml-base \
//       -lggml-cpu -Wl,-rpath,/tmp/ggml-build/src -o /tmp/ggml_moe_peer.so
// and loaded by moe_cpu.py --ggml-peer /tmp/ggml_moe_peer.so (ctypes).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cpu.h"
#include "ggml.h"

typedef struct {
    int hidden, inter, experts, top_k, threads;
    struct ggml_tensor *gate, *up, *down;  // no data of their own: the caller's blocks
    struct ggml_context *weights;
    struct ggml_threadpool *pool;
    // The graph of the current token count, rebuilt when it changes.
    int tokens;
    struct ggml_context *graph_ctx;
    struct ggml_cgraph *graph;
    struct ggml_tensor *x, *ids, *route_weights, *out;
    struct ggml_cplan plan;
    void *work;
} peer_layer;

// A layer over `experts` experts stored as ggml would load them from a GGUF file: gate and up [experts][inter
// rows of hidden] in `gate_up_type`, down [experts][hidden rows of inter] in `down_type` (ggml_type values),
// each one contiguous array. Returns NULL if the types or shapes are not ones ggml can multiply.
peer_layer *peer_layer_new(int gate_up_type, int down_type, int hidden, int inter, int experts, int top_k,
                           int threads, void *gate, void *up, void *down) {
    if (ggml_blck_size(gate_up_type) <= 0 || hidden % ggml_blck_size(gate_up_type) ||
        inter % ggml_blck_size(down_type))
        return NULL;
    peer_layer *p = calloc(1, sizeof(peer_layer));
    p->hidden = hidden, p->inter = inter, p->experts = experts, p->top_k = top_k, p->threads = threads;
    struct ggml_init_params params = {3 * ggml_tensor_overhead(), NULL, true};
    p->weights = ggml_init(params);
    p->gate = ggml_new_tensor_3d(p->weights, gate_up_type, hidden, inter, experts);
    p->up = ggml_new_tensor_3d(p->weights, gate_up_type, hidden, inter, experts);
    p->down = ggml_new_tensor_3d(p->weights, down_type, inter, hidden, experts);
    p->gate->data = gate, p->up->data = up, p->down->data = down;
    struct ggml_threadpool_params pool = ggml_threadpool_params_default(threads);
    p->pool = ggml_threadpool_new(&pool);
    return p;
}

static void build_graph(peer_layer *p, int tokens) {
    if (p->graph_ctx) ggml_free(p->graph_ctx), free(p->work);
    const size_t h = p->hidden, f = p->inter, k = p->top_k, t = tokens;
    // Inputs, the three products, the activation, the weighted outputs and the k-1 sums, in float32.
    size_t bytes = 4 * (h * t + 2 * k * t + 3 * f * k * t + 2 * h * k * t + h * t * k);
    struct ggml_init_params params = {bytes + 64 * ggml_tensor_overhead() + ggml_graph_overhead() + (1 << 20), NULL,
                                      false};
    p->graph_ctx = ggml_init(params);
    struct ggml_context *ctx = p->graph_ctx;
    p->tokens = tokens;
    p->x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, p->hidden, tokens);
    p->ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, p->top_k, tokens);
    p->route_weights = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, p->top_k, tokens);
    struct ggml_tensor *cur = ggml_reshape_3d(ctx, p->x, p->hidden, 1, tokens);
    struct ggml_tensor *up = ggml_mul_mat_id(ctx, p->up, cur, p->ids);      // [inter, top_k, tokens]
    struct ggml_tensor *gate = ggml_mul_mat_id(ctx, p->gate, cur, p->ids);  // [inter, top_k, tokens]
    struct ggml_tensor *act = ggml_swiglu_split(ctx, gate, up);
    struct ggml_tensor *experts = ggml_mul_mat_id(ctx, p->down, act, p->ids);  // [hidden, top_k, tokens]
    experts = ggml_mul(ctx, experts, p->route_weights);
    p->graph = ggml_new_graph(ctx);
    struct ggml_tensor *sum = NULL;
    for (int i = 0; i < p->top_k; i++) {
        struct ggml_tensor *one = ggml_view_2d(ctx, experts, p->hidden, tokens, experts->nb[2], i * experts->nb[1]);
        ggml_build_forward_expand(p->graph, one);
        sum = sum ? ggml_add(ctx, sum, one) : one;
    }
    p->out = p->top_k == 1 ? ggml_cont(ctx, sum) : sum;  // a lone view is strided
    ggml_build_forward_expand(p->graph, p->out);
    p->plan = ggml_graph_plan(p->graph, p->threads, p->pool);
    p->work = p->plan.work_size ? malloc(p->plan.work_size) : NULL;
    p->plan.work_data = p->work;
}

// One call: x [tokens, hidden] float32, ids and weights [tokens, top_k] -> out [tokens, hidden] float32.
// Returns ggml's status (0: success).
int peer_layer_run(peer_layer *p, int tokens, const float *x, const int32_t *ids, const float *weights, float *out) {
    if (tokens != p->tokens || !p->graph) build_graph(p, tokens);
    memcpy(p->x->data, x, ggml_nbytes(p->x));
    memcpy(p->ids->data, ids, ggml_nbytes(p->ids));
    memcpy(p->route_weights->data, weights, ggml_nbytes(p->route_weights));
    int status = ggml_graph_compute(p->graph, &p->plan);
    // Idle workers would otherwise poll for the next graph and slow the bench's read-floor pass that follows
    // (the floor sampled next to this peer fell by half); the next compute resumes them.
    ggml_threadpool_pause(p->pool);
    memcpy(out, p->out->data, ggml_nbytes(p->out));
    return status;
}

void peer_layer_free(peer_layer *p) {
    if (p->graph_ctx) ggml_free(p->graph_ctx), free(p->work);
    ggml_threadpool_free(p->pool);
    ggml_free(p->weights);
    free(p);
}
