/* A model's vocabulary only, loaded by llama.cpp (vocab_only): what the oracle programs that tokenize, sample or
 * walk a grammar need. NULL where it does not load. Included by scripts/llamacpp_{tokenize,samplers,grammar_walk}.c. */
#include "llama.h"

static struct llama_model *load_vocab_only(const char *path) {
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    return llama_model_load_from_file(path, mp);
}
