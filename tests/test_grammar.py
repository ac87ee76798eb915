"""Grammars (--grammar, -j/--json-schema): the parser and automaton, llama.cpp's greedy output under
grammars on the real models (tests/data/llamacpp_grammar.json, scripts/llamacpp_grammar.py), speculative
decoding under a grammar (greedy: the plain output; sampled: the masked target's law)."""
from __future__ import annotations

import itertools
import json
import math
import random
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SMOL, loaded
from sharpi_core.errors import UsageError
import sharpi_core.generate as generate_mod
from sharpi_core.generate import Generator
from sharpi_core.grammar import Grammar, GrammarError, GrammarTooAmbiguous, TokenGrammar, decode_utf8, grammar_need
from sharpi_core.json_schema import SchemaError, int_range, number_range, schema_to_grammar
from sharpi_core.sampling import SamplingParams, apply_penalties, draw, filtered_probs
from sharpi_core.speculative import DraftModelDrafter, LookupDrafter
from sharpi_core.speculative.draft_model import P_STOP
from test_generate import (ADAPTIVE, GREEDY, GREEDY_PEN, MIROSTAT, PROMPT, SAMPLED, SAMPLED_EXT, SAMPLED_PEN, V,
                           drafter_for, make, martingale_test, new_picker, target_model)
from toy import ToyTokenizer, _next_hash, chi2_test

CASES = json.loads((Path(__file__).parent / "data" / "llamacpp_grammar.json").read_text())


def walk(g: Grammar, text: str) -> int:
    """The automaton's state after `text` (-1: not a prefix of a sentence)."""
    return g.after(text)


def accepts(g: Grammar, text: str) -> bool:
    """Whether `text` is a whole sentence of g."""
    return g.complete(walk(g, text))


def prefix_ok(g: Grammar, text: str) -> bool:
    return walk(g, text) >= 0


# -- the parser and the automaton --------------------------------------------------------------------------
def test_syntax_and_language():
    g = Grammar(r'''
root ::= greet (", " name){1,3} "!"? end  # a comment
greet ::= "hi" | "hello"
name ::= [A-Z] [a-z]* | "\x41\u00e9"
end ::= ( "\n" ( [^\n\x00-\x1F] . )* )?
''')
    assert accepts(g, "hi, Bob") and accepts(g, "hello, Bob, Al, Ed!") and accepts(g, "hi, Aé")
    assert accepts(g, "hi, Bob!\nxy") and accepts(g, "hi, Bobzz")
    assert not accepts(g, "hi") and not accepts(g, "hi, Bob, A, B, C") and not accepts(g, "hi, bob")
    assert not accepts(g, "hi, Bob!\nx")  # pairs of characters after the newline
    assert prefix_ok(g, "hello, B") and not prefix_ok(g, "hey")


def test_repetition_bounds_match_their_definition():
    g = Grammar('root ::= "a"{2,4} "b"{3} "c"{1,} "d"?')
    for na in range(6):
        for nc in range(3):
            for nd in range(3):
                text = "a" * na + "bbb" + "c" * nc + "d" * nd
                assert accepts(g, text) == (2 <= na <= 4 and nc >= 1 and nd <= 1), text


def test_long_runs_of_optional_items():
    """{0,100} of eight optional items is a chain of 800 rules that can each be empty: expanded without
    recursion (it was refused as nested too deeply), the language that of the definition."""
    g = Grammar('root ::= ("a"? "a"? "a"? "a"? "a"? "a"? "a"? "a"?){0,100} "b"')
    assert accepts(g, "b") and accepts(g, "a" * 800 + "b") and accepts(g, "a" * 377 + "b")
    assert not accepts(g, "a" * 801 + "b") and not prefix_ok(g, "a" * 801) and not accepts(g, "a" * 5)


@pytest.mark.parametrize("text,fragment", [
    ("root ::= foo", "undefined rule 'foo'"),
    ("foo ::= \"a\"", "no 'root' rule"),
    ("root ::= root \"a\" | \"b\"", "left recursion in rule 'root'"),
    ("root ::= x \"a\"\nx ::= y? root\ny ::= \"b\"", "left recursion"),
    ("root ::= \"a", "end of input"),
    ("root ::= [a-", "end of input"),
    ("root ::= \"\\q\"", "unknown escape"),
    ("root ::= \"a\"{3,1}", "maximum is below the minimum"),
    ("root ::= \"a\"{2001}", "exceed the limit"),
    ("root ::= !\"a\"", "expecting '<'"),
    ("root ::= <[12", "expecting ']>'"),
    ("root ::= <[x]>", "expecting an integer"),
    ("root ::= <[4294967296]>", "too big"),
    ("root ::= <think", "expecting '>'"),
    ("root := \"a\"", "expecting ::="),
    ("root ::= \"a\" )", "expecting a newline"),
    ("root ::= \"a\" (", "expecting ')' at the end of the input"),
    ("root ::= \"a\"{2", "expecting ',' at the end of the input"),
    ("root ::= \"\\x4", "expecting 2 hex digits at '4'"),
])
def test_bad_grammars_are_one_error(text, fragment):
    with pytest.raises(GrammarError, match=None) as e:
        Grammar(text)
    assert fragment in str(e.value) and isinstance(e.value, UsageError)


def test_decode_utf8_is_llama_cpps():
    assert decode_utf8("é".encode()) == ([0xE9], 0xE9, 0)
    cps, v, n = decode_utf8("aé".encode()[:2])  # ends inside é
    assert cps == [ord("a")] and n == 1 and v == 0xC3 & 0x1F
    assert decode_utf8(b"\xa9", v, n)[0] == [0xE9]
    assert decode_utf8(b"\x80abc")[2] == -1  # a continuation byte first: invalid
    assert decode_utf8(b"a", 0x3, 1)[2] == -1  # a character left unfinished


# -- tokens -------------------------------------------------------------------------------------------------
class ByteTok:
    """Tokens 0..255 are single bytes, 256 is the end of generation."""
    n_vocab = 257
    eog_ids = frozenset({256})

    def token_bytes(self, tid, special=True):
        return bytes([tid]) if tid < 256 else b""


def test_split_characters_and_the_end_token():
    tg = TokenGrammar(Grammar('root ::= [ぁ-ゟ]+ "."'), ByteTok(), 257)
    st = tg.initial()
    assert not tg.allows(st, 256) and not tg.allows(st, ord("."))
    b = "の".encode()
    assert tg.allows(st, b[0]) and not tg.allows(st, 0xE4)  # a lead byte whose characters are not hiragana
    st = tg.advance(st, b[0])
    assert tg.allows(st, b[1]) and not tg.allows(st, ord("a"))
    st = tg.advance_all(st, b[1:] + b".")
    assert tg.allows(st, 256) and not tg.allows(st, ord("a"))
    m = tg.mask(st)
    assert m.sum() == 1 and m[256]


@pytest.mark.parametrize("need", [1, 3, None])
def test_constrain_keeps_the_best_allowed_tokens(need):
    rng = np.random.default_rng(5)
    tg = TokenGrammar(Grammar('root ::= [a-m] [0-9]'), ByteTok(), 257)
    for st in (tg.initial(), tg.advance(tg.initial(), ord("c"))):
        for _ in range(20):
            x = rng.standard_normal(257).astype(np.float32)
            x[rng.integers(0, 257, 40)] = 1.0  # ties
            out = tg.constrain(x, st, need)
            mask = tg.mask(st)
            allowed = np.flatnonzero(mask)
            order = allowed[np.lexsort((allowed, -x[allowed]))]
            want = order if need is None else order[:need]
            assert sorted(np.flatnonzero(out > -np.inf).tolist()) == sorted(want.tolist())
            assert np.array_equal(out[want], x[want])


@pytest.mark.parametrize("width", [100, 300])
def test_constrain_takes_rows_narrower_or_wider_than_the_vocabulary(width):
    # a draft model's output layer cut to its first ids, or a few ids wider than the target's vocabulary
    tg = TokenGrammar(Grammar('root ::= [0-9a-z]'), ByteTok(), 257)
    x = np.random.default_rng(6).standard_normal(width).astype(np.float32)
    want = [t for t in range(min(width, 257)) if tg.allows(tg.initial(), t)]
    assert np.flatnonzero(tg.constrain(x, tg.initial(), None) > -np.inf).tolist() == want
    assert np.flatnonzero(tg.constrain(x, tg.initial(), 3) > -np.inf).tolist() == sorted(
        sorted(want, key=lambda t: -x[t])[:3])


def test_grammar_need_follows_the_chain():
    assert grammar_need(SamplingParams(temp=0)) == 1
    assert grammar_need(SamplingParams(temp=0.8, top_k=40)) == 40
    assert grammar_need(SamplingParams(temp=0.8, top_k=0)) is None
    assert grammar_need(SamplingParams(temp=0.8, top_k=40, top_n_sigma=1.0)) is None
    assert grammar_need(SamplingParams(temp=0.8, top_k=40, samplers=("top_p", "top_k", "temperature"))) is None
    assert grammar_need(SamplingParams(temp=0.8, mirostat=2)) is None


# -- JSON schemas -------------------------------------------------------------------------------------------
def test_schema_languages():
    g = Grammar(schema_to_grammar({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", 2]},
                                   "c": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}},
                                   "required": ["b"]}))
    assert accepts(g, '{"b":"x"}') and accepts(g, '{ "b": 2, "a": -12, "c": [true, false] }')
    assert accepts(g, '{"b":2,"c":[true]}') and accepts(g, '{\n  "b": 2\n}')
    assert not accepts(g, '{"a":1,"b":2}')  # required properties come first, in schema order
    assert not accepts(g, '{"b":3}') and not accepts(g, '{"b":2,"c":[]}') and not accepts(g, '{"b":2,"c":[true,true,true]}')
    assert not accepts(g, '{"b":2 ,"a":1}') and not accepts(g, '{"b":2,"a":01}')
    g = Grammar(schema_to_grammar({"type": "object", "properties": {"id": {"type": "integer"}},
                                   "additionalProperties": {"type": "string"}}))
    assert accepts(g, '{"id":1,"idx":"s","n":"t"}') and accepts(g, '{"x":"y"}') and accepts(g, "{}")
    assert not accepts(g, '{"idx":1}') and not accepts(g, '{"x":"y","id":1}')
    assert not accepts(g, '{"x":"y","id":"z"}')  # a declared key is not an additional one
    g = Grammar(schema_to_grammar({"type": "string", "minLength": 2, "maxLength": 3}))
    assert [accepts(g, '"' + "a" * n + '"') for n in range(5)] == [False, False, True, True, False]
    g = Grammar(schema_to_grammar({"$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"},
                                                                                                     {"type": "null"}]}},
                                               "required": ["next"]}}, "$ref": "#/$defs/n"}))
    assert accepts(g, '{"next":{"next":null}}') and not accepts(g, '{"next":{}}')


def test_integer_ranges_are_exact():
    rng = random.Random(0)
    for lo, hi in [(0, 0), (0, 9), (-9, 9), (-1, -1), (10, 99), (105, 105), (-105, -100), (-123, 4567), (0, 10 ** 6)] + \
            [(a, a + rng.randint(0, 2500)) for a in (rng.randint(-1500, 1500) for _ in range(40))]:
        g = Grammar("root ::= " + int_range(lo, hi))
        for x in range(lo - 30, hi + 31, 1 if hi - lo < 3000 else 97):
            assert accepts(g, str(x)) == (lo <= x <= hi), (lo, hi, x)
        assert not any(accepts(g, t) for t in ("-0", "00", "01", "-01", "", "-", "+1"))


def test_number_ranges_are_exact():
    texts = {f"{sign}{i}{f}" for sign in ("", "-") for i in range(13)
             for f in ("", ".0", ".00", ".5", ".05", ".001", ".999", ".10")}
    texts |= {"00", "01.5", "1e3", "1.", ".5", "+1", "9" * 16, "9" * 17, "-" + "9" * 16 + ".5"}
    for lo, hi in [(None, None), (None, 0), (0, None), (None, -3), (4, None)] + [(a, b) for a in range(-5, 6, 2)
                                                                                for b in range(a, a + 6)]:
        for lo_strict, hi_strict in itertools.product((False, True), repeat=2):
            if lo is None and lo_strict or hi is None and hi_strict or lo is not None and lo == hi and (lo_strict or hi_strict):
                continue
            g = Grammar("root ::= " + number_range(lo, lo_strict, hi, hi_strict))
            for t in texts:
                ok = re.fullmatch(r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?", t) is not None
                if ok:
                    x = Fraction(t)
                    ok = (lo is None or (x > lo if lo_strict else x >= lo)) and not (t[0] == "-" and x == 0) \
                        and (hi is None or (x < hi if hi_strict else x <= hi))
                assert accepts(g, t) == ok, (lo, lo_strict, hi, hi_strict, t)


def test_schema_integer_bounds():
    def ints(schema):
        g = Grammar(schema_to_grammar({"type": "integer", **schema}))
        return [x for x in range(-30, 31) if accepts(g, str(x))]
    assert ints({"minimum": 3, "maximum": 7}) == [3, 4, 5, 6, 7]
    assert ints({"exclusiveMinimum": 3, "exclusiveMaximum": 7}) == [4, 5, 6]
    assert ints({"minimum": 2.5, "maximum": 4.5}) == [3, 4] == ints({"exclusiveMinimum": 2.5, "exclusiveMaximum": 4.5})
    assert ints({"minimum": 3, "exclusiveMinimum": True, "maximum": 7, "exclusiveMaximum": True}) == [4, 5, 6]  # draft 4
    assert ints({"minimum": 3, "exclusiveMinimum": 5, "maximum": 9}) == [6, 7, 8, 9]  # both: the tighter
    assert ints({"minimum": 25}) == [25, 26, 27, 28, 29, 30] and ints({"maximum": -28}) == [-30, -29, -28]
    g = Grammar(schema_to_grammar({"type": "integer", "minimum": 105}))
    assert accepts(g, "9" * 16) and not accepts(g, "9" * 17) and not accepts(g, "15")


def test_schema_bounds_past_16_digits_and_odd_keywords():
    """Bounds past what the rules write (int64's, 1e20) bound nothing they can write: the 16-digit rule; uuid1-5
    are uuid (llama.cpp's ^uuid[1-5]?$); string lengths without a type are any value (they constrain strings only,
    as llama.cpp's converter); a byte order mark before the schema is skipped (as nlohmann's parser)."""
    g = Grammar(schema_to_grammar({"type": "integer", "minimum": -9223372036854775808, "maximum": 9223372036854775807}))
    assert all(accepts(g, t) for t in ("0", "-7", "9" * 16, "-" + "9" * 16)) and not accepts(g, "9" * 17)
    g = Grammar(schema_to_grammar({"type": "integer", "minimum": 5, "maximum": 1e20}))
    assert accepts(g, "5") and accepts(g, "9" * 16) and not accepts(g, "4") and not accepts(g, "9" * 17)
    g = Grammar(schema_to_grammar({"type": "number", "exclusiveMinimum": 0, "maximum": 1e20}))
    assert accepts(g, "0.5") and accepts(g, "9" * 16) and not accepts(g, "0") and not accepts(g, "-1")
    g = Grammar(schema_to_grammar({"type": "string", "format": "uuid4"}))
    assert accepts(g, '"123e4567-e89b-42d3-a456-426614174000"') and not accepts(g, '"x"')
    said = []
    g = Grammar(schema_to_grammar({"maxLength": 3}, said.append))
    assert all(accepts(g, t) for t in ("5", '"abcdef"', "[1]", "null")) and said == ["#: maxLength without type string not enforced"]
    g = Grammar(schema_to_grammar('\ufeff{"type": "integer"}'))
    assert accepts(g, "12") and not accepts(g, '"12"')


def test_schemas_llama_cpps_converter_writes_wrongly():
    """Where llama.cpp's converter writes a grammar whose JSON breaks the schema (or is no JSON): a name two
    allOf parts define (its key written twice), allOf parts with no properties (`{}` whatever the type), an
    additional key with a raw backslash, prefixItems beside items (items alone), a property named like the
    additional properties' marker."""
    def langs(schema, texts):
        g = Grammar(schema_to_grammar(schema))
        return [accepts(g, t) for t in texts]
    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert langs({"allOf": [base, {"type": "object", "properties": {"a": {"minimum": 0}}, "required": ["a"]}]},
                 ['{"a":1}', '{"a":-1}', '{"a":1,"a":2}', '{"a":"x"}']) == [True, False, False, False]
    assert langs({"type": "string", "allOf": [{"minLength": 3}]}, ['"abc"', '"ab"', "{}"]) == [True, False, False]
    assert langs({"allOf": [{"type": "integer"}, {"maximum": 5}]}, ["5", "6", '"x"', "{}"]) == [True, False, False, False]
    assert langs({"allOf": [{"anyOf": [{"type": "string"}, {"type": "integer"}]}]}, ['"a"', "5", "{}"]) == [True, True, False]
    assert langs({"$defs": {"I": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/I"}, {"maximum": 5}]},
                 ["5", "6", '"x"']) == [True, False, False]
    with pytest.raises(SchemaError, match="enums share no value"):  # (["a", "a"] counted "a" as in both)
        schema_to_grammar({"allOf": [{"enum": ["a", "a"]}, {"enum": ["b"]}]})
    extra = {"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": True}
    assert langs(extra, ['{"\\":1}', '{"\\"q":1}', '{"\\\\q":1}', '{"x\\n":1}', '{"idx":1}']) == [False, True, True, True, True]
    tup = {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}
    assert langs(tup, ["[1]", '[1,"a","b"]', '["a"]', "[1,2]"]) == [True, True, False, False]
    assert langs({**tup, "items": False}, ["[1]", '[1,"a"]']) == [True, False]
    assert langs({"type": "array", "items": False}, ["[]", "[1]"]) == [True, False]
    assert langs({"properties": {"*": {"type": "integer"}}}, ['{"*":1}', '{"*":1,"*":2}']) == [True, False]
    # a #/$defs/ reference walks from the root, as the fixtures' llama.cpp resolves it (json-schema.cpp resolve_ref;
    # a $defs nested in a property is #/properties/a/$defs/X), so one to a nested $defs points nowhere
    nested = {"type": "object", "properties": {"a": {"$defs": {"X": {"type": "integer"}}, "$ref": "#/$defs/X"}},
              "$defs": {"Y": {"type": "string"}}}
    with pytest.raises(SchemaError, match="points nowhere"):
        schema_to_grammar(nested)
    nested["properties"]["a"]["$ref"] = "#/properties/a/$defs/X"
    assert langs(nested, ['{"a":1}', '{"a":"x"}']) == [True, False]
    assert langs({"properties": {"*": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
                 ['{"*":1}', '{"*":1,"x":"y"}', '{"*":"y"}']) == [True, True, False]
    said = []
    schema_to_grammar({"type": "object", "description": "d", "properties": {"a": {}}, "anyOf": [{"required": ["a"]}]},
                      said.append)
    schema_to_grammar({"type": "string", "format": "date", "maxLength": 5}, said.append)
    assert said == ["#: type, properties beside anyOf not enforced (write them into each alternative)",
                    "#: maxLength not enforced together with a format"]


def test_many_optional_properties_make_a_grammar_that_grows_linearly():
    """Each alternative (which optional property comes first) shares one rule per property for the ones after it,
    as llama.cpp's <key>-rest rules: a rule per alternative and key grew as n^2 (300 properties: 1.7 MB, 8 s to
    parse; 1000: a RecursionError)."""
    for n in (30, 1000):
        text = schema_to_grammar({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})
        assert len(text) < 100 * n
    g = Grammar(text)
    assert accepts(g, "{}") and accepts(g, '{"p5":1,"p7":2}') and accepts(g, '{"p999":1}')
    assert accepts(g, "{" + ",".join(f'"p{i}":{i}' for i in range(0, 1000, 7)) + "}")
    assert not accepts(g, '{"p7":1,"p5":2}') and not accepts(g, '{"p5":1,"p5":2}') and not accepts(g, '{"p5":1,}')


def test_nested_repetitions_neither_hang_nor_change_the_language():
    """(a+)+ nested 22 deep kept exponentially many parse stacks (gigabytes, minutes for 8 characters): a pattern's
    nested loops are written as one, and a grammar that still multiplies them is an error, not a hang."""
    deep = "^" + "(" * 22 + "a+" + ")+" * 22 + "$"
    g = Grammar(schema_to_grammar({"type": "string", "pattern": deep}))
    assert accepts(g, '"' + "a" * 300 + '"') and not accepts(g, '""') and not accepts(g, '"ab"')
    for pattern, want in (("^(a+)+$", r"a+"), ("^(a*)+$", r"a*"), ("^(a?)+$", r"a*"), ("^(a+)?$", r"a*"),
                          ("^(a?)?$", r"a?"), ("^((ab)+)*$", r"(ab)*"), ("^(a{2,})+$", r"a{2,}"), ("^(a+){2}$", r"a{2,}"),
                          ("^(a|bc?)+?$", r"(a|bc?)+")):
        g = Grammar(schema_to_grammar({"type": "string", "pattern": pattern}))
        for n in range(7):
            for t in itertools.product("abc", repeat=n):
                t = "".join(t)
                assert accepts(g, f'"{t}"') == (re.fullmatch(want, t) is not None), (pattern, t)
    g = Grammar("root ::= " + "(" * 22 + '"a"' + ")+" * 22 + ' "b"')
    with pytest.raises(GrammarTooAmbiguous, match="ways to parse"):
        accepts(g, "a" * 12 + "b")


def test_a_grammar_that_multiplies_its_parses_while_generating_exits_1():
    """Found while generating, after text was printed: a failure of the run (exit 1, as the README has it), not a
    bad flag value (exit 2, as it exited)."""
    from test_cli import one_error_line, sharpi
    from conftest import SMOL, model_path
    deep = "root ::= " + "(" * 22 + '"a"' + ")+" * 22
    r = sharpi("-m", model_path(SMOL), "-p", "x", "-n", 40, "--temp", 0, "--grammar", deep)
    one_error_line(r, 1, "ways to parse the text so far")
    assert r.stdout.startswith("x")


def test_schema_patterns_match_like_a_regex_search():
    """A string's JSON text is accepted iff the pattern finds a match in the string (Python's re as the
    reference, on patterns and strings where its syntax and ECMA-262's agree)."""
    rng = random.Random(0)
    alphabet = list("abcdxyz019-.@ _AB{}]\"\\") + ["\n", "\t", "é", "字", "\x01"]
    strings = ["".join(c) for n in range(3) for c in itertools.product(alphabet, repeat=n)]
    strings += ["".join(rng.choice(alphabet) for _ in range(rng.randint(3, 9))) for _ in range(400)]
    strings += ["a@b.com", "555-1234", "ababcd", "aab", "aabcc", 'x"y', "x\\y"]
    for pattern in [r"^[a-z]+$", r"^\d{3}-\d{4}$", r"ab", r"^a|b$", r"^(ab|c)*d?$", r"^[^a-c\d]{2,3}$", r"^.+$", r"^x.y$",
                    r'^"\\$', r"^\w+@\w+\.com$", r"^[\s\S]$", r"^a{2}b{1,}c{0,2}$", r"^(?:a|bc)+?$", r"^[\]\-a]+$",
                    r"^\x41\u0042$", r"a\.b", r"^(a(b(c)?)?)$", r"^$", r"^\t\n$", r"^[^x]$", r"^(?<n>ab)+$", r"x*",
                    r"^{a}$", r"^[\W]+$", r"^(a*)*$", r"^(a|)+b$", r"^(?:)*$", r"^(a{0})*b$", r"^([a-c]*\.?)*$",
                    r"^(a?b?){2,}$", r"^((a|)(b|)){3}$", r"^|a$"]:
        g = Grammar(schema_to_grammar({"type": "string", "pattern": pattern}))
        py = re.compile(re.sub(r"\$$", r"\\Z", pattern.replace("(?<", "(?P<").replace("{,", "{0,")), re.ASCII)
        for v in strings:
            assert accepts(g, json.dumps(v, ensure_ascii=False)) == (py.search(v) is not None), (pattern, v)
    g = Grammar(schema_to_grammar({"type": "string", "pattern": "^x.y$"}))  # ECMA's dot: no line terminators
    assert [accepts(g, json.dumps(f"x{c}y", ensure_ascii=False)) for c in "\n\r\u2028\u2029\"\\\t\x7f"] == [False] * 4 + [True] * 4
    assert not accepts(g, '"x"y"') and not accepts(g, '"x\\y"')  # JSON text: a quote or backslash only escaped
    g = Grammar(schema_to_grammar({"type": "string", "pattern": "^a{,2}\\uD83D\\uDE00$"}))  # ECMA: {,2} is text
    assert accepts(g, '"a{,2}😀"') and not accepts(g, '"aa😀"') and not accepts(g, '"a{,2}\\ud83d\\ude00"')


LLAMA_SCHEMAS = json.loads((Path(__file__).parent / "data" / "llamacpp_schema_gbnf.json").read_text())


@pytest.mark.parametrize("case", LLAMA_SCHEMAS, ids=[json.dumps(c["schema"]) for c in LLAMA_SCHEMAS])
def test_schema_languages_are_llama_cpps(case):
    """Against the grammars llama.cpp writes (scripts/llamacpp_schema_gbnf.py): patterns, the same language
    on strings JSON writes raw; integers, llama.cpp's less the texts it lets through in error (outside a
    one-sided bound, leading zeros, "-0")."""
    schema, rng = case["schema"], random.Random(1)
    ours, theirs = Grammar(schema_to_grammar(schema)), Grammar(case["gbnf"])
    if schema["type"] == "integer":
        texts = [str(x) for x in range(-300, 300)] + [str(rng.randint(-10 ** 17, 10 ** 17) // 10 ** rng.randint(0, 16))
                                                      for _ in range(2000)]
        texts += ["-0", "05", "-05", "007", "1" + "0" * 15, "9" * 16, "-" + "9" * 16, "9" * 17]
        big = 10 ** 20
        lo = max(math.ceil(schema.get("minimum", -big)), math.floor(schema.get("exclusiveMinimum", -big)) + 1)
        hi = min(math.floor(schema.get("maximum", big)), math.ceil(schema.get("exclusiveMaximum", big)) - 1)
        for t in texts:
            valid = re.fullmatch(r"-?(0|[1-9][0-9]{0,15})", t) is not None and t != "-0" and lo <= int(t) <= hi
            assert accepts(ours, t) == (accepts(theirs, t) and valid), t
        return
    alphabet = list("abcdefoz0123456789-.()ABé") + ["xy"]
    texts = ["".join(c) for n in range(4) for c in itertools.product(alphabet[:14], repeat=n)]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14))) for _ in range(3000)]
    texts += ["foo-12", "baz-123", "Aé.()", "555-123-4567", "123-4567", "aabbee", "Abcdef"]
    for t in texts:
        assert accepts(ours, f'"{t}"') == accepts(theirs, f'"{t}"'), t


WALKS = json.loads((Path(__file__).parent / "data" / "llamacpp_grammar_walks.json").read_text())


def _ids(text: str, n_vocab: int) -> np.ndarray:
    """A recorded set of ids: "lo-hi,..." ranges, or "~lo-hi,...": all ids but those."""
    body = text.lstrip("~")
    ids = np.array(sorted({i for r in body.split(",") if r for i in range(int(r.split("-")[0]), int(r.split("-")[1]) + 1)}),
                   dtype=np.int64)
    return np.setdiff1d(np.arange(n_vocab), ids) if text.startswith("~") else ids


@pytest.mark.parametrize("case", WALKS["cases"], ids=[f"{c['origin']}-{i}" for i, c in enumerate(WALKS["cases"])])
def test_grammar_walks_are_llama_cpps(case):
    """Against llama.cpp's grammar sampler (scripts/fuzz_grammar.py --record): whether it takes the grammar,
    and the tokens it allows at each step of a walk along its own picks, over the whole vocabulary."""
    from test_tokenizer import tok as vocab_of
    tok = vocab_of(WALKS["model"])
    assert tok.n_vocab == WALKS["n_vocab"]
    if case["refused"]:
        with pytest.raises(GrammarError):  # (a token reference by a text that is no one token: when bound)
            TokenGrammar(Grammar(case["grammar"]), tok, tok.n_vocab)
        return
    tg = TokenGrammar(Grammar(case["grammar"]), tok, tok.n_vocab)
    st = tg.initial()
    for allowed, picked in case["steps"]:
        want = _ids(allowed, tok.n_vocab)
        assert np.array_equal(np.flatnonzero(tg.mask(st)), want)
        x = np.random.default_rng(picked + 2).standard_normal(tok.n_vocab).astype(np.float32)
        out = tg.constrain(x, st, 1)
        best = want[np.argmax(x[want])] if want.shape[0] else None
        assert (out is None) if best is None else (np.flatnonzero(out > -np.inf).tolist() == [best])
        if picked < 0 or picked in tg.eog:
            break
        st = tg.advance(st, picked)


def test_left_recursion_is_refused_where_llama_cpp_refuses_it_or_would_loop():
    """llama.cpp passes over a leftmost reference only to a rule with an empty alternative of its own; a left
    recursion its check misses runs there where the parse stacks stay bounded (taken here, with the same
    language), and loops there, growing, where they do not (refused here)."""
    for text in ['root ::= x* "b"\nx ::= | "a"', 'root ::= root "a" | "b"']:
        with pytest.raises(GrammarError, match="left recursion"):
            Grammar(text)
    g = Grammar('root ::= x* "b"\nx ::= y\ny ::= "" | "c"')
    assert accepts(g, "b") and accepts(g, "cccb") and not accepts(g, "cbc") and not accepts(g, "")
    g = Grammar('root ::= (("a"?)* ",")+')
    assert accepts(g, ",") and accepts(g, "aa,,a,") and not accepts(g, "a")
    for text in ['root ::= x root "a" | "b"\nx ::= y\ny ::= "" | "c"',       # grows at the start
                 'root ::= "a" x\nx ::= y x "b" | "c"\ny ::= z\nz ::= "" | "d"',  # after "a"
                 'root ::= x\nx ::= y "b"\ny ::= w x\nw ::= v\nv ::= "" | "e"']:  # through two rules
        with pytest.raises(GrammarError, match="left recursion"):
            Grammar(text)
    Grammar('root ::= "a"\nx ::= y x "b" | "c"\ny ::= z\nz ::= "" | "d"')  # not reachable: llama.cpp runs it


class MiniTok:
    """Tokens "a", "b", "ab", "<x>" (a special token: its text is one token), an end of generation, "<", ">"."""
    pieces = [b"a", b"b", b"ab", b"<x>", b"", b"<", b">"]
    n_vocab = 7
    eog_ids = frozenset({4})

    def token_bytes(self, tid, special=True):
        return self.pieces[tid]

    def encode(self, text, add_special=False, parse_special=True):
        out, i = [], 0
        while i < len(text):  # (longest first)
            t = next(t for t in (3, 2, 0, 1, 5, 6) if text.startswith(self.pieces[t].decode(), i))
            out.append(t)
            i += len(self.pieces[t])
        return out


def test_token_references():
    """<[id]>, <text> (the one token the text gives), !<...>: a token matched by id where the reference is the next
    thing to match, whatever its text; llama.cpp's mask also lets a token through whose id a reference matches after
    characters of its own text, then aborts taking it: here it is not allowed."""
    tok = MiniTok()

    def allowed(text, *before):
        tg = TokenGrammar(Grammar(text), tok, 7)
        return np.flatnonzero(tg.mask(tg.advance_all(tg.initial(), before))).tolist()

    assert allowed('root ::= <x> "a"') == [3] and allowed('root ::= <x> "a"', 3) == [0]
    assert allowed('root ::= <[3]> "a"') == [3] and allowed('root ::= <[2]>') == [2] and allowed('root ::= <[2]>', 2) == [4]
    assert allowed('root ::= !<[2]>') == [0, 1, 3, 5, 6] and allowed('root ::= !<x>', 0) == [4]
    assert allowed('root ::= "a" !<[0]>') == [0] and allowed('root ::= "a" !<[0]>', 0) == [1, 2, 3, 5, 6]  # not "ab" first
    assert allowed('root ::= "a" <[1]> | "a" "b"') == [0, 2] and allowed('root ::= "a" <[1]> | "a" "b"', 0) == [1]
    assert allowed('root ::= <[9]> | "b"') == [1] and allowed('root ::= !<[9]> "a"') == [0, 1, 2, 3, 5, 6]
    with pytest.raises(GrammarError, match="invalid token '<a>'"):  # "<", "a", ">": not one token
        TokenGrammar(Grammar('root ::= "b" <a>'), tok, 7)


def test_a_token_completing_no_character_leaves_the_text_unfinished():
    """llama.cpp drops the finished parse after every token; one that completes a character may finish it again."""
    tg = TokenGrammar(Grammar('root ::= "a" "\u00e9"?'), ByteTok(), 257)
    st = tg.advance(tg.initial(), ord("a"))
    assert tg.allows(st, 256) and tg.allows(st, 0xC3)
    st = tg.advance(st, 0xC3)
    assert not tg.allows(st, 256) and tg.allows(st, 0xA9) and not tg.allows(st, 0xA8)
    assert tg.allows(tg.advance(st, 0xA9), 256)


def test_a_grammar_ends_where_some_finite_text_matches_its_root():
    assert Grammar('root ::= "a" | "[" root "]"').ends() and Grammar('root ::= x*\nx ::= "[" x "]"').ends()
    assert not Grammar('root ::= "[" root "]"').ends() and not Grammar('root ::= "a" x\nx ::= "b" x | "c" root').ends()
    assert Grammar(schema_to_grammar({"type": "array", "items": {"$ref": "#"}})).ends()  # [] ends it
    assert not Grammar(schema_to_grammar({"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]})).ends()


def test_schema_warnings_for_what_is_not_enforced():
    said = []
    schema_to_grammar({"type": "object", "properties": {"x": {"type": "number", "minimum": 0.5},
                                                        "s": {"type": "string", "pattern": "^a+$", "maxLength": 3},
                                                        "t": {"type": "string", "maxLength": 5000}}},
                      said.append)
    assert len(said) == 3 and "whole numbers" in said[0] and "maxLength" in said[1] and "above 2000" in said[2]
    # validation keywords no grammar expresses, and formats other than date / time / date-time / uuid: named once
    said.clear()
    schema = {"type": "object", "minProperties": 1, "properties": {
        "e": {"type": "string", "format": "email"}, "d": {"type": "string", "format": "date"},
        "n": {"type": ["integer", "null"], "multipleOf": 5}, "u": {"type": "array", "items": {}, "uniqueItems": True},
        "c": {"if": {"type": "string"}, "then": {"minLength": 2}, "not": {"const": "x"}}}}
    plain = schema_to_grammar(schema, said.append)
    assert said == ["#: minProperties not enforced", '#/properties/e: format "email" not enforced (date, time, '
                    'date-time and uuid are)', "#/properties/n: multipleOf not enforced",
                    "#/properties/u: uniqueItems not enforced", "#/properties/c: not, if, then not enforced"]
    assert plain == schema_to_grammar(schema)  # (the grammar is the same: only the warnings are new)
    # what llama.cpp's converter drops without a word: allOf's parts other than objects and enums (named), a
    # required name no property has (required here, any value or additionalProperties' schema: its output never
    # had the key)
    said.clear()
    schema_to_grammar({"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "string"}]}, said.append)
    assert said == ["#/allOf: parts other than objects and enums not enforced (their properties and shared enum "
                    "values are what it combines)"]
    g = Grammar(schema_to_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}))
    assert [accepts(g, t) for t in ('{"a":1}', '{"a":1,"b":[true]}', '{"b":1,"a":1}', '{"a":1,"b":1,"c":1}')] == [False, True, False, False]
    g = Grammar(schema_to_grammar({"type": "object", "required": ["b"], "additionalProperties": {"type": "string"}}))
    assert [accepts(g, t) for t in ('{}', '{"b":"x"}', '{"b":1}', '{"b":"x","c":"y"}')] == [False, True, False, True]
    # enum / const values the type rules out are left out (llama.cpp's converter writes them all)
    g = Grammar(schema_to_grammar({"type": ["number", "null"], "enum": [1, "a", True, None, 1.5, [1]]}))
    assert [accepts(g, t) for t in ("1", '"a"', "true", "null", "1.5", "[1]")] == [True, False, False, True, True, False]
    g = Grammar(schema_to_grammar({"type": ["string", "integer"], "const": 2.0}))
    assert accepts(g, "2.0") and not accepts(g, '"2.0"')
    g = Grammar(schema_to_grammar({"type": "array", "minItems": 2, "maxItems": 2}))
    assert [accepts(g, t) for t in ("[1]", "[1,2]", "[1,2,3]")] == [False, True, False]
    g = Grammar(schema_to_grammar({"type": "number", "exclusiveMinimum": 0, "maximum": 1}))
    assert [accepts(g, t) for t in ("0", "0.0", "0.25", "1", "1.00", "1.5", "-0.5", "2e-1")] == [False] * 2 + [True] * 3 + [False] * 3


@pytest.mark.parametrize("schema,fragment", [
    ('{"type": "string", "pattern": "^a(?=b)$"}', "lookaround"),
    ('{"type": "string", "pattern": "^(a)\\\\1$"}', "backreferences"),
    ('{"type": "string", "pattern": "\\\\bword"}', "word boundaries"),
    ('{"type": "string", "pattern": "a^b"}', "anchors"),
    ('{"type": "string", "pattern": "^(a$"}', "missing ')'"),
    ('{"type": "string", "pattern": "^*a"}', "nothing to repeat"),
    ('{"type": "string", "pattern": "^[]$"}', "empty character class"),
    ('{"type": "string", "pattern": "^a{3,1}$"}', "out of order"),
    ('{"type": "integer", "minimum": 7, "maximum": 3}', "no integer lies within"),
    ('{"type": "integer", "minimum": "3"}', "minimum must be a number"),
    ('{"type": "number", "minimum": 1e17}', "no number of at most 16 integer digits lies within"),
    ('{"type": "number", "minimum": 1, "exclusiveMaximum": 1}', "no number lies within"),
    ('{"type": "string", "pattern": "^a{0,5000}$"}', "above 2000"),
    ('{"type": "string", "pattern": "^\\\\uD83D$"}', "lone surrogate"),
    ('{"type": "string", "pattern": "' + "(" * 101 + "a" + ")" * 101 + '"}', "nested more than 100 deep"),
    ('{"type": "integer", "minimum": 1e17}', "no integer of at most 16 digits lies within"),
    ('{"type": "integer", "maximum": -1e17}', "no integer of at most 16 digits lies within"),
    ('{"type": "array", "minItems": 5000}', "minItems above 2000 is not supported"),
    ('{"type": "frobnicate"}', "unknown type"),
    # bounds no value meets: refused, not written as a grammar that lets a value break them
    ('{"type": "string", "minLength": 5, "maxLength": 2}', "no string fits (minLength 5 is above maxLength 2)"),
    ('{"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}', "no array fits"),
    ('{"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": false}',
     'required "b" not among its properties'),
    ('{"type": "string", "const": 1}', "no value fits (its const is not of type string)"),
    ('{"type": ["integer", "null"], "enum": [true, "1", 1.5]}', "no value fits (no enum value is of type integer or null)"),
    ('{"$ref": "#/$defs/none"}', "points nowhere"),
    ('{"type": ', "not JSON"),
    # what llama.cpp's JSON parser refuses, Python's reads (and wrote NaN, Infinity, ill-formed UTF-8)
    ('{"const": NaN}', "not JSON: NaN is not a JSON value"),
    ('{"enum": [-Infinity]}', "not JSON: -Infinity is not a JSON value"),
    ('{"const": 1e400}', "not JSON: number 1e400 is out of range"),
    ('{"const": "\\ud800"}', "not JSON: a lone surrogate \\ud800 in a string"),
    ('{"properties": {"\\udc00": {}}}', "not JSON: a lone surrogate \\udc00"),
])
def test_bad_schemas_are_one_error(schema, fragment):
    with pytest.raises(SchemaError) as e:
        schema_to_grammar(schema)
    assert fragment in str(e.value)


# -- llama.cpp's output under grammars, on the real models ---------------------------------------------------
def _case_param(c):
    marks = () if c["model"] == SMOL else (pytest.mark.slow,)
    return pytest.param(c, id=c["name"], marks=marks)


def generate(model, tok, case, drafter=None, params=SamplingParams(temp=0)):
    text = case["grammar"] if case["grammar"] is not None else schema_to_grammar(case["schema"])
    tg = TokenGrammar(Grammar(text), tok, int(model.config.n_vocab))
    gen = Generator(model, model.new_cache(512), tok, params, drafter=drafter, spec_n_max=4, grammar=tg)
    return gen.generate(tok.encode(case["prompt"]), n_predict=case["n"])


@pytest.mark.parametrize("case", [_case_param(c) for c in sorted(CASES, key=lambda c: c["model"] != SMOL)])
def test_greedy_output_is_llama_cpps(case):
    model, tok = loaded(case["model"])
    res = generate(model, tok, case)
    assert b"".join(tok.token_bytes(t, special=False) for t in res.tokens).hex() == case["output_hex"]
    assert (res.stop_reason == "eos") == case["eos"]
    if not case["eos"]:
        assert len(res.tokens) == case["n"]
    if case["model"] == SMOL:  # speculation under the grammar: the same tokens
        spec = generate(model, tok, case, LookupDrafter(3, 2))
        assert spec.tokens == res.tokens
        # the model drafting for itself, under the grammar too: every proposal is the target's pick
        d = DraftModelDrafter(model, model.new_cache(512), SamplingParams(temp=0))
        spec = generate(model, tok, case, d)
        assert spec.tokens == res.tokens and spec.stop_reason == res.stop_reason
        assert spec.spec.accepted == spec.spec.drafted > 0


# -- the generator on toy models ------------------------------------------------------------------------------
TOY_GRAMMAR = 'root ::= ( [abc] [defgh] | "h" [a-e] | "g" )+'


def toy_grammar(eog=()):
    return TokenGrammar(Grammar(TOY_GRAMMAR), ToyTokenizer(V, eog=eog), V)


def toy_allowed(tg, prompt_free_tokens):
    st = tg.initial()
    for t in prompt_free_tokens:
        assert tg.allows(st, t), prompt_free_tokens
        st = tg.advance(st, t)


@pytest.mark.parametrize("kind", ["model", "lookup", "same", "wide", "hybrid"])
@pytest.mark.parametrize("params", [GREEDY, GREEDY_PEN], ids=["greedy", "penalties"])
def test_greedy_speculation_under_a_grammar_is_plain_greedy(kind, params):
    plain, _ = make(params, grammar=toy_grammar())
    ref = plain.generate(PROMPT, n_predict=60)
    gen, _ = make(params, drafter_for(kind, params, target_model()), spec_n_max=4, grammar=toy_grammar())
    res = gen.generate(PROMPT, n_predict=60)
    assert res.tokens == ref.tokens
    toy_allowed(toy_grammar(), ref.tokens)
    free, _ = make(params)
    assert free.generate(PROMPT, n_predict=60).tokens != ref.tokens  # the grammar changes the chain
    if kind == "same":  # a draft model proposes under the grammar too: the target itself is always right
        assert res.spec.accepted == res.spec.drafted > 0


@pytest.mark.parametrize("kind", [None, "model", "lookup"])
def test_a_finished_grammar_stops_the_generation(kind):
    tg = TokenGrammar(Grammar('root ::= "a" [b-h] [b-h]'), ToyTokenizer(V), V)
    gen, _ = make(GREEDY, drafter_for(kind, GREEDY, target_model()) if kind else None, grammar=tg)
    res = gen.generate(PROMPT, n_predict=20)
    assert res.stop_reason == "grammar" and len(res.tokens) == 3 and res.tokens[0] == 0
    for params in (SAMPLED, MIROSTAT[0]):
        tg = TokenGrammar(Grammar('root ::= "a" [b-g] [b-g]'), ToyTokenizer(V, eog=(7,)), V)
        gen, _ = make(params, drafter_for(kind, params, target_model()) if kind else None, eog=(7,), grammar=tg)
        res = gen.generate(PROMPT, n_predict=20)
        assert res.stop_reason == "eos" and len(res.tokens) == 3  # the end token is all that is left


def martingale_pvalue_grammar(params, tokens, tg, min_expected=5.0) -> float:
    """test_generate.martingale_pvalue with each token's law the grammar-masked chain."""
    model = target_model()
    tok, pos, h = model.state_after(PROMPT)
    ctx, st, steps = list(PROMPT), tg.initial(PROMPT), []
    need = grammar_need(params)
    m = new_picker(params) if params.mirostat or params.adaptive_on else None
    for t in tokens:
        x = apply_penalties(model._row(tok, pos, h), ctx, params).numpy().astype(np.float32)
        x = tg.constrain(x, st, need)
        if m is None:
            p = filtered_probs(torch.from_numpy(x), params).numpy().astype(np.float64)
        else:  # the picker's law in the state plain decoding reaches here
            idx, pr, sides = m.law(x, params)
            p = np.zeros(V)
            p[idx] = pr
            if p[t] > 0:
                m.state = m.next_state(m.state, sides, t, None)
        assert p[t] > 0
        steps.append((ctx[-1], t, p / p.sum()))
        ctx.append(t)
        st = tg.advance(st, t)
        tok, pos, h = t, pos + 1, _next_hash(h, t)
    return martingale_test(steps, min_expected)


@pytest.mark.parametrize("kind,params", [(None, SAMPLED_PEN), ("model", SAMPLED_PEN), ("lookup", SAMPLED),
                                         ("model", SAMPLED_EXT), ("model", MIROSTAT[0]), ("lookup", MIROSTAT[0]),
                                         ("model", ADAPTIVE[1])],
                         ids=["plain", "model-k4", "lookup-k4", "model-k4-whole-row-chain", "model-k4-mirostat2",
                              "lookup-k4-mirostat2", "model-k4-adaptive-p"])
def test_sampled_generation_under_a_grammar_follows_the_masked_target(kind, params):
    n = 2000
    drafter = drafter_for(kind, params, target_model(), n_ctx=n + 64, seed=41) if kind else None
    gen, _ = make(params, drafter, n_ctx=n + 64, spec_n_max=4, seed=40, grammar=toy_grammar())
    res = gen.generate(PROMPT, n_predict=n)
    assert len(res.tokens) == n
    if kind:
        assert res.spec.verify_passes > n // 10 and 0 < res.spec.accepted < res.spec.drafted
    assert martingale_pvalue_grammar(params, res.tokens, toy_grammar()) > 0.001


def test_wrong_acceptance_under_a_grammar_fails_the_test(monkeypatch):
    # accepting every draft the grammar allows (p > 0) keeps the output grammatical but not the law
    def accept_allowed(draft, q, p, g, p_min=0.0):
        for i, d in enumerate(draft):
            if not p[i, d] > 0:
                return i, draw(p[i], g)
        return len(draft), draw(p[len(draft)], g)
    monkeypatch.setattr(generate_mod, "accept_sampled", accept_allowed)
    n = 2000
    gen, _ = make(SAMPLED_PEN, drafter_for("model", SAMPLED_PEN, target_model(), n_ctx=n + 64, seed=41), n_ctx=n + 64,
                  spec_n_max=4, seed=40, grammar=toy_grammar())
    tokens = gen.generate(PROMPT, n_predict=n).tokens
    assert martingale_pvalue_grammar(SAMPLED_PEN, tokens, toy_grammar()) < 1e-6


def test_sampled_drafts_the_grammar_cuts_short_are_verified_whatever_n_min():
    """--spec-draft-n-min drops proposals shorter than it, but a sampled draft's count can follow its own draws:
    here the grammar ends it after a token of f-h. Dropping those (a plain step instead) verified only the other
    branch, and with the target as its own draft (q = p) the second token fell in f-h with probability
    Q(f-h)^2 instead of p's (0.92 against 0.96). Judged by what was asked, the second token's law is p."""
    tg = TokenGrammar(Grammar('root ::= "a" ( [f-h] | [b-e] [a-h] )'), ToyTokenizer(V), V)
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p = torch.softmax(target_model().logits_after(PROMPT + [0]).double()[1:], 0).numpy()  # "a" (0) first, then b..h
    # (p_stop 0: only the grammar ends a proposal; P_STOP: a draw from a law whose top is under it ends it too)
    for p_stop in (0.0, P_STOP):
        d = drafter_for("same", params)
        d.p_stop = p_stop
        gen, _ = make(params, d, spec_n_max=4, spec_n_min=2, grammar=tg)
        counts = np.zeros(V - 1)
        verified = 0
        for _ in range(3000):
            res = gen.generate(PROMPT, n_predict=10)  # (the grammar ends it after 2 or 3 tokens)
            assert res.tokens[0] == 0
            counts[res.tokens[1] - 1] += 1
            # (a proposal of one draft, ended unsure, leaves a step after the bonus token, where the grammar ends)
            verified += res.spec.verify_passes == 1 and (p_stop > 0 or res.spec.steps_no_proposal == 0)
        assert chi2_test(counts, p)[2] > 1e-3, (p_stop, counts / counts.sum(), p)
        assert verified == 3000  # every second token came from the one verify pass, of one draft or two
