"""JSON Schema -> GBNF grammar (`-j/--json-schema`), producing the language llama.cpp's
json_schema_to_grammar produces for the same schema (its rules: common/json-schema-to-grammar.cpp),
so that greedy output matches llama-cli's:

- whitespace between tokens is llama.cpp's `space` (nothing, a space, or one or two newlines and up to
  20 spaces or tabs), allowed after `{`, `[`, `:` and `,` and before `}` and `]`, not after values;
- objects list their `properties` in schema order: required ones first, each then optional, optional
  ones in order (any may be left out); `additionalProperties` (a schema, or true) adds keys that are
  none of the declared names; an object schema without properties is any object;
- arrays: `items` (a schema, or a list: a tuple), `prefixItems`, `minItems`, `maxItems`;
- strings: `minLength`, `maxLength`, `format` date / time / date-time / uuid (uuid1-5), `pattern` (an ECMA regular
  expression, sharpi_core.pattern: where llama.cpp's converter supports one, the same language, as
  valid JSON; more of the syntax besides: \\d \\w \\s, unanchored patterns); with a pattern, lengths and
  formats are not checked (a warning says so; llama.cpp ignores them silently);
- integers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (numbers or, draft 4, booleans):
  exactly the integers in the range, at most 16 digits where a side is open or its bound has more digits
  (llama.cpp's language for one-sided bounds also holds some integers outside them: minimum 105 allows 15);
- numbers: the same bounds when they are whole numbers, exactly, written without an exponent (llama.cpp
  ignores them); other bounds are not checked (a warning);
- `enum`, `const`, `anyOf` / `oneOf`, a list of types, `allOf` of objects, `$ref` into the document
  (recursion included).

What cannot be written is refused with one error line, not approximated; what is accepted but not
enforced (the cases above, bounds without a type, string lengths without a type (any value then, as
llama.cpp's), maxLength/maxItems above GBNF's 2000, other formats, and the validation keywords of
_UNENFORCED: multipleOf, uniqueItems, not, if / then / else, ...) is named in a warning (`warn`). The schema's
text is read as llama.cpp's JSON parser reads it: NaN, Infinity, numbers out of a double's range and lone
surrogates are not JSON.
"""
from __future__ import annotations

import json
import math
import re
from typing import Callable

from .errors import UsageError
from .grammar import MAX_REPETITION, class_char, literal, repetition
from .pattern import PatternError, pattern_to_gbnf


class SchemaError(UsageError):
    """A grammar or schema that cannot be used (exit 2, like a bad flag value); the caller names the flag that gave it."""


SPACE = '| " " | "\\n"{1,2} [ \\t]{0,20}'
PRIMITIVES = {
    "boolean": '("true" | "false")',
    "decimal-part": "[0-9]{1,16}",
    "integral-part": "[0] | [1-9] [0-9]{0,15}",
    "number": '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
    "integer": '("-"? integral-part)',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
    "array": '"[" space ( value ("," space value)* )? space "]"',
    "uuid": '"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\\""',
    "char": '[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})',
    "string": '"\\"" char* "\\""',
    "null": '"null"',
    "date": '[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )',
    "time": '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? '
            '( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    "date-time": 'date "T" time',
    "date-string": '"\\"" date "\\""',
    "time-string": '"\\"" time "\\""',
    "date-time-string": '"\\"" date-time "\\""',
}
_DEPS = {"number": ("integral-part", "decimal-part"), "integer": ("integral-part",),
         "value": ("object", "array", "string", "number", "boolean", "null"), "object": ("string", "value"),
         "array": ("value",), "string": ("char",), "date-time": ("date", "time"), "date-string": ("date",),
         "time-string": ("time",), "date-time-string": ("date-time",)}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_FORMATS = {"date": "date-string", "time": "time-string", "date-time": "date-time-string", "uuid": "uuid"}


def _format_rule(fmt) -> str:
    """The primitive rule of a string format ("" for one not enforced); uuid1..uuid5 are uuid, as llama.cpp's."""
    if not isinstance(fmt, str):
        return ""
    return _FORMATS.get(fmt) or ("uuid" if re.fullmatch(r"uuid[1-5]", fmt) else "")
# validation keywords the grammar does not express (llama.cpp's converter drops them too, silently): named in a warning
# keywords that say nothing of the value
_ANNOTATIONS = ("title", "description", "default", "examples", "$comment", "$schema", "$id", "$defs", "definitions",
                "deprecated", "readOnly", "writeOnly", "$anchor", "$vocabulary", "contentMediaType", "contentEncoding")
_UNENFORCED = ("multipleOf", "uniqueItems", "minProperties", "maxProperties", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas", "dependencies", "patternProperties", "propertyNames",
               "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems")


def _of_type(v, t, path: str) -> bool:
    """Whether JSON value v is of JSON Schema type t (1.0 is an integer, true is no number)."""
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
    kinds = {"string": str, "number": (int, float), "boolean": bool, "null": type(None), "array": list, "object": dict}
    if t not in kinds:
        raise SchemaError(f"{path}: unknown type '{t}'")
    return isinstance(v, kinds[t]) and (t == "boolean" or not isinstance(v, bool))


def _span(lo: str, hi: str) -> str:
    """GBNF for the digit strings of len(lo) == len(hi) between lo and hi (inclusive)."""
    i = 0
    while i < len(lo) and lo[i] == hi[i]:
        i += 1
    head = f'"{lo[:i]}"' if i else ""
    if i == len(lo):
        return head
    a, b, rest = int(lo[i]), int(hi[i]), len(lo) - i - 1
    lo_rest, hi_rest = lo[i + 1:], hi[i + 1:]
    tail = f" [0-9]{{{rest}}}" if rest > 1 else " [0-9]" if rest == 1 else ""
    alts = []
    first = a if lo_rest == "0" * rest else a + 1  # digits after which any `rest` digits will do
    last = b if hi_rest == "9" * rest else b - 1
    if first > a:
        alts.append(f'"{a}" ' + _span(lo_rest, "9" * rest))
    if first <= last:
        alts.append((f"[{first}]" if first == last else f"[{first}-{last}]") + tail)
    if last < b:
        alts.append(f'"{b}" ' + _span("0" * rest, hi_rest))
    body = alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
    return f"{head} {body}" if head else body


def int_range(lo: int, hi: int) -> str:
    """GBNF for the integers lo..hi written as JSON writes them (no leading zeros, no "-0")."""
    alts = []
    if lo < 0:
        alts.append('"-" (' + int_range(max(1, -hi), -lo) + ")")
    lo = max(lo, 0)
    full: list[int] = []  # lengths (> 1) all of whose integers are in range: one repetition for them all
    for n in range(len(str(lo)), len(str(hi)) + 1) if hi >= lo else ():
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10 ** n - 1)
        if n > 1 and (a, b) == (10 ** (n - 1), 10 ** n - 1):
            full.append(n)
        else:
            alts.append(_span(str(a), str(b)))
    if full:
        m, n = full[0] - 1, full[-1] - 1
        alts.append("[1-9] [0-9]" + ("" if n == 1 else f"{{{m}}}" if m == n else f"{{{m},{n}}}"))
    return " | ".join(alts)


# the open side of a one-sided range: as many digits as the `integer` rule allows
INT_LIMIT = 10 ** 16 - 1
# fractions (as the `number` rule's, up to 16 digits): any, one above zero, zero
_FRACTION, _NONZERO, _ZERO = '("." [0-9]{1,16})?', '"." "0"{0,15} [1-9] [0-9]{0,15}', '("." "0"{1,16})?'


def _magnitudes(a: int, a_strict: bool, b: int | None, b_strict: bool) -> list[str]:
    """Alternatives for the numbers m >= 0 (no sign, no exponent) with a < m or a <= m, and m < b or
    m <= b (0 <= a <= b; b None: up to 16 digits): the integer part says all unless it is a bound."""
    alts = []
    top = INT_LIMIT if b is None else b - 1
    if a + a_strict <= top:
        alts.append(f"({int_range(a + a_strict, top)}) {_FRACTION}")
    if a_strict and (b is None or a < b):
        alts.append(f'"{a}" {_NONZERO}')
    if b is not None and not b_strict and (a < b or not a_strict):
        alts.append(f'"{b}" {_ZERO}')
    return alts


def number_range(lo: int | None, lo_strict: bool, hi: int | None, hi_strict: bool) -> str:
    """GBNF for the numbers between whole-number bounds (None: open), without an exponent or "-0"."""
    alts = []
    if hi is None or hi > 0 or hi == 0 and not hi_strict:
        alts += _magnitudes(*((lo, lo_strict) if lo is not None and lo >= 0 else (0, False)), hi, hi_strict)
    if lo is None or lo < 0:  # x = -m, m > 0
        low = (-hi, hi_strict) if hi is not None and hi < 0 else (0, True)
        alts += ['"-" ' + m for m in _magnitudes(*low, None if lo is None else -lo, lo_strict)]
    return " | ".join(alts)


class _Converter:
    def __init__(self, root, warn: Callable[[str], None]):
        self.root = root
        self._warn, self._warned = warn, set()
        self.rules: dict[str, str] = {"space": SPACE}
        self.refs: dict[str, str] = {}
        self.n = 0

    def warn(self, msg: str) -> None:
        if msg not in self._warned:  # (a node is visited once per type of a type list)
            self._warned.add(msg)
            self._warn(msg)

    def add(self, body: str, name: str | None = None) -> str:
        if name is None:
            name = f"r{self.n}"
            self.n += 1
        self.rules[name] = body
        return name

    def prim(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = PRIMITIVES[name]
            for d in _DEPS.get(name, ()):
                self.prim(d)
        return name

    def target(self, ref: str):
        """What a `#/...` reference (a JSON pointer into the document) points at; None: nothing."""
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def ref(self, ref: str, path: str) -> str:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{path}: only $ref into the same document ('#/...') is supported")
        if ref not in self.refs:
            node = self.target(ref)
            if node is None:
                raise SchemaError(f"{path}: $ref {ref} points nowhere")
            self.refs[ref] = name = f"ref{len(self.refs)}"
            self.rules[name] = ""  # reserved: a recursive reference resolves to this rule
            self.rules[name] = self.visit(node, ref)
        return self.refs[ref]

    def visit(self, s, path: str) -> str:
        """The GBNF expression for schema s (a rule name or a parenthesized body)."""
        if s is True or s == {}:
            return self.prim("value")
        if not isinstance(s, dict):
            raise SchemaError(f"{path}: a schema must be an object")
        if "$ref" in s:
            return self.ref(s["$ref"], path)
        unenforced = [k for k in _UNENFORCED if k in s]
        if unenforced:
            self.warn(f"{path}: {', '.join(unenforced)} not enforced")
        for key in ("oneOf", "anyOf"):
            if key in s:
                alts = s[key]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError(f"{path}/{key}: must be a non-empty array of schemas")
                beside = [k for k in s if k not in _ANNOTATIONS and k not in _UNENFORCED and k not in ("oneOf", "anyOf")]
                if beside:  # (as llama.cpp's converter: the alternatives alone)
                    self.warn(f"{path}: {', '.join(beside)} beside {key} not enforced (write them into each alternative)")
                return self.add(" | ".join(self.visit(a, f"{path}/{key}/{i}") for i, a in enumerate(alts)))
        t = s.get("type")
        if isinstance(t, list) and not t:
            raise SchemaError(f"{path}: type must not be empty")
        if t is not None and not isinstance(t, (str, list)):
            raise SchemaError(f"{path}: type must be a string or an array of strings")
        if "const" in s or "enum" in s:
            vals = [s["const"]] if "const" in s else s["enum"]
            if not isinstance(vals, list) or not vals:
                raise SchemaError(f"{path}: enum must be a non-empty array")
            if t is not None:  # (llama.cpp's converter writes the values whatever the type says)
                types = t if isinstance(t, list) else [t]
                vals = [v for v in vals if any(_of_type(v, x, path) for x in types)]
                if not vals:
                    raise SchemaError(f"{path}: no value fits ({'its const is not' if 'const' in s else 'no enum value is'}"
                                      f" of type {' or '.join(map(str, types))})")
            return self.add("(" + " | ".join(literal(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
                                              for v in vals) + ")")
        if isinstance(t, list):
            rest = {k: v for k, v in s.items() if k not in _UNENFORCED}  # (named above, once)
            return self.add(" | ".join(self.visit({**rest, "type": x}, f"{path}/type/{i}") for i, x in enumerate(t)))
        has_props = "properties" in s or ("additionalProperties" in s and s["additionalProperties"] is not True)
        if t is None:
            if has_props:
                return self.object(s, path)
            if "allOf" in s:
                return self.all_of(s, path)
            if "items" in s or "prefixItems" in s:
                return self.array(s, path)
            if "pattern" in s or _format_rule(s.get("format")):  # (as llama.cpp's: a string)
                return self.string(s, path)
            lengths = [k for k in ("minLength", "maxLength", "format") if k in s]
            if lengths:  # (they constrain strings only: any value, as llama.cpp's converter)
                self.warn(f"{path}: {', '.join(lengths)} without type string not enforced")
            if any(k in s for k in _BOUNDS):
                self.warn(f"{path}: bounds without a type are not enforced (give type number or integer)")
            return self.prim("value")
        if t == "object":
            if not has_props and "allOf" in s:
                return self.all_of(s, path)
            return self.object(s, path)
        if t == "string":
            if "allOf" in s:
                return self.all_of(s, path)
            return self.string(s, path)
        if t == "array":
            return self.array(s, path)
        if t == "integer":
            return self.integer(s, path)
        if t == "number":
            return self.number(s, path)
        if t in ("boolean", "null"):
            return self.prim(t)
        raise SchemaError(f"{path}: unknown type '{t}'")

    def count(self, s: dict, key: str, default: int, path: str) -> int:
        v = s.get(key, default)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SchemaError(f"{path}: {key} must be a non-negative integer")
        # GBNF repeats at most MAX_REPETITION times (llama.cpp's limit): a longer minimum cannot be written,
        # a longer maximum is no maximum
        if v > MAX_REPETITION and key.startswith("min"):
            raise SchemaError(f"{path}: {key} above {MAX_REPETITION} is not supported")
        if v > MAX_REPETITION:
            self.warn(f"{path}: {key} above {MAX_REPETITION} is not enforced")
        return v

    @staticmethod
    def fits(lo: int, hi: int | None, lo_key: str, hi_key: str, what: str, path: str) -> None:
        if hi is not None and lo > hi:
            raise SchemaError(f"{path}: no {what} fits ({lo_key} {lo} is above {hi_key} {hi})")

    @staticmethod
    def bounds(s: dict, path: str) -> tuple:
        """(lower, strict, upper, strict) of minimum / exclusiveMinimum / maximum / exclusiveMaximum, the
        tighter where two are given (numbers, or draft 4's exclusive flags); None for an open side."""
        def bound(k: str) -> int | float | None:
            v = s.get(k)
            if v is None or isinstance(v, bool) and k.startswith("exclusive"):  # draft 4: a flag, read below
                return None
            if not isinstance(v, (int, float)) or isinstance(v, bool) or isinstance(v, float) and not math.isfinite(v):
                raise SchemaError(f"{path}: {k} must be a number")
            return v

        out = []
        for plain, excl, sign in (("minimum", "exclusiveMinimum", 1), ("maximum", "exclusiveMaximum", -1)):
            given = [(v, s.get(excl) is True) for v in [bound(plain)] if v is not None]
            given += [(v, True) for v in [bound(excl)] if v is not None]
            v, strict = max(given, key=lambda b: (sign * b[0], b[1])) if given else (None, False)
            out += [v, strict]
        return tuple(out)

    def integer(self, s: dict, path: str) -> str:
        if not any(k in s for k in _BOUNDS):
            return self.prim("integer")
        lo, lo_strict, hi, hi_strict = self.bounds(s, path)
        lo = -INT_LIMIT if lo is None else math.floor(lo) + 1 if lo_strict else math.ceil(lo)
        hi = INT_LIMIT if hi is None else math.ceil(hi) - 1 if hi_strict else math.floor(hi)
        if lo > INT_LIMIT or hi < -INT_LIMIT:
            raise SchemaError(f"{path}: no integer of at most 16 digits lies within its bounds")
        # (a bound past 16 digits bounds nothing the integer rule can write: int64's, 1e20)
        lo, hi = max(lo, -INT_LIMIT), min(hi, INT_LIMIT)
        if lo > hi:
            raise SchemaError(f"{path}: no integer lies within its bounds")
        return self.add("(" + int_range(lo, hi) + ")")

    def number(self, s: dict, path: str) -> str:
        if not any(k in s for k in _BOUNDS):
            return self.prim("number")
        lo, lo_strict, hi, hi_strict = self.bounds(s, path)
        if any(v is not None and not float(v).is_integer() for v in (lo, hi)):
            self.warn(f"{path}: bounds on numbers are enforced only when they are whole numbers")
            return self.prim("number")
        lo, hi = (None if v is None else int(v) for v in (lo, hi))
        if lo is not None and lo > INT_LIMIT or hi is not None and hi < -INT_LIMIT:
            raise SchemaError(f"{path}: no number of at most 16 integer digits lies within its bounds")
        if lo is not None and lo < -INT_LIMIT:  # (bounds nothing the number rule can write)
            lo, lo_strict = None, False
        if hi is not None and hi > INT_LIMIT:
            hi, hi_strict = None, False
        if lo is not None and hi is not None and (lo > hi or lo == hi and (lo_strict or hi_strict)):
            raise SchemaError(f"{path}: no number lies within its bounds")
        return self.add("(" + number_range(lo, lo_strict, hi, hi_strict) + ")")

    def string(self, s: dict, path: str) -> str:
        if "pattern" in s:
            if not isinstance(s["pattern"], str):
                raise SchemaError(f"{path}: pattern must be a string")
            ignored = [k for k in ("minLength", "maxLength", "format") if k in s]
            if ignored:
                self.warn(f"{path}: {', '.join(ignored)} not enforced together with a pattern")
            try:
                body = pattern_to_gbnf(s["pattern"], self.prim("char"))
            except PatternError as e:
                raise SchemaError(f"{path}: pattern: {e}") from None
            return self.add(f'"\\"" {body} "\\""')
        fmt = s.get("format")
        rule = _format_rule(fmt)
        if rule:
            ignored = [k for k in ("minLength", "maxLength") if k in s]
            if ignored:
                self.warn(f"{path}: {', '.join(ignored)} not enforced together with a format")
            return self.prim(rule)
        if fmt is not None:
            self.warn(f"{path}: format {json.dumps(fmt)} not enforced (date, time, date-time and uuid are)")
        lo, hi = self.count(s, "minLength", 0, path), s.get("maxLength")
        if lo > 0 or hi is not None:
            hi = None if hi is None else self.count(s, "maxLength", 0, path)
            self.fits(lo, hi, "minLength", "maxLength", "string", path)
            return self.add(f'"\\"" {repetition(self.prim("char"), lo, hi)} "\\""')
        return self.prim("string")

    def array(self, s: dict, path: str) -> str:
        if s.get("prefixItems") and isinstance(s["prefixItems"], list) and "items" in s \
                and not isinstance(s["items"], list):
            # 2020-12: the tuple, then items' schema for the rest (false: nothing more); llama.cpp's converter
            # takes items alone
            body = ' "," space '.join(self.visit(x, f"{path}/prefixItems/{i}") for i, x in enumerate(s["prefixItems"]))
            more = "" if s["items"] is False else f' ( "," space {self.visit(s["items"], f"{path}/items")} )*'
            return self.add(f'"[" space {body}{more} space "]"')
        if s.get("items") is False:  # (no item at all)
            return self.add('"[" space "]"')
        key = "items" if "items" in s else "prefixItems" if "prefixItems" in s else None
        items = s.get(key) if key else None
        if isinstance(items, list):
            body = ' "," space '.join(self.visit(x, f"{path}/{key}/{i}") for i, x in enumerate(items))
            return self.add(f'"[" space {body} space "]"')
        lo, hi = self.count(s, "minItems", 0, path), s.get("maxItems")
        hi = None if hi is None else self.count(s, "maxItems", 0, path)
        self.fits(lo, hi, "minItems", "maxItems", "array", path)
        if (items is None or items is True or items == {}) and lo == 0 and hi is None:
            return self.prim("array")
        item = self.visit(items if items is not None else {}, f"{path}/{key or 'items'}")
        return self.add(f'"[" space {repetition(item, lo, hi, chr(34) + "," + chr(34) + " space")} space "]"')

    def not_strings(self, names: list[str]) -> str:
        """A JSON string that is none of `names` (llama.cpp's _not_strings, its trie walk: a key that is a
        proper prefix of a name is left out too)."""
        trie: dict = {}
        for n in names:
            node = trie
            for c in n:
                node = node.setdefault(c, {})
            node[None] = True
        char = self.prim("char")

        def walk(node: dict) -> str:
            alts, rejects = [], ""
            for c, child in node.items():
                if c is None:
                    continue
                rejects += c
                sub = {k: v for k, v in child.items() if k is not None}
                alts.append(f"[{class_char(ord(c))}] ({walk(child)})" if sub else f"[{class_char(ord(c))}] {char}+")
            if alts:  # (any other character: JSON text's, a backslash only as an escape; llama.cpp's took a raw one)
                alts.append(f'[^"\\\\\\x7F\\x00-\\x1F{"".join(class_char(ord(c)) for c in rejects)}] {char}*')
                alts.append(f'[\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{{4}}) {char}*')
            return " | ".join(alts)

        return f'["] ( {walk(trie)} ){"" if None in trie else "?"} ["]'

    def object(self, s: dict, path: str, props: list | None = None, required: set | None = None) -> str:
        if props is None:
            p = s.get("properties", {})
            if not isinstance(p, dict):
                raise SchemaError(f"{path}: properties must be an object")
            req = s.get("required", [])
            required = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
            props = list(p.items())
            extra = s.get("additionalProperties", None if "properties" in s else True)
            if extra is not None and extra is not False and not isinstance(extra, (bool, dict)):
                raise SchemaError(f"{path}: additionalProperties must be a boolean or a schema")
            missing = [r for r in required if r not in p]
            if missing and extra is False:
                raise SchemaError(f"{path}: no object fits (required {json.dumps(sorted(missing))[1:-1]} not "
                                  "among its properties, and additionalProperties is false)")
            # (llama.cpp's converter drops them, and its output never has them: any value of theirs, as the schema
            # says, or additionalProperties' schema)
            props += [(r, extra if isinstance(extra, dict) else {}) for r in missing]
            if not props and (extra is True or extra == {}):
                return self.prim("object")
        else:
            extra = None
        kv: dict[str | None, str] = {}  # (None: the additional properties, whatever their names)
        req, opt = [], []
        for name, sub in props:
            value = self.visit(sub, f"{path}/properties/{name}")
            kv[name] = self.add(f'{literal(json.dumps(name, ensure_ascii=False))} space ":" space {value}')
            (req if name in required else opt).append(name)
        if extra is not None and extra is not False:
            value = self.prim("value") if extra is True or extra == {} else self.visit(extra, f"{path}/additionalProperties")
            key = self.prim("string") if not kv else self.add(self.not_strings([k for k in kv if k is not None]))
            kv[None] = self.add(f'{key} ":" space {value}')
            opt.append(None)
        if not req and not opt:
            return self.add('"{" space "}"')
        body = '"{" space ' + ' "," space '.join(kv[n] for n in req)
        if opt:
            # rest[i]: the optional keys from opt[i] on, each after a comma, any left out: one rule each, shared by
            # the alternatives (llama.cpp's `<key>-rest` rules; a rule per alternative and key grew as n^2)
            rest = [""] * (len(opt) + 1)
            for i in range(len(opt) - 1, 0, -1):
                k = opt[i]
                rest[i] = self.add(f'( "," space {kv[k]} )' + ("*" if k is None else "?")
                                   + (f" {rest[i + 1]}" if rest[i + 1] else ""))
            alts = " | ".join(kv[k] + (f' ( "," space {kv[k]} )*' if k is None else "")
                              + (f" {rest[i + 1]}" if rest[i + 1] else "") for i, k in enumerate(opt))
            body += f' ( "," space ( {alts} ) )?' if req else f" ( {alts} )?"
        return self.add(body + ' space "}"')

    def all_of(self, s: dict, path: str) -> str:
        parts = s["allOf"]
        if not isinstance(parts, list) or not parts:
            raise SchemaError(f"{path}/allOf: must be a non-empty array of schemas")
        props: dict[str, list] = {}  # name -> its schemas (several parts may each say something of it)
        required: set = set()
        enums: dict[str, int] = {}

        def deref(c):
            for _ in range(100):  # (a $ref to a $ref ...; a cycle of them stops somewhere)
                if not (isinstance(c, dict) and "$ref" in c):
                    break
                c = self.target(str(c["$ref"]))
                c = {} if c is None else c
            return c

        def component(c, is_required: bool) -> None:
            c = deref(c)
            if isinstance(c, dict) and "enum" in c and isinstance(c["enum"], list):
                # (a part's values counted once each: ["a", "a"] and ["b"] share no value)
                for lit in dict.fromkeys(literal(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
                                         for v in c["enum"]):
                    enums[lit] = enums.get(lit, 0) + 1
            elif isinstance(c, dict) and ("properties" in c or c.get("type") == "object"):
                for name, sub in (c.get("properties") or {}).items():
                    if sub not in props.setdefault(name, []):
                        props[name].append(sub)
                    if is_required:
                        required.add(name)
            else:  # (llama.cpp's converter combines only objects' properties, and enums)
                ignored.append(c)

        ignored: list = []

        for c in parts:
            if isinstance(c, dict) and "anyOf" in c:
                for alt in c["anyOf"]:
                    component(alt, False)
            else:
                component(c, True)
        both = [lit for lit, n in enums.items() if n == len(parts)]
        if both:
            return self.add("(" + " | ".join(both) + ")")
        if enums and not props and not ignored:
            raise SchemaError(f"{path}/allOf: no value fits (its parts' enums share no value)")
        if not props:
            # no properties to combine (llama.cpp's converter writes `{}` then, whatever the type): the parts'
            # keywords beside the schema's own, the first to give one holding
            merged, clash = {k: v for k, v in s.items() if k != "allOf"}, []
            for c in map(deref, parts):
                for k, v in (c.items() if isinstance(c, dict) else ()):
                    if k not in merged:
                        merged[k] = v
                    elif merged[k] != v and k not in clash:
                        clash.append(k)
            if clash:
                self.warn(f"{path}/allOf: its parts give {', '.join(clash)} differently: the first's holds")
            return self.visit(merged, path)
        if ignored:
            self.warn(f"{path}/allOf: parts other than objects and enums not enforced (their properties and "
                      "shared enum values are what it combines)")
        # (a name two parts define: one key, both schemas; llama.cpp's converter writes the key twice)
        return self.object({}, path, [(n, subs[0] if len(subs) == 1 else {"allOf": subs}) for n, subs in props.items()],
                           required)


def _strict_json(text: str):
    """json.loads as a JSON parser (llama.cpp's nlohmann) reads it: no NaN / Infinity, no number out of a double's
    range, no lone surrogate in a string; a byte order mark at the start skipped."""
    def constant(c: str):
        raise ValueError(f"{c} is not a JSON value")

    def out_of_range(x: str):
        raise ValueError(f"number {x[:20]}{'...' if len(x) > 20 else ''} is out of range")

    def number(x: str) -> float:
        if not math.isfinite(v := float(x)):
            out_of_range(x)
        return v

    def integer(x: str) -> int:  # (past 64 bits nlohmann reads a double: out of its range, an error)
        if len(x) > 310:  # (past any double; and Python's int() refuses 4300 digits)
            out_of_range(x)
        v = int(x)
        if not -2 ** 63 <= v < 2 ** 64:
            number(x)
        return v

    def check(v) -> None:
        todo = [v]  # (a work list: a deeply nested schema is the converter's to refuse, with its own words)
        while todo:
            v = todo.pop()
            if isinstance(v, str) and (m := _SURROGATE.search(v)):
                raise ValueError(f"a lone surrogate \\u{ord(m.group()):04x} in a string")
            if isinstance(v, dict):
                todo += [*v.keys(), *v.values()]
            elif isinstance(v, list):
                todo += v
    try:
        out = json.loads(text.removeprefix("\ufeff"), parse_constant=constant, parse_float=number, parse_int=integer)
        check(out)
    except ValueError as e:  # (JSONDecodeError is one)
        raise SchemaError(f"not JSON: {e}") from None
    except RecursionError:
        raise SchemaError("nested too deeply to be read") from None
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def schema_to_grammar(schema: str | dict, warn: Callable[[str], None] = lambda msg: None,
                      refs: dict[str, str] | None = None) -> str:
    """GBNF text for a JSON schema (a dict, or its JSON text); `warn` hears of what it does not enforce; `refs`,
    when given, receives the rule name of each `$ref` (rule -> the reference), for errors in the schema's words."""
    if isinstance(schema, str):
        schema = _strict_json(schema)
    c = _Converter(schema, warn)
    top = c.visit(schema, "#")
    c.rules["root"] = top
    if refs is not None:
        refs.update({name: ref for ref, name in c.refs.items()})
    return "".join(f"{name} ::= {body}\n" for name, body in c.rules.items())
