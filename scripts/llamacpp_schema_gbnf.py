"""Record the GBNF llama.cpp's json_schema_to_grammar writes for the schemas below
(tests/data/llamacpp_schema_gbnf.json): tests/test_grammar.py compares the languages of its grammars
and of sharpi's (sharpi_core.json_schema) string by string.

    python scripts/llamacpp_schema_gbnf.py LLAMA_CPP_SRC BIN_DIR

LLAMA_CPP_SRC is the llama.cpp source tree (the one in llama-cpp-python's sdist, as for the fixtures),
BIN_DIR its build's bin directory (libllama-common and friends); a six-line C++ program calling
json_schema_to_grammar is compiled against them with g++.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llamacpp_schema_gbnf.json"

PROGRAM = r'''
#include "json-schema-to-grammar.h"
#include <iostream>
#include <sstream>
int main() {
    std::stringstream in; in << std::cin.rdbuf();
    std::cout << json_schema_to_grammar(common_json::parse(in.str()), true);
}
'''

# patterns in the syntax llama.cpp's converter supports (anchored; no \d, \w, \s), integer bounds
SCHEMAS = [
    {"type": "string", "pattern": "^[a-z]+$"},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,5}$"},
    {"type": "string", "pattern": "^(ab|c)*d?$"},
    {"type": "string", "pattern": "^x.y$"},
    {"type": "string", "pattern": "^[^a-c]{2,3}$"},
    {"type": "string", "pattern": "^a{2}b+c?e{0,2}$"},
    {"type": "string", "pattern": "^(?:foo|ba[rz])-[0-9]{2,}$"},
    {"type": "string", "pattern": "^\\x41\\u00e9\\.\\(\\)$"},
    {"type": "string", "pattern": "^([0-9]{3}-)?[0-9]{3}-[0-9]{4}$"},
    {"type": "integer", "minimum": 0, "maximum": 255},
    {"type": "integer", "minimum": -5, "maximum": 17},
    {"type": "integer", "minimum": -123, "maximum": -4},
    {"type": "integer", "minimum": 7, "maximum": 12345},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
    {"type": "integer", "minimum": 1.5, "maximum": 99.5},
    # one-sided: llama.cpp's language also holds some integers outside the bound (minimum 105: "15")
    {"type": "integer", "minimum": 105},
    {"type": "integer", "minimum": 3},
    {"type": "integer", "minimum": -42},
    {"type": "integer", "maximum": 2024},
    {"type": "integer", "maximum": -7},
]


def build(src: Path, bin_dir: Path, dest: Path) -> Path:
    """PROGRAM compiled into dest against the llama.cpp tree src and the libllama-common in bin_dir."""
    exe = dest / "j2g"
    (dest / "j2g.cpp").write_text(PROGRAM)
    subprocess.run(["g++", "-std=c++17", "-O1", *(f"-I{src / d}" for d in ("common", "include", "ggml/include", "vendor")),
                    str(dest / "j2g.cpp"), f"-L{bin_dir}", "-lllama-common", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{bin_dir}", "-o", str(exe)], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("bin_dir", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(a.src, a.bin_dir, Path(tmp))
        env = dict(os.environ, LD_LIBRARY_PATH=str(a.bin_dir))
        out = []
        for schema in SCHEMAS:
            r = subprocess.run([str(exe)], input=json.dumps(schema), env=env, capture_output=True, text=True, check=True)
            print(json.dumps(schema), "->", r.stdout.splitlines()[0], file=sys.stderr)
            out.append(dict(schema=schema, gbnf=r.stdout))
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
