/* llama.cpp's MTP head (--spec-type draft-mtp) on a prompt, as common/speculative.cpp drives it: the oracle of
 * sharpi's models/mtp.py.
 *
 *   llamacpp_mtp MODEL K N_THREADS ID...  > out.bin
 *
 * The target evaluates the prompt in one batch with its next-token-prediction rows on for every token (masked
 * off, as the draft-mtp driver sets the target's context); the MTP context (LLAMA_CONTEXT_TYPE_MTP) then takes
 * the pairs (x_p, h_{p-1}) of the prompt in one batch (zeros before the first, as the driver's first pending row),
 * with logits at rows 0, T/2 and T-1; then the target's greedy next token t and K greedy draft steps: (t, h_{T-1})
 * at T, then each drafted token with the head's own row. Output, int32 then float32: n_vocab, T, K; the 3 prompt
 * rows' logits [3, n_vocab]; the K draft steps' logits [K, n_vocab]; t and the K drafted ids (int32).
 * Built by scripts/llamacpp_mtp.py against a llama.cpp build; never part of sharpi itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "llama.h"

/* the staging API of src/llama-ext.h (C++ linkage): by their mangled names */
void set_embeddings_nextn(struct llama_context *ctx, bool value, bool masked)
    __asm__("_Z26llama_set_embeddings_nextnP13llama_contextbb");
float *get_embeddings_nextn(struct llama_context *ctx) __asm__("_Z26llama_get_embeddings_nextnP13llama_context");
float *get_embeddings_nextn_ith(struct llama_context *ctx, int32_t i)
    __asm__("_Z30llama_get_embeddings_nextn_ithP13llama_contexti");

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)level, (void)text, (void)data;
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int v = 1; v < n; v++)
        if (x[v] > x[best]) best = v;
    return best;
}

static int add(struct llama_batch_ext *b, int token, int pos, const float *h, int n_embd, bool out) {
    const int idx = llama_batch_ext_add_token(b, 0, token);
    llama_pos p[4] = {pos, 0, 0, 0};
    llama_batch_ext_set_pos(b, idx, p);
    struct llama_embd e = {h, 1, (size_t)n_embd};
    llama_batch_ext_set_embd_token(b, idx, e);
    llama_batch_ext_set_output_logits(b, idx, out);
    return idx;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL K N_THREADS ID...\n", argv[0]);
        return 2;
    }
    const int K = atoi(argv[2]), n_threads = atoi(argv[3]), T = argc - 4;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.load_mtp = true;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fprintf(stderr, "cannot load %s\n", argv[1]), 1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_threads = cp.n_threads_batch = n_threads;
    struct llama_context *tgt = llama_init_from_model(model, cp);
    cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    struct llama_context *mtp = llama_init_from_model(model, cp);
    if (!tgt || !mtp) return fprintf(stderr, "cannot create the contexts\n"), 1;
    set_embeddings_nextn(tgt, true, false);
    set_embeddings_nextn(mtp, true, true);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model)), n_embd = llama_model_n_embd(model);

    struct llama_batch batch = llama_batch_init(T, 0, 1);
    for (int i = 0; i < T; i++) {
        batch.token[i] = atoi(argv[4 + i]);
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i == T - 1;
    }
    batch.n_tokens = T;
    if (llama_decode(tgt, batch)) return fprintf(stderr, "target decode failed\n"), 1;
    const int t = argmax(llama_get_logits_ith(tgt, -1), n_vocab);
    float *h = malloc(sizeof(float) * (size_t)(T + 1) * n_embd); /* row 0: zeros, row p + 1: h_p */
    memset(h, 0, sizeof(float) * n_embd);
    memcpy(h + n_embd, get_embeddings_nextn(tgt), sizeof(float) * (size_t)T * n_embd);

    int header[3] = {n_vocab, T, K};
    fwrite(header, sizeof(int), 3, stdout);
    struct llama_batch_ext *b = llama_batch_ext_init(mtp);
    const int rows[3] = {0, T / 2, T - 1};
    int out_idx[3];
    for (int i = 0; i < T; i++) {
        const bool out = i == rows[0] || i == rows[1] || i == rows[2];
        const int idx = add(b, batch.token[i], i, h + (size_t)i * n_embd, n_embd, out);
        for (int r = 0; r < 3; r++)
            if (rows[r] == i) out_idx[r] = idx;
    }
    if (llama_process(mtp, LLAMA_PROCESS_TYPE_DECODE, b)) return fprintf(stderr, "MTP prompt pass failed\n"), 1;
    for (int r = 0; r < 3; r++) fwrite(llama_get_logits_ith(mtp, out_idx[r]), sizeof(float), n_vocab, stdout);

    int *ids = malloc(sizeof(int) * (K + 1));
    ids[0] = t;
    float *hrow = malloc(sizeof(float) * n_embd);
    memcpy(hrow, h + (size_t)T * n_embd, sizeof(float) * n_embd); /* h_{T-1} */
    for (int s = 0; s < K; s++) {
        llama_batch_ext_clear(b);
        const int idx = add(b, ids[s], T + s, hrow, n_embd, true);
        if (llama_process(mtp, LLAMA_PROCESS_TYPE_DECODE, b)) return fprintf(stderr, "MTP draft step failed\n"), 1;
        const float *lg = llama_get_logits_ith(mtp, idx);
        fwrite(lg, sizeof(float), n_vocab, stdout);
        ids[s + 1] = argmax(lg, n_vocab);
        memcpy(hrow, get_embeddings_nextn_ith(mtp, idx), sizeof(float) * n_embd);
    }
    fwrite(ids, sizeof(int), K + 1, stdout);
    free(ids), free(hrow), free(h);
    llama_batch_ext_free(b);
    llama_batch_free(batch);
    llama_free(mtp);
    llama_free(tgt);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
