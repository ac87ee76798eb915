/* llama.cpp's grammar sampler over a whole vocabulary: the oracle for sharpi's grammar masks.
 *
 *   llamacpp_grammar_walk MODEL.gguf < cases > results
 *
 * MODEL's vocabulary only is loaded. Each case on stdin is a line "G seed steps eog_per_mille nforced
 * id... nbytes" followed by nbytes of GBNF text. A grammar llama_sampler_init_grammar refuses gives the line "E".
 * Otherwise the case is a walk of up to `steps` tokens: at each step every token of the vocabulary
 * goes through the grammar sampler, the line "S n picked lo-hi,lo-hi,..." gives the n tokens it left
 * (as sorted id ranges) and the one the walk picked among them (-1: none left), and the pick is
 * accepted. The walk picks an end-of-generation token (ending it) with probability eog_per_mille /
 * 1000 where the grammar allows one, else any other allowed token uniformly, from its own xorshift
 * generator seeded by `seed`; its first nforced picks are the ids given (one the grammar does not allow
 * ends the walk, picked -2). Each case ends with the line "Z".
 *
 * Built and run by scripts/fuzz_grammar.py against a llama.cpp build directory; never part of
 * sharpi itself. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "llamacpp_vocab.h"

static uint64_t rng_state;

static uint64_t next_u64(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf < cases\n", argv[0]);
        return 2;
    }
    struct llama_model *model = load_vocab_only(argv[1]);
    if (!model) return 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token_data *data = malloc(sizeof(llama_token_data) * n_vocab);
    int *allowed = malloc(sizeof(int) * n_vocab);
    unsigned long long seed;
    int steps, eog_pm, nforced, forced[64];
    size_t nbytes;
    while (scanf(" G %llu %d %d %d", &seed, &steps, &eog_pm, &nforced) == 4) {
        if (nforced < 0 || nforced > 64) return 1;
        for (int i = 0; i < nforced; i++) {
            if (scanf("%d", &forced[i]) != 1) return 1;
        }
        if (scanf("%zu", &nbytes) != 1) return 1;
        getchar();  /* the newline before the text */
        char *text = malloc(nbytes + 1);
        if (fread(text, 1, nbytes, stdin) != nbytes) return 1;
        text[nbytes] = 0;
        rng_state = seed * 2654435761ULL + 88172645463325252ULL;
        struct llama_sampler *g = llama_sampler_init_grammar(vocab, text, "root");
        free(text);
        if (!g) {
            printf("E\nZ\n");
            fflush(stdout);
            continue;
        }
        for (int s = 0; s < steps; s++) {
            for (int i = 0; i < n_vocab; i++) {
                data[i].id = i;
                data[i].logit = 0.0f;
                data[i].p = 0.0f;
            }
            llama_token_data_array cur = {data, (size_t) n_vocab, -1, false};
            llama_sampler_apply(g, &cur);
            int n = 0, n_eog = 0;
            for (size_t i = 0; i < cur.size; i++) {
                if (!isinf(cur.data[i].logit)) {
                    allowed[n++] = cur.data[i].id;
                    n_eog += llama_vocab_is_eog(vocab, cur.data[i].id);
                }
            }
            int picked = -1;
            if (s < nforced) {
                picked = -2;
                for (int i = 0; i < n; i++) {
                    if (allowed[i] == forced[s]) picked = forced[s];
                }
            } else if (n > 0) {
                int want_eog = n_eog > 0 && (n_eog == n || (int) (next_u64() % 1000) < eog_pm);
                int k = (int) (next_u64() % (uint64_t) (want_eog ? n_eog : n - n_eog));
                for (int i = 0; i < n; i++) {
                    if (llama_vocab_is_eog(vocab, allowed[i]) == want_eog && k-- == 0) {
                        picked = allowed[i];
                        break;
                    }
                }
            }
            printf("S %d %d ", n, picked);
            /* ids in order (the array was not sorted by the sampler): ranges */
            for (int i = 0; i < n;) {
                int j = i;
                while (j + 1 < n && allowed[j + 1] == allowed[j] + 1) j++;
                printf(i ? ",%d-%d" : "%d-%d", allowed[i], allowed[j]);
                i = j + 1;
            }
            printf("\n");
            fflush(stdout);  /* (before an accept that aborts: llama.cpp may allow a token it cannot take) */
            if (picked < 0 || llama_vocab_is_eog(vocab, picked)) break;  /* (accepting an id not allowed aborts) */
            llama_sampler_accept(g, picked);
        }
        printf("Z\n");
        fflush(stdout);
        llama_sampler_free(g);
    }
    free(data);
    free(allowed);
    llama_model_free(model);
    return 0;
}
