/* One conversation rendered by llama.cpp's built-in chat templates (llama_chat_apply_template, the
 * templates llama-completion uses without --jinja): the oracle for sharpi's named templates.
 *
 *   llamacpp_chat_template NAME ADD_ASS [ROLE CONTENT]...   > rendered text
 *
 * Built and run by scripts/llamacpp_chat_templates.py against a llama.cpp build directory; never
 * part of sharpi itself. */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char **argv) {
    if (argc < 3 || (argc - 3) % 2) {
        fprintf(stderr, "usage: %s NAME ADD_ASS [ROLE CONTENT]...\n", argv[0]);
        return 2;
    }
    size_t n = (size_t)(argc - 3) / 2;
    struct llama_chat_message *chat = calloc(n ? n : 1, sizeof *chat);
    for (size_t i = 0; i < n; i++) {
        chat[i].role = argv[3 + 2 * i];
        chat[i].content = argv[4 + 2 * i];
    }
    int32_t len = 1 << 16;
    char *buf = malloc((size_t)len);
    int32_t r = llama_chat_apply_template(argv[1], chat, n, atoi(argv[2]) != 0, buf, len);
    if (r < 0 || r > len) {
        fprintf(stderr, "llama_chat_apply_template: %d\n", r);
        return 1;
    }
    fwrite(buf, 1, (size_t)r, stdout);
    return 0;
}
