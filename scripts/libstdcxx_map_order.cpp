// The order libstdc++'s std::unordered_map<std::string, int> walks its keys: the oracle of sharpi_core/stdhash.py.
//
//   libstdcxx_map_order < keys > walk
//
// stdin: one key per line, hex-encoded bytes, inserted in order (try_emplace: a repeated key keeps its node and
// first index, where llama.cpp's token_to_id[text] = id keeps the node and takes the last id). stdout: a line per
// distinct key in the map's walk, "index hash" (the key's first line number, std::hash<std::string> of it), then
// "buckets N". Built by scripts/libstdcxx_map_order.py with the system's g++; never part of sharpi itself.
#include <cstdio>
#include <iostream>
#include <string>
#include <unordered_map>

int main() {
    std::unordered_map<std::string, int> map;
    std::string line;
    for (int i = 0; std::getline(std::cin, line); i++) {
        std::string key;
        for (size_t j = 0; j + 1 < line.size(); j += 2) key.push_back((char)std::stoi(line.substr(j, 2), nullptr, 16));
        map.try_emplace(key, i);
    }
    for (const auto &kv : map) printf("%d %zu\n", kv.second, std::hash<std::string>{}(kv.first));
    printf("buckets %zu\n", map.bucket_count());
}
