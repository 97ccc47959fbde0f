// ninfer-llama-logits: llama.cpp's logits at every position of one token sequence, as raw float32.
//
//   ninfer-llama-logits MODEL.gguf TOKENS.i32 OUT.f32 [N_UBATCH]
//
// TOKENS.i32: the token ids, int32 little-endian. OUT.f32: [n_tokens, n_vocab] float32, row i the logits
// after token i. One sequence, one llama_decode call over the whole prompt (all outputs requested), every
// layer offloaded, flash attention on and an f16 KV cache, as the benchmark runs llama-bench.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

static void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf TOKENS.i32 OUT.f32 [N_UBATCH]\n", argv[0]);
        return 2;
    }
    const int n_ubatch = argc > 4 ? atoi(argv[4]) : 512;
    FILE * ft = fopen(argv[2], "rb");
    if (!ft) { fprintf(stderr, "cannot open %s\n", argv[2]); return 2; }
    std::vector<llama_token> tokens;
    int32_t t;
    while (fread(&t, sizeof t, 1, ft) == 1) tokens.push_back(t);
    fclose(ft);
    const int n = (int) tokens.size();
    if (n == 0) { fprintf(stderr, "no tokens in %s\n", argv[2]); return 2; }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 999;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n;
    cp.n_batch = n;
    cp.n_ubatch = n_ubatch < n ? n_ubatch : n;
    cp.n_seq_max = 1;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.type_k = GGML_TYPE_F16;
    cp.type_v = GGML_TYPE_F16;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context of %d tokens\n", n); return 1; }

    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }

    FILE * fo = fopen(argv[3], "wb");
    if (!fo) { fprintf(stderr, "cannot write %s\n", argv[3]); return 2; }
    for (int i = 0; i < n; i++) {
        const float * row = llama_get_logits_ith(ctx, i);
        if (!row || fwrite(row, sizeof(float), n_vocab, fo) != (size_t) n_vocab) {
            fprintf(stderr, "no logits for position %d\n", i);
            return 1;
        }
    }
    fclose(fo);
    fprintf(stderr, "%d tokens, %d logits each -> %s\n", n, n_vocab, argv[3]);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
