// llama.cpp's n-gram speculative drafters (common/speculative.cpp: --spec-type ngram-simple, ngram-map-k,
// ngram-map-k4v, ngram-mod) driven as its server drives them, on token sequences instead of a model:
// scripts/llamacpp_ngram.py builds and runs this and writes tests/data/llamacpp_ngram.json.
//
//   llamacpp_ngram TYPES N_MAX SIMPLE_N SIMPLE_M MAPK_N MAPK_M MAPK4V_N MAPK4V_M MAPK4V_HITS MOD_MATCH MOD_MIN MOD_MAX
//
// stdin: turns, two lines each: "P t0 t1 ..." (the prompt the turn evaluates) and "C t0 t1 ..." (the tokens the
// target then generates: the truth drafts are verified against, as greedy verification would). Per turn:
// common_speculative_begin(prompt); then each step drafts after the history with the next true token as the
// sampled one (draft params n_max = N_MAX); a draft's accepted count is its longest prefix that matches the truth,
// passed to common_speculative_accept, and the history moves past the sampled token and the accepted ones (the
// token after them is the next sampled one). stdout: "B" per turn, then "D t..." per draft call (empty: no draft).
#include "common.h"
#include "speculative.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static std::vector<llama_token> read_tokens(const std::string & line, char tag) {
    std::vector<llama_token> out;
    if (line.empty() || line[0] != tag) {
        fprintf(stderr, "expected a '%c' line\n", tag);
        exit(1);
    }
    std::istringstream in(line.substr(1));
    long t;
    while (in >> t) {
        out.push_back((llama_token) t);
    }
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 13) {
        fprintf(stderr, "usage: %s TYPES N_MAX SIMPLE_N SIMPLE_M MAPK_N MAPK_M MAPK4V_N MAPK4V_M MAPK4V_HITS "
                        "MOD_MATCH MOD_MIN MOD_MAX\n", argv[0]);
        return 1;
    }
    common_params_speculative params;
    params.types = common_speculative_types_from_names(string_split<std::string>(argv[1], ','));
    const int n_max = atoi(argv[2]);
    params.ngram_simple.size_n = atoi(argv[3]);
    params.ngram_simple.size_m = atoi(argv[4]);
    params.ngram_map_k.size_n = atoi(argv[5]);
    params.ngram_map_k.size_m = atoi(argv[6]);
    params.ngram_map_k4v.size_n = atoi(argv[7]);
    params.ngram_map_k4v.size_m = atoi(argv[8]);
    params.ngram_map_k4v.min_hits = atoi(argv[9]);
    params.ngram_mod.n_match = atoi(argv[10]);
    params.ngram_mod.n_min = atoi(argv[11]);
    params.ngram_mod.n_max = atoi(argv[12]);

    common_speculative * spec = common_speculative_init(params, 1);
    if (spec == nullptr) {
        fprintf(stderr, "common_speculative_init failed\n");
        return 1;
    }
    std::string pline, cline;
    while (std::getline(std::cin, pline) && std::getline(std::cin, cline)) {
        std::vector<llama_token> hist = read_tokens(pline, 'P');
        const std::vector<llama_token> truth = read_tokens(cline, 'C');
        common_speculative_begin(spec, 0, hist);
        printf("B\n");
        size_t pos = 0;
        while (pos < truth.size()) {
            const llama_token sampled = truth[pos];
            llama_tokens draft;
            llama_tokens prompt = hist;
            common_speculative_get_draft_params(spec, 0) = {
                /* .drafting = */ true,
                /* .n_max    = */ n_max,
                /* .pos0     = */ (llama_pos) hist.size(),
                /* .id_last  = */ sampled,
                /* .prompt   = */ &prompt,
                /* .result   = */ &draft,
            };
            common_speculative_draft(spec);
            printf("D");
            for (llama_token t : draft) {
                printf(" %d", t);
            }
            printf("\n");
            size_t acc = 0;
            while (acc < draft.size() && pos + 1 + acc < truth.size() && draft[acc] == truth[pos + 1 + acc]) {
                acc++;
            }
            if (!draft.empty()) {
                common_speculative_accept(spec, 0, (uint16_t) acc);
            }
            hist.push_back(sampled);
            for (size_t i = 0; i < acc; i++) {
                hist.push_back(truth[pos + 1 + i]);
            }
            pos += 1 + acc;
        }
    }
    common_speculative_free(spec);
    return 0;
}
