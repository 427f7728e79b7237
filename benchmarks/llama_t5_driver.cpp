// The llama.cpp peer of bench_suite.py: times T5 tasks over llama.h, with the threads set
// (llama.cpp's own examples set none). Built by setup_peers.py against the llama.cpp tree that the
// llama-cpp-python sdist carries.
//
//   llama_t5_driver MODEL.gguf TASK THREADS RUNS NEW IDS_FILE
//
// TASK "decode": for each source row (one line of IDS_FILE: space-separated token ids), encode it
// (llama_encode), then decode greedily from the decoder start token, one llama_decode per token,
// exactly NEW tokens (eos never chosen: the suite's forced length). TASK "encoder": llama_encode
// of each row only. One untimed warm-up call, then RUNS timed calls; prints one JSON line:
// {"seconds": [...], "ids": [[...], ...]} (ids of the last call; none for "encoder").
#include "llama.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level, const char *, void *) {}

static void fail(const char * what) {
    fprintf(stderr, "llama_t5_driver: %s\n", what);
    exit(1);
}

// One call of the task over every row; returns the generated ids per row.
static std::vector<std::vector<int>> run(llama_context * ctx, const llama_model * model,
                                         const std::vector<std::vector<llama_token>> & rows,
                                         bool decode, int n_new) {
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const llama_token eos = llama_vocab_eos(vocab);
    std::vector<std::vector<int>> out;
    for (const auto & row : rows) {
        llama_memory_clear(llama_get_memory(ctx), true);
        std::vector<llama_token> src(row);
        if (llama_encode(ctx, llama_batch_get_one(src.data(), (int32_t) src.size())) != 0) {
            fail("llama_encode failed");
        }
        if (!decode) {
            continue;
        }
        std::vector<int> ids;
        llama_token tok = llama_model_decoder_start_token(model);
        for (int t = 0; t < n_new; t++) {
            if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
                fail("llama_decode failed");
            }
            const float * logits = llama_get_logits_ith(ctx, -1);
            int best = -1;
            for (int v = 0; v < n_vocab; v++) {      // greedy; eos suppressed (forced length)
                if (v != eos && (best < 0 || logits[v] > logits[best])) {
                    best = v;
                }
            }
            tok = best;
            ids.push_back(best);
        }
        out.push_back(ids);
    }
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 7) {
        fail("usage: llama_t5_driver MODEL.gguf decode|encoder THREADS RUNS NEW IDS_FILE");
    }
    const bool decode = std::string(argv[2]) == "decode";
    const int threads = atoi(argv[3]), runs = atoi(argv[4]), n_new = atoi(argv[5]);
    std::vector<std::vector<llama_token>> rows;
    std::ifstream file(argv[6]);
    for (std::string line; std::getline(file, line);) {
        std::istringstream words(line);
        std::vector<llama_token> row;
        for (int id; words >> id;) {
            row.push_back(id);
        }
        if (!row.empty()) {
            rows.push_back(row);
        }
    }
    if (rows.empty()) {
        fail("no source rows");
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr || !llama_model_has_encoder(model)) {
        fail("cannot load the model, or it has no encoder");
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx = 512;
    params.n_batch = params.n_ubatch = 512;
    params.n_threads = params.n_threads_batch = threads;
    params.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, params);
    if (ctx == nullptr) {
        fail("cannot create a context");
    }
    auto ids = run(ctx, model, rows, decode, n_new);          // warm-up
    std::vector<double> seconds;
    for (int r = 0; r < runs; r++) {
        auto t0 = std::chrono::steady_clock::now();
        ids = run(ctx, model, rows, decode, n_new);
        seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("{\"seconds\": [");
    for (size_t i = 0; i < seconds.size(); i++) {
        printf("%s%.6f", i ? ", " : "", seconds[i]);
    }
    printf("], \"ids\": [");
    for (size_t i = 0; i < ids.size(); i++) {
        printf("%s[", i ? ", " : "");
        for (size_t j = 0; j < ids[i].size(); j++) {
            printf("%s%d", j ? ", " : "", ids[i][j]);
        }
        printf("]");
    }
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
