#!/usr/bin/env python3
"""libllama's ids for special tokens that strip the spaces beside them, for add_bos / add_eos, and its special ids
(end of turn, FIM, end of generation): the oracle of tests/test_tokenizer.py.

    python scripts/llamacpp_special_attrs.py LLAMA_CPP_SRC BIN_DIR [-o tests/data/llamacpp_special_attrs.json]

llama.cpp gives some special tokens its LSTRIP / RSTRIP attributes by the model's name, pre-tokenizer or
architecture (llama_vocab::impl::load: every special token of a "phi-3" model strips the spaces after it,
"[MASK]" of "modern-bert" and "<mask>" of the jina-v2 pre-tokenizers those before it), and appends EOS where
tokenizer.ggml.add_eos_token says so. None of the four models has either, so each VARIANT is a vocabulary-only
copy of SmolLM2's (byte-level BPE) or Gemma 3's (SentencePiece) GGUF with its metadata changed (`keys`); libllama
(scripts/llamacpp_tokenize.c) tokenizes TEXTS in it with special tokens parsed and added, and the test expects
sharpi's ids to be the same, from the same metadata. Each variant's special ids too: where a vocabulary spells the
end-of-turn or a FIM token several ways (SmolLM2 has <|endoftext|> and <|im_end|>; the *-spellings variants rename
tokens to more), llama.cpp takes the spelling its std::unordered_map of the texts walks first.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp_logits import build, oracle_args  # noqa: E402
from gguf_derive import copy_kv, finish  # noqa: E402
from llamacpp_vocab_check import SEP  # noqa: E402
from sharpi_core.gguf_file import GGUFFile  # noqa: E402
from sharpi_core.registry import resolve_model  # noqa: E402

SMOL, GEMMA = "smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"
SPECIALS = ("bos", "eos", "eot", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")  # (llamacpp_tokenize.c)
TEXTS = ["Hello <|im_end|>  world", "a \n<|im_start|>\n\n user\t<|im_end|>\t\n", "<|endoftext|>   x <|endoftext|>",
         "x   <mask>   y<mask>z\n\n<mask>", "  [MASK]  a [MASK]b\t[MASK]", "<reponame>  <file_sep>\n\nz",
         "<start_of_turn>  user\n hi <end_of_turn>\n\n<start_of_turn>model", "<eos>  <bos>  <unk>  </s>  <pad>  end",
         "  leading and trailing  ", "", "plain text, no specials"]


def variants() -> dict[str, tuple[str, dict, dict]]:
    """name -> (model, metadata keys changed, tokens renamed {id: text}). (libllama refuses to load a "phi-3"
    vocabulary without all of </s>, <unk>, <s> and <|endoftext|>: its rule looks each of them up.)"""
    return {
        "smollm2": (SMOL, {}, {}),
        "smollm2-phi-3": (SMOL, {"general.name": "Phi-3 mini (renamed)"}, {3: "</s>", 4: "<unk>", 5: "<s>"}),
        "smollm2-modern-bert": (SMOL, {"general.name": "modern-bert"}, {4: "[MASK]"}),
        "smollm2-jina-v2": (SMOL, {"tokenizer.ggml.pre": "jina-v2-code"}, {4: "<mask>"}),
        "smollm2-add-eos": (SMOL, {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}, {}),
        "gemma3": (GEMMA, {}, {}),
        "gemma3-phi3": (GEMMA, {"general.name": "phi3"}, {6: "<|endoftext|>"}),
        "gemma3-jina-v2": (GEMMA, {"tokenizer.ggml.pre": "jina-v2-es"}, {}),
        "gemma3-add-eos": (GEMMA, {"tokenizer.ggml.add_eos_token": True}, {}),
        # several spellings of the end-of-turn and FIM tokens: llama.cpp takes the first its hash map walks
        "smollm2-spellings": (SMOL, {}, {6: "<|fim_prefix|>", 7: "<fim-prefix>", 8: "<|fim_suffix|>", 9: "<fim_suffix>",
                                         10: "<|fim_middle|>", 11: "<MID>", 12: "<|eot_id|>", 13: "<end_of_turn>",
                                         14: "<|fim_pad|>", 15: "<fim_pad>", 16: "<|repo_name|>"}),
        "gemma3-spellings": (GEMMA, {}, {6: "<|fim_prefix|>", 7: "<PRE>", 8: "<fim_prefix>", 9: "<|fim_suffix|>",
                                         10: "<SUF>", 11: "<|fim_middle|>", 12: "<MID>", 13: "<|fim_pad|>", 14: "[PAD]",
                                         15: "<|fim_repo|>", 16: "<REPO>", 17: "<|eot_id|>", 18: "<EOT>",
                                         19: "<|endoftext|>"}),
    }


def changed_keys(gf, keys: dict, renames: dict) -> dict:
    """keys, plus the vocabulary with its tokens renamed."""
    out = dict(keys)
    if renames:
        tokens = list(gf.get("tokenizer.ggml.tokens"))
        for i, text in renames.items():
            tokens[int(i)] = text
        out["tokenizer.ggml.tokens"] = tokens
    return out


def vocab_copy(src: Path, dst: Path, keys: dict, renames: dict) -> None:
    """A vocabulary-only copy of src (metadata, no tensors) with `keys` set (added where src lacks them) and tokens
    renamed."""
    gf = GGUFFile(src)
    values = changed_keys(gf, keys, renames)
    w = gguf.GGUFWriter(dst, str(gf.get("general.architecture")))
    done = copy_kv(gf, w, values=values)
    for key, value in values.items():
        if key not in done:
            w.add_key_value(key, value, gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.STRING)
    finish(w)


def main() -> None:
    args = oracle_args(__doc__, "llamacpp_special_attrs.json")
    ids, specials = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.src, args.bin, Path(tmp), "llamacpp_tokenize")
        for name, (model, keys, renames) in variants().items():
            path = Path(tmp) / "vocab.gguf"
            vocab_copy(resolve_model(model), path, keys, renames)
            out = subprocess.run([str(exe), str(path), "1", "1"], input=SEP.join(TEXTS).encode(), capture_output=True,
                                 check=True).stdout.decode().split("\n")
            ids[name] = [[int(x) for x in line.split()] for line in out[: len(TEXTS)]]
            head, eog = subprocess.run([str(exe), str(path), "specials"], capture_output=True, text=True,
                                       check=True).stdout.split("\n")[:2]
            specials[name] = {**{k: int(v) for k, v in zip(SPECIALS, head.split()) if int(v) >= 0},
                              "eog": [int(v) for v in eog.split()]}
            print(f"{name}: {sum(map(len, ids[name]))} ids", file=sys.stderr)
    args.out.write_text(json.dumps({"llama_cpp": "llama_cpp_python 0.3.36 vendor tree, scripts/llamacpp_tokenize.c",
                                    "texts": TEXTS, "variants": variants(), "ids": ids,
                                    "specials": specials}, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
