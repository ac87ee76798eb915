/* llama.cpp's tokenizer on many texts at once: the oracle of scripts/llamacpp_vocab_check.py.
 *
 *   llamacpp_tokenize MODEL [ADD_SPECIAL PARSE_SPECIAL] < texts > ids
 *   llamacpp_tokenize MODEL pieces > pieces
 *   llamacpp_tokenize MODEL specials > ids
 *
 * Loads only MODEL's vocabulary. stdin holds texts separated by "\n__ggml_vocab_test__\n" (the format
 * of llama.cpp's models/ggml-vocab-*.gguf.inp files); each is tokenized without special tokens added
 * or parsed (llama_tokenize(..., false, false); "1 1": both) and written as one line of space-separated ids.
 * With "pieces": one line per token id, in order, of the piece with special=true and the piece with special=false
 * (llama_token_to_piece, lstrip 0), each as hex bytes ("-" for an empty piece), separated by a space
 * (scripts/fuzz_tokenizer.py --pieces).
 * With "specials": one line "bos eos eot fim_pre fim_suf fim_mid fim_pad fim_rep fim_sep" of the vocabulary's special
 * ids (-1: none), then one line of the end-of-generation ids (llama_vocab_is_eog), ascending.
 * Built by the script against a llama.cpp build directory; never part of sharpi itself. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llamacpp_vocab.h"

static void quiet(enum ggml_log_level level, const char *text, void *data) {
    (void)level, (void)text, (void)data;
}

static bool add_special = false, parse_special = false;

static void emit(const struct llama_vocab *vocab, const char *text, int len) {
    int cap = len + 16;
    llama_token *ids = malloc(sizeof(llama_token) * cap);
    int n = llama_tokenize(vocab, text, len, ids, cap, add_special, parse_special);
    if (n < 0) {
        cap = -n;
        ids = realloc(ids, sizeof(llama_token) * cap);
        n = llama_tokenize(vocab, text, len, ids, cap, add_special, parse_special);
    }
    for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
}

static void piece_hex(const struct llama_vocab *vocab, llama_token id, bool special) {
    static char buf[1 << 16];
    const int n = llama_token_to_piece(vocab, id, buf, (int)sizeof buf, 0, special);
    if (n < 0) {
        fprintf(stderr, "token %d: a piece longer than %zu bytes\n", id, sizeof buf);
        exit(1);
    }
    if (n == 0) putchar('-');
    for (int i = 0; i < n; i++) printf("%02x", (unsigned char)buf[i]);
}

int main(int argc, char **argv) {
    const bool pieces = argc == 3 && strcmp(argv[2], "pieces") == 0;
    const bool specials = argc == 3 && strcmp(argv[2], "specials") == 0;
    if (argc != 2 && argc != 4 && !pieces && !specials) {
        fprintf(stderr, "usage: %s MODEL [ADD_SPECIAL PARSE_SPECIAL | pieces | specials] < texts\n", argv[0]);
        return 2;
    }
    if (argc == 4) {
        add_special = atoi(argv[2]) != 0;
        parse_special = atoi(argv[3]) != 0;
    }
    llama_log_set(quiet, NULL);
    struct llama_model *model = load_vocab_only(argv[1]);
    if (!model) return fprintf(stderr, "cannot load %s\n", argv[1]), 1;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    if (specials) {
        printf("%d %d %d %d %d %d %d %d %d\n", llama_vocab_bos(vocab), llama_vocab_eos(vocab), llama_vocab_eot(vocab),
               llama_vocab_fim_pre(vocab), llama_vocab_fim_suf(vocab), llama_vocab_fim_mid(vocab),
               llama_vocab_fim_pad(vocab), llama_vocab_fim_rep(vocab), llama_vocab_fim_sep(vocab));
        for (llama_token id = 0, n = 0; id < llama_vocab_n_tokens(vocab); id++)
            if (llama_vocab_is_eog(vocab, id)) printf(n++ ? " %d" : "%d", id);
        printf("\n");
        llama_model_free(model);
        return 0;
    }
    if (pieces) {
        for (llama_token id = 0; id < llama_vocab_n_tokens(vocab); id++) {
            piece_hex(vocab, id, true);
            putchar(' ');
            piece_hex(vocab, id, false);
            putchar('\n');
        }
        llama_model_free(model);
        return 0;
    }
    size_t cap = 1 << 16, len = 0, got;
    char *buf = malloc(cap + 1);
    while ((got = fread(buf + len, 1, cap - len, stdin)) > 0) {
        len += got;
        if (len == cap) buf = realloc(buf, (cap *= 2) + 1);
    }
    buf[len] = 0;
    const char *sep = "\n__ggml_vocab_test__\n";
    const size_t n_sep = strlen(sep);
    char *p = buf, *end = buf + len;
    while (p < end) {
        char *q = strstr(p, sep);
        if (!q) q = end;
        emit(vocab, p, (int)(q - p));
        p = q + (q < end ? n_sep : 0);
    }
    free(buf);
    llama_model_free(model);
    return 0;
}
