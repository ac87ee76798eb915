"""llama-perplexity's multiple-choice scores: --hellaswag, --winogrande and --multiple-choice (ARC, MMLU,
TruthfulQA and HellaSwag in llama.cpp's binary format).

A task is a context and a few continuations; each continuation is tokenized with the context, and scored by the
mean log-probability of its tokens after the prefix that all of the task's sequences share; the task is right when
the best-scored continuation is a correct one. llama-perplexity evaluates a batch of tasks at once (each task's
shared prefix once, each continuation as a sequence of its own, side by side in its unified cache); so does this
module, in the same passes (Transformer.forward's seqs), since its matmuls' bits depend on a pass's rows. Where a
model's passes cannot hold several sequences, each continuation is a pass after its prefix instead (close, not the
same bits). Tasks are drawn as llama-perplexity draws them (std::mt19937 seeded with 1 and libstdc++'s
uniform_int_distribution, or its float scaling), so the running lines come in its order, and the arithmetic that
llama-perplexity does in float is done in float32 here.
"""
from __future__ import annotations

import ctypes
import functools
import math
import random
import struct
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .errors import SharpiError
from .libm import strtol
from .perplexity import printf_f
from .text import text_from_bytes

F32 = np.float32


class Mt19937:
    """std::mt19937 with an integer seed (init_genrand): Python's generator is the same Mersenne Twister, started
    from the state the C++ constructor computes."""

    def __init__(self, seed: int):
        mt = [seed & 0xFFFFFFFF]
        for i in range(1, 624):
            mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
        self._r = random.Random()
        self._r.setstate((3, tuple(mt) + (624,), None))

    def __call__(self) -> int:
        return self._r.getrandbits(32)


def uniform_index(rng: Mt19937, n: int) -> int:
    """std::uniform_int_distribution<size_t>(0, n - 1)(rng) as libstdc++ (11 and later) computes it from a 32-bit
    generator: Lemire's multiply-and-reject."""
    product = rng() * n
    if product & 0xFFFFFFFF < n:
        threshold = (0x100000000 - n) % n
        while product & 0xFFFFFFFF < threshold:
            product = rng() * n
    return product >> 32


def scaled_index(rng: Mt19937, n: int) -> int:
    """int(scale * rng() * n) with scale = 1 / (1 + 2^32) in float, as llama-perplexity picks winogrande's and the
    binary format's random tasks (each product rounded to float)."""
    j = int(F32(F32(rng()) * F32(2.0 ** -32)) * F32(n))
    return min(j, n - 1)  # (a draw that rounds to 2^32 would index past the end there)


@dataclass
class Task:
    seqs: list[list[int]]  # each continuation's tokens, the context's included
    prefix: int = 0  # tokens all of them share
    gold: int = 0  # hellaswag: the gold ending; winogrande: the answer, 1 or 2
    labels: list[int] = field(default_factory=list)  # multiple choice: 1 where an answer is correct
    bases: tuple[int, int] = (0, 0)  # winogrande: the tokens of the sentence up to and with each choice
    number: int = 0  # (its index among the tasks evaluated, for errors)

    @property
    def required(self) -> int:
        """llama-perplexity's context tokens for the task: the prefix once, each continuation's rest."""
        return self.prefix + sum(len(s) - self.prefix for s in self.seqs)


def shared_prefix(seqs: list[list[int]]) -> int:
    n = 0
    for column in zip(*seqs):
        if any(t != column[0] for t in column):
            break
        n += 1
    return n


# ---- the data files -------------------------------------------------------------------------------------------
def text_lines(text: str) -> list[str]:
    """The lines std::getline yields from -f's text (which lost one trailing newline as llama.cpp reads -f)."""
    parts = text.split("\n")
    return parts[:-1] if parts[-1] == "" else parts


def hellaswag_tasks(text: str, n_tasks: int):
    """-> (the drawn tasks' contexts, gold endings and four endings, in llama-perplexity's order). The file has 6
    lines a task: activity label and context, the gold ending's index, the four endings."""
    lines = text_lines(text)
    if len(lines) % 6:
        raise SharpiError(f"hellaswag: the file has {len(lines)} lines, not a multiple of 6 (a context, the gold "
                          "ending's index and 4 endings a task)")
    rng = Mt19937(1)
    out = []
    first_line = list(range(1, len(lines) + 1, 6))  # each task not yet drawn: its first line in the file
    for _ in range(min(n_tasks, len(lines) // 6)):
        idx = uniform_index(rng, len(lines) // 6)  # (from the tasks not yet drawn)
        ctx, gold, *endings = lines[idx * 6:idx * 6 + 6]
        gold_index = strtol(gold)  # (std::stoi: after C blanks, ASCII digits)
        if gold_index is None or not 0 <= gold_index < 4:
            raise SharpiError(f"hellaswag: the gold ending of the task at line {first_line[idx]} is '{gold}', not 0-3")
        out.append((ctx, gold_index, endings))
        del lines[idx * 6:idx * 6 + 6], first_line[idx]
    return out


def winogrande_rows(text: str, warn: Callable[[str], None] = print):
    """-> [(sentence before '_', after it, choice 1, choice 2, answer 1 or 2)] from the CSV (index, sentence, choice 1,
    choice 2, answer), read as llama-perplexity reads it: a line without its 4 commas (outside quotes), a '_' in the
    sentence or an answer of 1 or 2 is left out with a warning (a header line so), and so is a last line that no
    newline ends (std::getline's end of file there)."""
    parts = text.split("\n")
    out = []
    for line in parts[:-1]:
        commas, quoted = [], False
        for i, ch in enumerate(line):
            if ch == '"':
                quoted = not quoted
            elif ch == "," and not quoted:
                commas.append(i)
                if len(commas) == 4:
                    break
        if len(commas) != 4:
            warn(f"warning: winogrande: no 4 comma separators in <{line}>: left out")
            continue
        c0, c1, c2, c3 = commas
        sentence = line[c0 + 2:c1 - 1] if line[c0 + 1] == '"' else line[c0 + 1:c1]
        where = sentence.find("_")
        if where < 0:
            warn(f"warning: winogrande: no _ in <{sentence}>: left out")
            continue
        answer = strtol(line[c3 + 1:])  # (istream >> int)
        if answer not in (1, 2):
            warn(f"warning: winogrande: the answer <{line[c3 + 1:]}> is not 1 or 2: left out")
            continue
        out.append((sentence[:where], sentence[where + 1:], line[c1 + 1:c2], line[c2 + 1:c3], answer))
    return out


def pick(n_all: int, n_tasks: int) -> list[int]:
    """The tasks (indices) llama-perplexity evaluates of n_all when asked for n_tasks (0: all, in order)."""
    if n_tasks <= 0 or n_tasks >= n_all:
        return list(range(n_all))
    rng, aux, out = Mt19937(1), list(range(n_all)), []
    for _ in range(n_tasks):
        j = scaled_index(rng, len(aux))
        out.append(aux[j])
        aux[j] = aux[-1]
        aux.pop()
    return out


class _Reader:
    def __init__(self, data: bytes, pos: int):
        self.data, self.pos = data, pos

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.data):
            raise EOFError
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        (n,) = self.take("<I")
        if self.pos + n > len(self.data):
            raise EOFError
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return text_from_bytes(s)[0]  # (a U+FFFD a byte that is not UTF-8, as llama.cpp's tokenizer reads them)

    def answers(self):
        (n,) = self.take("<I")
        if n > 100:
            raise EOFError
        answers = [self.string() for _ in range(n)]
        return answers, list(self.take(f"<{n}i")) if n else []


def multiple_choice_items(data: bytes, n_tasks: int):
    """-> [(question, answers, labels)] of the binary format (uint32 task count, each task's byte offset, then per
    task: the question, and two answer sets (uint32 count, strings of uint32 length + bytes, int32 labels), the
    second unused), the tasks llama-perplexity draws."""
    try:
        r = _Reader(data, 0)
        (n,) = r.take("<I")
        if n == 0:
            raise EOFError
        offsets = r.take(f"<{n}I")
    except (EOFError, struct.error):
        raise SharpiError("multiple choice: no tasks (the file does not start with a task count and offsets)") from None
    chosen = pick(n, n_tasks)
    out = []
    for i, idx in enumerate(chosen):
        if len(chosen) < n:
            r.pos = offsets[idx]
        try:
            q = r.string()
            answers, labels = r.answers()
            r.answers()
        except EOFError:
            where = f"at byte {offsets[idx]}" if len(chosen) < n else f"{i + 1} of {n}"
            raise SharpiError(f"multiple choice: cannot read task {where}") from None
        out.append((q, answers, labels))
    return out


# ---- scoring ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _lib():
    """The CPU kernels' library with its two functions typed, or None where it is not built (then numpy)."""
    from .kernels import cpu
    if not cpu.available():
        return None
    lib = cpu._symbols()
    lib.sharpi_choice_logprobs.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                           ctypes.c_void_p]
    lib.sharpi_choice_logprobs.restype = None
    lib.sharpi_softmax_logprob.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    lib.sharpi_softmax_logprob.restype = ctypes.c_float
    return lib


def _logprobs(rows: torch.Tensor, targets: list[int]) -> np.ndarray:
    """Each row's log-probability of its target token, in float as llama-perplexity computes them for these scores:
    a float sum of the exps, which runs a few 1e-4 above a float64 log-softmax on a 50k vocabulary (the sum's
    roundings lose its small terms), so the printed scores need the same sum. [n] float32."""
    out = np.zeros(len(targets), F32)
    if not targets:
        return out
    x = rows.float().contiguous()
    toks = np.asarray(targets, np.int32)
    lib = _lib()
    if lib is not None:
        lib.sharpi_choice_logprobs(x.data_ptr(), x.shape[0], x.shape[1], toks.ctypes.data, out.ctypes.data)
        return out
    a = x.numpy()  # (the same order of float additions; numpy's exp, not libm's expf)
    m = a.max(axis=1)
    sum_p = np.cumsum(np.exp(a - m[:, None]), axis=1, dtype=F32)[:, -1]
    return (a[np.arange(len(toks)), toks] - m - np.log(sum_p)).astype(F32)


def _first_logprob(first: torch.Tensor, token: int) -> float:
    """log of the prefix's last row's probability of token, as llama-perplexity's softmax() gives it (a double sum,
    the probability in float) and its log in float."""
    x = first.float().contiguous()
    lib = _lib()
    if lib is not None:
        return float(lib.sharpi_softmax_logprob(x.data_ptr(), x.shape[0], token))
    p = torch.softmax(x.double(), -1)[token]
    return float(np.log(F32(float(p))))


def sequence_logits(model, cache, task: Task, full: bool = False):
    """-> (logits [V] of the prefix's last token, each sequence's rows from the prefix on: [len - prefix, V] with
    full, else without the last token's row), each sequence evaluated after the prefix with the cache cut back to
    it (where a recurrent state cannot be cut back there, from its start): the fallback where a pass cannot hold
    several sequences."""
    p = task.prefix
    cache.truncate(0)
    first = model.forward(torch.tensor(task.seqs[0][:p]), 0, cache, last_n=1)[0].float()
    rows = []
    for s in task.seqs:
        end = len(s) if full else len(s) - 1
        start = cache.reach(p) if hasattr(cache, "reach") else p
        cache.truncate(start)
        out = model.forward(torch.tensor(s[start:end]), start, cache).float() if end > start else None
        rows.append(out[p - start:] if out is not None else torch.zeros(0, first.shape[0]))
    return first, rows


@dataclass
class Requests:
    """What a batch's scores read from its output rows (indices in the batch's order of outputs, as
    llama-perplexity's batch_logits): pairs' log-probabilities (compute_logprobs' float arithmetic) and firsts' (its
    softmax(): the prefix's last row)."""
    pairs: list[tuple[int, int]] = field(default_factory=list)
    firsts: list[tuple[int, int]] = field(default_factory=list)


def _layout(tasks: list[Task], all_out: bool):
    """llama-perplexity's batch of these tasks: each task's prefix once (its last row an output), then each
    sequence's rest (outputs: every row with all_out, winogrande's; else all but the last) -> (tokens, positions,
    the rows' Sequences fields lo / hole / own, output flags, each task's first output index)."""
    tok, pos, lo, hole, own, out, first_out = [], [], [], [], [], [], []
    n_out = 0
    for t in tasks:
        p0, cp = len(tok), t.prefix
        first_out.append(n_out)
        for i in range(cp):
            tok.append(t.seqs[0][i]), pos.append(i), lo.append(p0), hole.append(p0), own.append(p0)
            out.append(i == cp - 1)
        for s in t.seqs:
            b = len(tok)
            for i in range(cp, len(s)):
                tok.append(s[i]), pos.append(i), lo.append(p0), hole.append(p0 + cp), own.append(b)
                out.append(all_out or i < len(s) - 1)
        n_out += sum(out[p0:])
    return tok, pos, lo, hole, own, out, first_out


def _values(req: Requests, idx: int, logits: torch.Tensor, lp: np.ndarray, first: dict, pairs_at: dict,
            firsts_at: dict) -> None:
    """The requests of output rows [idx, idx + len(logits)) from their logits [n, V] (pairs_at / firsts_at: the
    requests of each output row)."""
    rows = range(idx, idx + logits.shape[0])
    sel = [(k, r) for r in rows for k in pairs_at.get(r, ())]
    if sel:
        ks = [k for k, _ in sel]
        lp[ks] = _logprobs(logits[[r - idx for _, r in sel]], [req.pairs[k][1] for k in ks])
    for r in rows:
        for tok in firsts_at.get(r, ()):
            first[r, tok] = _first_logprob(logits[r - idx], tok)


def evaluate(model, cache, tasks: list[Task], layout: tuple, req: Requests, all_out: bool, n_batch: int,
             n_ubatch: int, batched: bool) -> tuple[np.ndarray, dict]:
    """The requests' values for one batch of tasks: with batched, as llama-perplexity evaluates it (the batch in
    passes of n_ubatch rows within sub-batches of n_batch, the tasks' sequences side by side in the cache, each
    row's logits those of its row in llama.cpp's passes: its kernels see the same row counts); else task by task,
    each sequence after its prefix (sequence_logits). layout: _layout's of the tasks. -> (the pairs' float32 values,
    {(row, token): first's})."""
    pairs_at: dict = {}
    firsts_at: dict = {}
    for k, (r, _) in enumerate(req.pairs):
        pairs_at.setdefault(r, []).append(k)
    for r, tok in req.firsts:
        firsts_at.setdefault(r, []).append(tok)
    lp, first = np.zeros(len(req.pairs), F32), {}
    tok, pos, lo, hole, own, out, first_out = layout
    if not batched:
        for t, o in zip(tasks, first_out):
            f, rows = sequence_logits(model, cache, t, full=all_out)
            _values(req, o, torch.cat([f[None]] + rows), lp, first, pairs_at, firsts_at)
        return lp, first
    from .models.transformer import Sequences
    cache.truncate(0)
    T = torch.tensor
    n_done = 0
    for a0 in range(0, len(tok), n_batch):
        for a in range(a0, min(len(tok), a0 + n_batch), n_ubatch):
            b = min(len(tok), a0 + n_batch, a + n_ubatch)
            rows = [i for i in range(a, b) if out[i]]
            seqs = Sequences(T(pos[a:b]), T(lo[a:b]), T(hole[a:b]), T(own[a:b]))
            logits = model.forward(T(tok[a:b]), a, cache, seqs=seqs,
                                   out_rows=T([i - a for i in rows] or [b - 1 - a])).float()
            if rows:
                _values(req, n_done, logits, lp, first, pairs_at, firsts_at)
                n_done += len(rows)
    return lp, first


def batches(tasks: list[Task], n_ctx: int, max_seqs: int):
    """llama-perplexity's batches: tasks in order while their tokens fit in n_ctx and their sequences in
    max_seqs (a task that fits neither alone: an error)."""
    i0 = 0
    while i0 < len(tasks):
        n_cur, n_seq, i1 = 0, 0, i0
        while i1 < len(tasks) and n_cur + tasks[i1].required <= n_ctx and n_seq + len(tasks[i1].seqs) <= max_seqs:
            n_cur += tasks[i1].required
            n_seq += len(tasks[i1].seqs)
            i1 += 1
        if i1 == i0:
            t = tasks[i0]
            if t.required > n_ctx:
                raise SharpiError(f"task {t.number} does not fit in the context window (requires {t.required} "
                                  f"tokens, the context holds {n_ctx}: raise -c)")
            raise SharpiError(f"task {t.number} has {len(t.seqs)} answers: it needs -np/--parallel {len(t.seqs)} or "
                              f"more (one sequence an answer; {max_seqs} now)")
        yield tasks[i0:i1]
        i0 = i1


def _mean_f32(first: float, rest) -> F32:
    """(first + rest...) / count, summed in float in order, as llama-perplexity's multiple-choice scores."""
    acc = F32(first)
    for v in rest:
        acc = F32(acc + v)
    return F32(acc / F32(1 + len(rest)))


def ending_requests(t: Task, i_logits: int, req: Requests) -> None:
    """hellaswag's and multiple choice's reads: each sequence's first token from the prefix's last row, its others
    from the rows before them."""
    li = 1
    for s in t.seqs:
        req.firsts.append((i_logits, s[t.prefix]))
        for j in range(t.prefix, len(s) - 1):
            req.pairs.append((i_logits + li, s[j + 1]))
            li += 1


def ending_scores(t: Task, i_logits: int, values, ir: int, mean32: bool) -> tuple[list, int]:
    """Each sequence's mean log-probability (hellaswag: in double; multiple choice: in float), reading the pairs'
    values from ir on -> (scores, the next ir)."""
    lp, first = values
    out = []
    for s in t.seqs:
        n = len(s) - 1 - t.prefix
        f = first[i_logits, s[t.prefix]]
        if mean32:
            out.append(_mean_f32(f, lp[ir:ir + n]))
        else:
            acc = f
            for v in lp[ir:ir + n].tolist():
                acc += v
            out.append(acc / (1 + n))
        ir += n
    return out, ir


K_MIN_TRAILING = 3  # winogrande: a continuation longer than this after the prefix is scored without its choice


def _wino_spans(t: Task):
    """For each sentence: (base, last, first row offset) as llama-perplexity reads it: the tokens after the choice
    (base: the sentence up to and with its choice; the shared prefix where a rest is short), the last token left out
    where more than one remains. The batch's rows are [prefix's last, sentence 1's rows from the prefix on,
    sentence 2's]; sentence 2's first row is taken at index len(1) - prefix + base2 - prefix, which where the choice
    is scored (base2 = prefix) is sentence 1's last row rather than the prefix's (llama.cpp's FIXME there): so here
    too."""
    s1, s2 = t.seqs
    p = t.prefix
    skip = len(s1) - p > K_MIN_TRAILING and len(s2) - p > K_MIN_TRAILING
    for k, s in enumerate(t.seqs):
        base = t.bases[k] if skip else p
        last = 1 if len(s) - base > 1 else 0
        yield s, base, last, (base - p if k == 0 else len(s1) - p + base - p)


def winogrande_requests(t: Task, i_logits: int, req: Requests) -> None:
    for s, base, last, li in _wino_spans(t):
        for m, j in enumerate(range(base - 1, len(s) - 1 - last)):
            req.pairs.append((i_logits + li + m, s[j + 1]))


def winogrande_scores(t: Task, values, ir: int) -> tuple[list, int]:
    lp, _ = values
    out = []
    for s, base, last, _ in _wino_spans(t):
        n = len(s) - 1 - last - (base - 1)
        acc = F32(0)
        for v in lp[ir:ir + max(n, 0)]:
            acc = F32(acc + v)
        with np.errstate(divide="ignore", invalid="ignore"):
            out.append(F32(acc / F32(len(s) - base - last)))
        ir += max(n, 0)
    return out, ir


def wilson(freq: float, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of an accuracy over n tasks, as llama-perplexity's hellaswag lines give it."""
    za = 1.95996398454
    z = za * za / n
    cnf = z * math.sqrt(n * (4.0 * freq * (1 - freq) + z)) / (za + za)
    return (freq + z * 0.5 - cnf) / (1.0 + z), (freq + z * 0.5 + cnf) / (1.0 + z)


def final_f32(k: int, n: int, n_err: int | None = None) -> tuple[F32, F32]:
    """(k / n, sqrt(p (1 - p) / (n_err - 1))) in float as llama-perplexity's closing lines compute them (n_err: n,
    or the tasks where it divides random chance's spread by them)."""
    n_err = n if n_err is None else n_err
    p = F32(F32(k) / F32(n))
    with np.errstate(divide="ignore", invalid="ignore"):
        sigma = F32(np.sqrt(F32(F32(p * F32(F32(1) - p)) / F32(n_err - 1))))
    return p, sigma


def first_best(scores) -> int:
    """The index of the first maximum, compared as llama-perplexity compares them (a NaN never wins)."""
    best = 0
    for s in range(1, len(scores)):
        if scores[s] > scores[best]:
            best = s
    return best


# ---- the three scores, line by line as llama-perplexity writes them ----------------------------------------------
@dataclass
class Setup:
    """How the tasks are evaluated: the context (-c x sequences, rounded up to 256 as llama.cpp rounds it), the
    sequences a batch (max(4, -np)), the passes (-b and -ub, each at most the context), the cache types."""
    n_ctx: int
    n_seq: int
    n_batch: int = 2048
    n_ubatch: int = 512
    type_k: str = "f16"
    type_v: str = "f16"

    def passes(self) -> tuple[int, int]:
        n_batch = min(self.n_batch, self.n_ctx)
        return n_batch, min(self.n_ubatch, n_batch)


def _score_batches(model, tasks: list[Task], st: Setup, max_seqs: int, all_out: bool, request, score, info,
                   what: str):
    """The tasks' batches, checked now (a task that cannot fit: its error before any line) -> an iterator of (task,
    its scores) in order, each batch's requests evaluated as it comes. One cache of the context's size; several
    sequences a pass where the model allows it (attention by the C kernel, no recurrent layers), else each sequence
    after its prefix, with a warning that the last digits may then differ."""
    groups = list(batches(tasks, st.n_ctx, max_seqs))
    info(f"{what}: calculating the score over {len(tasks)} tasks")
    batched = model.sequences_ok()
    if not batched:
        info("warning: this model's passes cannot hold several sequences: each continuation is evaluated after its "
             "prefix, so the scores' last digits may differ from llama-perplexity's")
    cache = model.new_cache(st.n_ctx if batched else max(len(s) for t in tasks for s in t.seqs), st.type_k, st.type_v)
    n_batch, n_ubatch = st.passes()

    def scored():
        for group in groups:
            layout, req = _layout(group, all_out), Requests()
            starts = layout[-1]  # (each task's first output row)
            for t, o in zip(group, starts):
                request(t, o, req)
            values = evaluate(model, cache, group, layout, req, all_out, n_batch, n_ubatch, batched)
            ir = 0
            for t, o in zip(group, starts):
                scores, ir = score(t, o, values, ir)
                yield t, scores
    return scored()


def _tasks(items, bad_prefix: str) -> list[Task]:
    out = []
    for i, seqs in enumerate(items):
        p = min(shared_prefix(seqs), min(map(len, seqs)) - 1)
        if p < 1:
            raise SharpiError(f"{bad_prefix}task {i}: its continuations share no first token to score them after")
        out.append(Task(seqs, p, number=i))
    return out


def run_hellaswag(model, encode, text: str, n_tasks: int, st: Setup, out: Callable[[str], None],
                  info: Callable[[str], None]) -> None:
    """llama-perplexity --hellaswag: acc_norm (each ending by its tokens' mean log-probability) over the drawn
    tasks, a line a task with the running accuracy and its 95% interval."""
    items = hellaswag_tasks(text, n_tasks)
    tasks = _tasks([[encode(ctx + " " + e) for e in endings] for ctx, _, endings in items], "hellaswag: ")
    for t, (_, gold, _) in zip(tasks, items):
        t.gold = gold
    scored = _score_batches(model, tasks, st, min(128, st.n_seq), False, ending_requests,
                            lambda t, o, v, ir: ending_scores(t, o, v, ir, False), info, "hellaswag")
    out("\ntask\tacc_norm\t95% confidence interval")
    acc = 0.0
    for i, (t, scores) in enumerate(scored):
        acc += first_best(scores) == t.gold
        freq = acc / (i + 1)
        lo, hi = wilson(freq, i + 1)
        out(f"{i + 1}\t{freq * 100.0:3.8f}%\t[{lo * 100.0:3.4f}%, {hi * 100.0:3.4f}%]")
    out("")


def run_winogrande(model, encode, text: str, n_tasks: int, st: Setup, out: Callable[[str], None],
                   info: Callable[[str], None]) -> None:
    """llama-perplexity --winogrande: each sentence with either choice in the blank, scored by the tokens after
    the choice; a line a task (running accuracy, the two scores, the pick and the answer), the final score from
    100 tasks on."""
    rows = winogrande_rows(text, info)
    if not rows:
        raise SharpiError("winogrande: no tasks in the file")
    chosen = [rows[i] for i in pick(len(rows), n_tasks)]
    tasks = _tasks([[encode(f + c1 + sec), encode(f + c2 + sec)] for f, sec, c1, c2, _ in chosen],
                   "winogrande: ")
    for t, (f, _, c1, c2, answer) in zip(tasks, chosen):
        t.gold = answer
        t.bases = tuple(max(len(encode(f + c)), t.prefix) for c in (c1, c2))
    n_correct = 0
    scored = _score_batches(model, tasks, st, min(256, st.n_seq), True, winogrande_requests,
                            lambda t, o, v, ir: winogrande_scores(t, v, ir), info, "winogrande")
    for i, (t, (s1, s2)) in enumerate(scored):
        result = 1 if s1 > s2 else 2
        n_correct += result == t.gold
        out(f"{i + 1}\t{100.0 * n_correct / (i + 1):.4f}\t{float(s1):10.6f}  {float(s2):10.6f}  {result}  {t.gold}")
    out("")
    if len(tasks) >= 100:
        p, sigma = final_f32(n_correct, len(tasks))
        info(f"Final Winogrande score({len(tasks)} tasks): {printf_f(float(F32(100) * p), '.4f')} +/- "
             f"{printf_f(float(F32(100) * sigma), '.4f')}")


def run_multiple_choice(model, encode, data: bytes, n_tasks: int, st: Setup, out: Callable[[str], None],
                        info: Callable[[str], None]) -> None:
    """llama-perplexity --multiple-choice: each answer after the question, scored as hellaswag's endings; right when
    the best answer is labelled 1; a line a task (running accuracy), then the final result and random chance."""
    items = multiple_choice_items(data, n_tasks)
    for i, (q, answers, _) in enumerate(items):
        if not q or not answers:
            raise SharpiError(f"multiple choice: task {i} has an empty question or no answers")
        if not all(answers):
            raise SharpiError(f"multiple choice: task {i} has an empty answer")
    tasks = _tasks([[encode(q + " " + a) for a in answers] for q, answers, _ in items], "multiple choice: ")
    for t, (_, _, labels) in zip(tasks, items):
        t.labels = labels
    n_correct = n_answers = 0
    scored = _score_batches(model, tasks, st, min(128, st.n_seq), False, ending_requests,
                            lambda t, o, v, ir: ending_scores(t, o, v, ir, True), info, "multiple choice")
    out("\ntask\tacc_norm")
    for i, (t, scores) in enumerate(scored):
        n_answers += len(scores)
        n_correct += t.labels[first_best(scores)] == 1
        out(f"{i + 1}\t{100.0 * n_correct / (i + 1):.8f}")
    out("")
    p, sigma = final_f32(n_correct, len(tasks))
    # (one task: 0 / 0, the x86 default NaN, which llama-perplexity prints as -nan)
    info(f"Final result: {printf_f(float(F32(100) * p), '.4f')} +/- {printf_f(float(F32(100) * sigma), '.4f')}")
    p, sigma = final_f32(len(tasks), n_answers, len(tasks))
    info(f"Random chance: {printf_f(float(F32(100) * p), '.4f')} +/- {printf_f(float(F32(100) * sigma), '.4f')}")
