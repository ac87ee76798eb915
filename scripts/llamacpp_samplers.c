/* llama.cpp's sampler chain applied to given logits: the oracle for sharpi's samplers.
 *
 *   llamacpp_samplers MODEL.gguf < cases > results
 *
 * MODEL's vocabulary only is loaded (DRY's sequence breakers are tokenized with it). Each case on
 * stdin is a block of lines:
 *   S n name...          the chain, in order (llama.cpp's common names: penalties dry top_n_sigma
 *                        top_k typ_p top_p min_p xtc temperature infill), then logit_bias first if any
 *   P top_k top_p min_p typ_p top_n_sigma xtc_p xtc_t temp dyn_range dyn_exp
 *     last_n repeat freq present dry_mult dry_base dry_allowed dry_last_n
 *   B n                  DRY sequence breakers, then n lines of hex-encoded bytes
 *   A n id bias ...      logit biases (hex floats)
 *   M tau eta            mirostat's parameters (stages mirostat, mirostat_v2; they pick the token)
 *   D target decay       adaptive-p's parameters (stage adaptive_p: it picks the token, and the token
 *                        it picked is accepted by the chain before the next row, which moves its state)
 *   H n id...            tokens accepted before (the prompt and what was generated)
 *   R r                  then r lines "L V x..." of logits (hex floats), applied one after the other
 * and gives, per logits row, "K n selected" then n lines "id logit" (hex float): the candidates the
 * chain leaves, in its order, with their logits after it (a -inf logit is a candidate the chain
 * masked), and the position mirostat picked (-1 without it).
 * XTC runs with its own RNG: cases use probability 0 or 1 (never / always cut).
 *
 * Built and run by scripts/llamacpp_samplers.py against a llama.cpp build directory; never part of
 * sharpi itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llamacpp_vocab.h"

static int hexval(int c) { return c <= '9' ? c - '0' : (c | 32) - 'a' + 10; }

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf < cases\n", argv[0]);
        return 2;
    }
    struct llama_model *model = load_vocab_only(argv[1]);
    if (!model) return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int nv = llama_vocab_n_tokens(vocab);
    char names[16][32];
    int ns;
    while (scanf(" S %d", &ns) == 1) {
        for (int i = 0; i < ns; i++)
            if (scanf(" %31s", names[i]) != 1) return 3;
        int top_k, last_n, dry_allowed, dry_last_n, min_keep;
        float top_p, min_p, typ_p, nsigma, xtc_p, xtc_t, temp, dyn_range, dyn_exp, rep, freq, pres, dry_mult, dry_base;
        if (scanf(" P %d %a %a %a %a %a %a %a %a %a %d %a %a %a %a %a %d %d %d", &top_k, &top_p, &min_p, &typ_p, &nsigma,
                  &xtc_p, &xtc_t, &temp, &dyn_range, &dyn_exp, &last_n, &rep, &freq, &pres, &dry_mult, &dry_base,
                  &dry_allowed, &dry_last_n, &min_keep) != 19)
            return 4;
        int nb;
        if (scanf(" B %d", &nb) != 1) return 5;
        char **breakers = calloc((size_t)nb + 1, sizeof *breakers);
        for (int i = 0; i < nb; i++) {
            char hex[512];
            if (scanf(" %511s", hex) != 1) return 5;
            size_t n = strlen(hex) / 2;
            breakers[i] = calloc(n + 1, 1);
            for (size_t j = 0; j < n; j++) breakers[i][j] = (char)(hexval(hex[2 * j]) * 16 + hexval(hex[2 * j + 1]));
        }
        int na;
        if (scanf(" A %d", &na) != 1) return 6;
        llama_logit_bias *bias = calloc((size_t)na + 1, sizeof *bias);
        for (int i = 0; i < na; i++)
            if (scanf(" %d %a", &bias[i].token, &bias[i].bias) != 2) return 6;
        float tau, eta;
        if (scanf(" M %a %a", &tau, &eta) != 2) return 10;
        float ad_target, ad_decay;
        if (scanf(" D %a %a", &ad_target, &ad_decay) != 2) return 11;
        int adaptive = 0;
        int nh;
        if (scanf(" H %d", &nh) != 1) return 7;
        int *hist = calloc((size_t)nh + 1, sizeof *hist);
        for (int i = 0; i < nh; i++)
            if (scanf(" %d", &hist[i]) != 1) return 7;
        int nr;
        if (scanf(" R %d", &nr) != 1) return 8;
        struct llama_sampler *chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
        if (na) llama_sampler_chain_add(chain, llama_sampler_init_logit_bias(nv, na, bias));
        for (int i = 0; i < ns; i++) {
            const char *s = names[i];
            struct llama_sampler *smp = NULL;
            if (!strcmp(s, "penalties")) smp = llama_sampler_init_penalties(nv, last_n, rep, freq, pres);
            else if (!strcmp(s, "dry"))
                smp = llama_sampler_init_dry(vocab, dry_mult, dry_base, dry_allowed, dry_last_n, (const char **)breakers, (size_t)nb);
            else if (!strcmp(s, "top_n_sigma")) smp = llama_sampler_init_top_n_sigma(nsigma);
            else if (!strcmp(s, "top_k")) smp = llama_sampler_init_top_k(top_k);
            else if (!strcmp(s, "typ_p")) smp = llama_sampler_init_typical(typ_p, (size_t)min_keep);
            else if (!strcmp(s, "top_p")) smp = llama_sampler_init_top_p(top_p, (size_t)min_keep);
            else if (!strcmp(s, "min_p")) smp = llama_sampler_init_min_p(min_p, (size_t)min_keep);
            else if (!strcmp(s, "xtc")) smp = llama_sampler_init_xtc(xtc_p, xtc_t, (size_t)min_keep, 1234);
            else if (!strcmp(s, "temperature")) smp = llama_sampler_init_temp_ext(temp, dyn_range, dyn_exp);
            else if (!strcmp(s, "infill")) smp = llama_sampler_init_infill(vocab);
            else if (!strcmp(s, "mirostat")) smp = llama_sampler_init_mirostat(nv, 1234, tau, eta, 100);
            else if (!strcmp(s, "mirostat_v2")) smp = llama_sampler_init_mirostat_v2(1234, tau, eta);
            else if (!strcmp(s, "adaptive_p")) smp = llama_sampler_init_adaptive_p(ad_target, ad_decay, 1234), adaptive = 1;
            else return 9;
            llama_sampler_chain_add(chain, smp);
        }
        for (int i = 0; i < nh; i++) llama_sampler_accept(chain, hist[i]);
        llama_token_data *cur = calloc((size_t)nv, sizeof *cur);
        for (int r = 0; r < nr; r++) {
            int V;
            if (scanf(" L %d", &V) != 1 || V != nv) return 8;
            for (int i = 0; i < V; i++) {
                cur[i].id = i;
                if (scanf(" %a", &cur[i].logit) != 1) return 8;
            }
            llama_token_data_array arr = {cur, (size_t)V, -1, false};
            llama_sampler_apply(chain, &arr);
            printf("K %zu %lld\n", arr.size, (long long)arr.selected);
            for (size_t i = 0; i < arr.size; i++) printf("%d %a\n", arr.data[i].id, arr.data[i].logit);
            if (adaptive && arr.selected >= 0) llama_sampler_accept(chain, arr.data[arr.selected].id);
        }
        fflush(stdout);
        llama_sampler_free(chain);
        for (int i = 0; i < nb; i++) free(breakers[i]);
        free(breakers);
        free(bias);
        free(hist);
        free(cur);
    }
    llama_model_free(model);
    return 0;
}
