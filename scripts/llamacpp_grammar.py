"""Record llama.cpp's greedy output under grammars (tests/data/llamacpp_grammar.json): for each case
below, what `llama-completion --temp 0 -t 2` generates with `--grammar` or `-j/--json-schema`.

    python scripts/llamacpp_grammar.py BIN_DIR

BIN_DIR holds llama-completion and its libraries (the llama.cpp in llama-cpp-python, as the fixtures in
../shared/fixtures were built from); the models come from sharpi's model cache. The grammars are written
here in full (llama.cpp's sample grammars are not copied: these are sharpi's own, in the same syntax).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llamacpp_grammar.json"
SMOL, GEMMA, QWEN05 = "smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m"

JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}   # at most one newline
'''
ARITH = r'''
root ::= (expr "=" ws term "\n")+
expr ::= term ([-+*/] term)*
term ::= name | num | "(" ws expr ")" ws
name ::= [a-z] [a-z0-9_]* ws
num  ::= [0-9]+ ws
ws   ::= [ \t\n]*
'''
LIST = 'root ::= ("- " [^\\r\\n]+ "\\n"){2,4}'
YESNO = 'root ::= ("yes" | "no") "."'
KANA = r'''
root ::= ch+ ([ \n] ch+)*
ch   ::= [ぁ-ゟ] | [ァ-ヿ] | [、-〾] | [一-鿿]
'''
CHESS = r'''root ::= "1. " mv " " mv "\n" ([1-9] [0-9]? ". " mv " " mv "\n")+
mv   ::= ([a-h] "x")? [a-h] [1-8] | [NBKQR] [a-h]? "x"? [a-h] [1-8] | "O-O" "-O"?'''
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name", "age"]}
SHIRT = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "number"},
         "ok": {"type": "boolean"}}, "required": ["color"]}
EXTRA = {"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
DEFS = {"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                            "born": {"type": "string", "format": "date"},
                                                            "nick": {"type": "string", "minLength": 2, "maxLength": 8}},
                          "required": ["kind", "born"]}},
        "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "minItems": 1},
                                         "owner": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["pets", "owner"]}
TUPLE = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}, {"const": True}]}
USER = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)?$"},
                                         "age": {"type": "integer", "minimum": 41, "maximum": 65},
                                         "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["name", "age", "code"]}

# (name, model, prompt, n, grammar text or None, schema or None)
CASES = [
    ("json grammar", SMOL, "A JSON object describing a cat:", 48, JSON_GBNF, None),
    ("arithmetic", SMOL, "Some arithmetic:\n", 40, ARITH, None),
    ("list of 2-4 items, then the end", SMOL, "Three fruits:\n", 40, LIST, None),
    ("yes or no, then the end", SMOL, "Is the sky blue? Answer:", 8, YESNO, None),
    ("chess", SMOL, "A famous chess game:\n", 32, CHESS, None),
    ("schema: person", SMOL, "Describe a person as JSON:", 48, None, PERSON),
    ("schema: enum and optional properties", SMOL, "A t-shirt as JSON:", 32, None, SHIRT),
    ("schema: additional properties", SMOL, "A record as JSON:", 40, None, EXTRA),
    ("schema: $defs, anyOf, format, lengths", SMOL, "My pets, as JSON:", 64, None, DEFS),
    ("schema: tuple", SMOL, "A tuple:", 24, None, TUPLE),
    ("schema: patterns, integer range", SMOL, "A user record as JSON:", 48, None, USER),
    ("kana and kanji (split UTF-8)", QWEN05, "日本の首都について一文で説明してください:", 24, KANA, None),
    ("json grammar on gemma", GEMMA, "A JSON object describing a cat:", 40, JSON_GBNF, None),
    ("kana on gemma", GEMMA, "日本語の文:", 16, KANA, None),
    ("token references: any token but '.'", SMOL, "The capital of France is", 16, 'root ::= !<[30]>{4,8} "."', None),
    ("token references: a special token by its text", SMOL, "Hi", 12,
     'root ::= <|im_start|> "assistant\\n" [A-Za-z ,.!]+', None),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bin_dir", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from sharpi_core.registry import pull
    env = dict(os.environ, LD_LIBRARY_PATH=str(a.bin_dir))
    out = []
    for name, model, prompt, n, grammar, schema in CASES:
        cmd = [str(a.bin_dir / "llama-completion"), "-m", str(pull(model)), "-p", prompt, "-n", str(n), "--temp", "0",
               "-t", "2", "-no-cnv", "--no-display-prompt", "--no-warmup"]
        cmd += ["--grammar", grammar] if grammar is not None else ["-j", json.dumps(schema)]
        r = subprocess.run(cmd, env=env, capture_output=True, check=True)
        # llama-completion ends its output with " [end of text]" at an end-of-generation token, then "\n\n"
        raw = r.stdout
        eos = raw.endswith(b" [end of text]\n\n\n")
        body = raw[: -len(b" [end of text]\n\n\n")] if eos else raw.removesuffix(b"\n\n")
        if body == raw:
            sys.exit(f"{name}: unexpected end of llama-completion's output {raw[-40:]!r}")
        print(f"{name}: {body!r} eos={eos}", file=sys.stderr)
        # the bytes in hex: a generation cut by -n may end inside a UTF-8 character
        out.append(dict(name=name, model=model, prompt=prompt, n=n, grammar=grammar, schema=schema,
                        output_hex=body.hex(), eos=eos))
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
