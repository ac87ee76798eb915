/* Greedy decode with llama.cpp's C API, writing every step's logits: the oracle's own numbers.
 *
 *   [LCP_FLASH_ATTN=0|1] llamacpp_logits MODEL N_GEN N_THREADS ID...  > out.f32
 *
 * The prompt ids (tokenized by the caller) are evaluated in one batch with only the last row's
 * logits requested, as llama-completion does; then N_GEN tokens are decoded one at a time by
 * argmax. Output: (N_GEN + 1) rows of n_vocab float32 logits (the prompt's last row first), then
 * the N_GEN chosen ids as int32. Built by scripts/compare_llamacpp_logits.py against a llama.cpp
 * build directory; never part of sharpi itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "llama.h"

/* LCP_DUMP=DIR: every f32 tensor of the first (prompt) pass is written to DIR/NNNN.bin, with
 * "NNNN name ne0 ne1 ne2 ne3" lines in DIR/index.txt (for layer-by-layer comparisons). */
static const char *dump_dir;
static int dump_seq, dump_on = 1;

static bool dump_cb(struct ggml_tensor *t, bool ask, void *data) {
    (void)data;
    if (ask) return dump_on;
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) return true;
    char path[4096];
    snprintf(path, sizeof path, "%s/%04d.bin", dump_dir, dump_seq);
    FILE *f = fopen(path, "wb");
    if (!f) return true;
    fwrite(t->data, 1, ggml_nbytes(t), f);
    fclose(f);
    snprintf(path, sizeof path, "%s/index.txt", dump_dir);
    f = fopen(path, "a");
    fprintf(f, "%04d %s %lld %lld %lld %lld\n", dump_seq, t->name, (long long)t->ne[0], (long long)t->ne[1],
            (long long)t->ne[2], (long long)t->ne[3]);
    fclose(f);
    dump_seq++;
    return true;
}

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)level, (void)text, (void)data;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL N_GEN N_THREADS ID...\n", argv[0]);
        return 2;
    }
    const int n_gen = atoi(argv[2]), n_threads = atoi(argv[3]), n_prompt = argc - 4;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    if (getenv("LCP_NO_REPACK")) mp.use_extra_bufts = false; /* "1": no weight repacking (-nr / --no-repack) */
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return fprintf(stderr, "cannot load %s\n", argv[1]), 1;
    struct llama_context_params cp = llama_context_default_params();
    const char *nc = getenv("LCP_N_CTX"); /* default 512, as the fixtures' -c 512 */
    cp.n_ctx = nc ? (uint32_t)atoi(nc) : 512;
    /* a prompt in one llama_decode (split into ubatches of 512, n_ubatch, as llama-cli splits it); 512 as before for
     * the small contexts other scripts ask for */
    cp.n_batch = cp.n_ctx > 512 ? cp.n_ctx : 512;
    cp.n_threads = cp.n_threads_batch = n_threads;
    const char *fa = getenv("LCP_FLASH_ATTN"); /* "0" / "1": off / on; unset: llama.cpp's default (auto) */
    if (fa) cp.flash_attn_type = atoi(fa) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    const char *q8 = getenv("LCP_KV_Q8_0"); /* "1": K and V caches in q8_0 (-ctk q8_0 -ctv q8_0) */
    if (q8 && atoi(q8)) cp.type_k = cp.type_v = GGML_TYPE_Q8_0;
    const char *tk = getenv("LCP_TYPE_K"), *tv = getenv("LCP_TYPE_V"); /* -ctk / -ctv as ggml type ids */
    if (tk) cp.type_k = (enum ggml_type)atoi(tk);
    if (tv) cp.type_v = (enum ggml_type)atoi(tv);
    const char *rb = getenv("LCP_ROPE_FREQ_BASE"), *rs = getenv("LCP_ROPE_FREQ_SCALE"); /* --rope-freq-base / -scale */
    if (rb) cp.rope_freq_base = (float)atof(rb);
    if (rs) cp.rope_freq_scale = (float)atof(rs);
    const char *rt = getenv("LCP_ROPE_SCALING"); /* --rope-scaling none / linear / yarn */
    if (rt) cp.rope_scaling_type = !strcmp(rt, "none") ? LLAMA_ROPE_SCALING_TYPE_NONE
                                 : !strcmp(rt, "yarn") ? LLAMA_ROPE_SCALING_TYPE_YARN : LLAMA_ROPE_SCALING_TYPE_LINEAR;
    const char *ye = getenv("LCP_YARN_EXT_FACTOR"), *ya = getenv("LCP_YARN_ATTN_FACTOR"); /* --yarn-* */
    const char *yf = getenv("LCP_YARN_BETA_FAST"), *ys = getenv("LCP_YARN_BETA_SLOW"), *yo = getenv("LCP_YARN_ORIG_CTX");
    if (ye) cp.yarn_ext_factor = (float)atof(ye);
    if (ya) cp.yarn_attn_factor = (float)atof(ya);
    if (yf) cp.yarn_beta_fast = (float)atof(yf);
    if (ys) cp.yarn_beta_slow = (float)atof(ys);
    if (yo) cp.yarn_orig_ctx = (uint32_t)atoi(yo);
    const char *swa = getenv("LCP_SWA_FULL"); /* "1": full-size sliding-window caches (--swa-full), as sharpi's */
    if (swa && atoi(swa)) cp.swa_full = true;
    dump_dir = getenv("LCP_DUMP");
    if (dump_dir) {
        cp.cb_eval = dump_cb;
        cp.cb_eval_user_data = NULL;
    }
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return fprintf(stderr, "cannot create a context\n"), 1;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const char *lora = getenv("LCP_LORA"); /* "FILE:SCALE": a LoRA adapter (--lora-scaled FILE:SCALE) */
    if (lora) {
        char path[4096];
        snprintf(path, sizeof path, "%s", lora);
        char *colon = strrchr(path, ':');
        if (!colon) return fprintf(stderr, "LCP_LORA: FILE:SCALE\n"), 2;
        *colon = 0;
        float scale = (float)atof(colon + 1);
        struct llama_adapter_lora *ad = llama_adapter_lora_init(model, path);
        if (!ad || llama_set_adapters_lora(ctx, &ad, 1, &scale)) return fprintf(stderr, "cannot apply %s\n", lora), 1;
    }

    struct llama_batch batch = llama_batch_init(n_prompt, 0, 1);
    for (int i = 0; i < n_prompt; i++) {
        batch.token[i] = atoi(argv[4 + i]);
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i == n_prompt - 1;
    }
    batch.n_tokens = n_prompt;
    int *chosen = malloc(sizeof(int) * (n_gen > 0 ? n_gen : 1));
    /* LCP_SHIFT_KEEP=N: llama-completion's --context-shift with n_keep N (its BOS included): before a
     * token that would fill the context, positions [N, N + n_discard) go and the rest move down */
    const char *sk = getenv("LCP_SHIFT_KEEP");
    const int n_ctx = (int)llama_n_ctx(ctx);
    int n_past = n_prompt;
    for (int step = 0; step <= n_gen; step++) {
        if (llama_decode(ctx, batch)) return fprintf(stderr, "llama_decode failed\n"), 1;
        dump_on = 0;
        const float *lg = llama_get_logits_ith(ctx, -1);
        fwrite(lg, sizeof(float), n_vocab, stdout);
        if (step == n_gen) break;
        int best = 0;
        for (int v = 1; v < n_vocab; v++)
            if (lg[v] > lg[best]) best = v;
        chosen[step] = best;
        if (sk && n_past + 1 >= n_ctx) {
            const int n_keep = atoi(sk), n_discard = (n_past - n_keep) / 2;
            llama_memory_t mem = llama_get_memory(ctx);
            llama_memory_seq_rm(mem, 0, n_keep, n_keep + n_discard);
            llama_memory_seq_add(mem, 0, n_keep + n_discard, n_past, -n_discard);
            n_past -= n_discard;
            if (getenv("LCP_SHIFT_COMPACT")) {
                /* the cells in position order, as sharpi keeps them (llama.cpp fills the freed cells
                 * first): decode once to apply the K-shift, drop that token, save the sequence and
                 * load it back into an empty cache (contiguous cells) */
                batch.token[0] = best;
                batch.pos[0] = n_past;
                batch.n_seq_id[0] = 1;
                batch.seq_id[0][0] = 0;
                batch.logits[0] = 1;
                batch.n_tokens = 1;
                if (llama_decode(ctx, batch)) return fprintf(stderr, "llama_decode failed\n"), 1;
                llama_memory_seq_rm(mem, 0, n_past, -1);
                size_t sz = llama_state_seq_get_size(ctx, 0);
                uint8_t *buf = malloc(sz);
                llama_state_seq_get_data(ctx, buf, sz, 0);
                llama_memory_clear(mem, true);
                if (!llama_state_seq_set_data(ctx, buf, sz, 0)) return fprintf(stderr, "state reload failed\n"), 1;
                free(buf);
            }
        }
        batch.token[0] = best;
        batch.pos[0] = n_past++;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
    }
    fwrite(chosen, sizeof(int), n_gen, stdout);
    free(chosen);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
