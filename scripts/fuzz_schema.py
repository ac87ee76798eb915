"""Random JSON schemas through sharpi's converter and llama.cpp's json_schema_to_grammar: the languages of the two
grammars must be the same (a tool, not a test).

    python scripts/fuzz_schema.py LLAMA_CPP_SRC BIN_DIR [--seed 1] [--runs 300] [--walks 150] [--log F]

Each case is a random schema of the kinds where sharpi means to write llama.cpp's language (sharpi_core.json_schema
names where it does not, and the schemas here stay clear of those: integer bounds one-sided, number bounds,
allOf parts sharing names or without properties, prefixItems beside items, patterns with lengths or formats,
patterns with `.` or negated classes; texts with a raw backslash in an additional key, or integers written
"-0" or with leading zeros, that only llama.cpp's grammar takes, are let be): nested objects with required and
optional properties, additionalProperties false / true / a schema, allOf of objects with names of their own,
objects without properties, tuples (prefixItems), arrays with item counts, strings with lengths,
the date / time / uuid formats and patterns llama.cpp's converter reads, integers with two bounds, numbers,
booleans, null, enum and const, anyOf / oneOf, type lists, and $ref into $defs. llama.cpp's grammar comes from
libllama-common (scripts/llamacpp_schema_gbnf.py's program) and is read by sharpi's GBNF automaton, which
scripts/fuzz_grammar.py compares with llama.cpp's own. The languages are compared by random walks: texts each
grammar generates one character at a time (JSON's punctuation preferred, so that most end) must be sentences of
the other. A text only one takes is printed, with the schema, and written to --log; exits 1 if any. A schema
sharpi refuses (bounds no value meets, ...) is counted, not compared.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from sharpi_core.grammar import Grammar, GrammarError  # noqa: E402
from sharpi_core.json_schema import SchemaError, schema_to_grammar  # noqa: E402
from compare_llamacpp_logits import fuzz_args  # noqa: E402

NAMES = ["a", "id", "name", "x-y", "é", "tags", "n", "Z"]
# (no `.` or negated class: there llama.cpp's converter lets raw quotes and control characters into the string,
# where sharpi's language is the JSON that escapes them)
PATTERNS = ["^[a-z]+$", "^[A-Z][a-z]{1,3}$", "^(ab|c)*d?$", "^a{2}b+c?$", "^(?:foo|ba[rz])-[0-9]{2,}$",
            "^([0-9]{2}-)?[0-9]{3}$", "^[a-c]{2,3}$"]
WORDS = ["a", "b", "red", "x y", "é", "", "1", "null", 'q"', "\\"]
# the characters a walk tries, with weights: JSON's punctuation first, so that most walks end
ALPHABET = ([(c, 6) for c in '{}[]",:'] + [(c, 3) for c in "0123456789-.eE+"] + [(c, 2) for c in "truefalsn"]
            + [(c, 1) for c in "abcdxyzABZ_ \n\t\\/éü中😀"] + [("u", 1)])


def leaf(rng: random.Random) -> dict:
    k = rng.random()
    if k < 0.25:
        s: dict = {"type": "string"}
        r = rng.random()
        if r < 0.3:
            lo = rng.choice([0, 1, 2])
            s |= {"minLength": lo} if rng.random() < 0.5 else {"minLength": lo, "maxLength": lo + rng.choice([0, 1, 3])}
        elif r < 0.45:
            s["maxLength"] = rng.choice([0, 1, 4])
        elif r < 0.6:
            s["format"] = rng.choice(["date", "time", "date-time", "uuid"])
        elif r < 0.75:
            s["pattern"] = rng.choice(PATTERNS)
        return s
    if k < 0.45:
        s = {"type": "integer"}
        if rng.random() < 0.5:
            lo = rng.choice([-300, -42, -5, 0, 1, 7, 99, 105, 1000])
            hi = lo + rng.choice([0, 1, 9, 10, 95, 1234, 99999])
            s |= {"minimum": lo, "maximum": hi} if rng.random() < 0.7 else {"exclusiveMinimum": lo - 1,
                                                                             "exclusiveMaximum": hi + 1}
        return s
    if k < 0.55:
        return {"type": "number"}
    if k < 0.62:
        return {"type": "boolean"}
    if k < 0.66:
        return {"type": "null"}
    if k < 0.78:
        vals = rng.sample([*WORDS, 1, -2, 3.5, True, False, None], rng.randint(1, 4))
        return {"enum": vals}
    if k < 0.86:
        return {"const": rng.choice([*WORDS, 0, 12, True, None])}
    if k < 0.92:
        return {"type": rng.sample(["string", "integer", "null", "boolean", "number"], 2)}
    return {}


class Gen:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.defs: dict = {}

    def schema(self, depth: int) -> dict:
        rng = self.rng
        k = rng.random()
        if depth >= 3 or k < 0.35:
            return leaf(rng)
        if k < 0.6:
            names = rng.sample(NAMES, rng.randint(0, 4))
            s: dict = {"type": "object", "properties": {n: self.schema(depth + 1) for n in names}}
            if names:
                s["required"] = rng.sample(names, rng.randint(0, len(names)))
            r = rng.random()
            if r < 0.3:
                s["additionalProperties"] = False
            elif r < 0.45:
                s["additionalProperties"] = True if rng.random() < 0.3 else self.schema(depth + 1)
            elif r < 0.5:
                del s["properties"]
                s.pop("required", None)
            elif r < 0.6 and names:  # allOf of objects with names of their own
                half = len(names) // 2
                parts = [{"type": "object", "properties": {n: s["properties"][n] for n in part},
                          "required": [n for n in s.get("required", []) if n in part]}
                         for part in (names[:half], names[half:]) if part]
                s = {"allOf": parts}
            return s
        if k < 0.7:
            return {"type": "array", "prefixItems": [self.schema(depth + 1) for _ in range(rng.randint(1, 3))]}
        if k < 0.78:
            s = {"type": "array", "items": self.schema(depth + 1)}
            r = rng.random()
            if r < 0.5:
                lo = rng.choice([0, 1, 2])
                s["minItems"] = lo
                if rng.random() < 0.6:
                    s["maxItems"] = lo + rng.choice([0, 1, 2])
            elif r < 0.65:
                s["maxItems"] = rng.choice([0, 1, 3])
            return s
        if k < 0.9:
            return {rng.choice(["anyOf", "oneOf"]): [self.schema(depth + 1) for _ in range(rng.randint(1, 3))]}
        name = rng.choice(["A", "B", "item"])
        if name not in self.defs:
            self.defs[name] = None  # (a reference back to a definition being written: recursion)
            self.defs[name] = self.schema(depth + 1)
        return {"$ref": f"#/$defs/{name}"}

    def root(self) -> dict:
        s = self.schema(0)
        if self.defs:
            s = dict(s, **{"$defs": {n: d if d is not None else {"type": "null"} for n, d in self.defs.items()}})
        return s


def random_text(g: Grammar, rng: random.Random, max_len: int = 400) -> str | None:
    """A sentence of g, chosen a character at a time among ALPHABET's (None: it did not end in max_len)."""
    s, out, stop = g.start, [], rng.choice([0.02, 0.1, 0.3])  # (how soon it ends where it may: short and long texts)
    for _ in range(max_len):
        if g.complete(s) and rng.random() < stop:
            return "".join(out)
        cands = list(ALPHABET)
        while cands:
            i = rng.choices(range(len(cands)), weights=[w for _, w in cands])[0]
            c = cands.pop(i)[0]
            t = g.step(s, ord(c))
            if t >= 0:
                s = t
                out.append(c)
                break
        else:
            return "".join(out) if g.complete(s) else None
    return "".join(out) if g.complete(s) else None


def _keys(v) -> list[str]:
    if isinstance(v, dict):
        return list(v) + [k for x in v.values() for k in _keys(x)]
    if isinstance(v, list):
        return [k for x in v for k in _keys(x)]
    return []


def known_difference(text: str, schema: dict, who: str) -> bool:
    """Whether text differs where sharpi_core.json_schema means to: an integer llama.cpp's range rules let through
    in error ("-0", leading zeros), or an additional property's key, where llama.cpp's rule past the declared
    names' prefixes takes raw backslashes and control characters (no JSON) and no escapes."""
    if who == "llama.cpp" and re.search(r"(?<![0-9.eE+-])-?0[0-9]|(?<![0-9.eE+-])-0(?![0-9.eE])", text):
        return True
    if not re.search(r'"additionalProperties": (true|\{)', json.dumps(schema)):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return who == "llama.cpp"
    return who == "sharpi" and any(re.search(r'["\\\x00-\x1f]', k) for k in _keys(value))


def accepts(g: Grammar, text: str) -> bool:
    return g.complete(g.after(text))


def main() -> None:
    ap = fuzz_args(__doc__, "libllama-common", 300, "schemas")
    ap.add_argument("--walks", type=int, default=150, help="random texts per grammar")
    a = ap.parse_args()
    from llamacpp_schema_gbnf import build
    rng = random.Random(a.seed)
    bad, counts = [], {"agree": 0, "sharpi refuses": 0, "llama.cpp fails": 0, "differ": 0}
    env = dict(os.environ, LD_LIBRARY_PATH=str(a.bin))
    with tempfile.TemporaryDirectory() as d:
        exe = build(a.src, a.bin, Path(d))
        for i in range(a.runs):
            schema = Gen(rng).root()
            r = subprocess.run([str(exe)], input=json.dumps(schema), env=env, capture_output=True, text=True)
            try:
                ours = Grammar(schema_to_grammar(schema))
            except (SchemaError, GrammarError) as e:  # (bounds no value meets, $ref recursion before any text)
                counts["sharpi refuses"] += 1
                if isinstance(e, GrammarError):  # a grammar llama.cpp's converter writes the same way
                    try:
                        Grammar(r.stdout)
                        print(f"case {i}: sharpi's grammar is refused ({e}), llama.cpp's is not\n"
                              f"    {json.dumps(schema)}", flush=True)
                        bad.append({"schema": schema, "texts": [], "llama_gbnf": r.stdout})
                    except GrammarError:
                        pass
                continue
            try:
                theirs = Grammar(r.stdout)
            except Exception as e:  # noqa: BLE001 (its converter's errors: a message, not a grammar)
                counts["llama.cpp fails"] += 1
                print(f"case {i}: llama.cpp's grammar does not parse ({e}; rc {r.returncode} {r.stderr[-200:]!r})\n"
                      f"    {json.dumps(schema)}", flush=True)
                continue
            found = []
            for gen_g, other, who in ((theirs, ours, "llama.cpp"), (ours, theirs, "sharpi")):
                for _ in range(a.walks):
                    t = random_text(gen_g, rng)
                    if t is not None and not accepts(other, t) and not known_difference(t, schema, who):
                        found.append((who, t))
                        break
            if found:
                counts["differ"] += 1
                for who, t in found:
                    print(f"case {i}: only {who}'s grammar takes {t!r}\n    {json.dumps(schema, ensure_ascii=False)}",
                          flush=True)
                bad.append({"schema": schema, "texts": found, "llama_gbnf": r.stdout})
            else:
                counts["agree"] += 1
            if (i + 1) % 50 == 0 or i + 1 == a.runs:
                print(f"{i + 1}/{a.runs} schemas: {counts}", flush=True)
    if a.log:
        a.log.write_text(json.dumps(bad, indent=1, ensure_ascii=False) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
