"""Perplexity the way llama-perplexity computes it (its default, non-strided mode).

The text is tokenized once; chunks of n_ctx tokens are evaluated each in a fresh context (with
the first token replaced by BOS when the model adds BOS); the second half of each chunk is scored.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import SharpiError
from .files import replaced


@dataclass
class PerplexityResult:
    ppl: float
    err: float
    n_chunks: int
    n_scored: int
    chunk_ppl: list[float]


def chunk_count(n_tokens: int, n_ctx: int, n_chunks: int = -1) -> int:
    """The chunks evaluated: all the whole ones the text has (n_chunks < 0), or at most n_chunks."""
    if n_ctx < 3 or n_chunks == 0:  # each chunk scores its second half, after that half's first token
        raise SharpiError(f"perplexity needs a context of 3 tokens or more (not {n_ctx}) and 1 chunk or more")
    available = n_tokens // n_ctx
    if available < 1:
        raise SharpiError(f"need at least {n_ctx} tokens for perplexity at -c {n_ctx}, the text has {n_tokens}")
    return available if n_chunks < 0 else min(n_chunks, available)


@dataclass(frozen=True)
class Passes:
    """The rows of llama-perplexity's passes over a chunk, from -b / -ub. Below -c (n_seq 1) a chunk goes in batches
    of -b rows, each in passes of -ub: rows a pass. With n_seq >= 2 chunks a batch (-b at least twice -c), its
    sequences have streams of their own and each pass (ubatch) takes the same number of rows from every chunk of the
    batch (llama_batch_allocr::split_equal): max(1, n_ubatch // the batch's chunks) rows a chunk, the last batch
    holding the chunks left. 0 rows: a chunk in one pass; batch: the rows of a batch below -c (0: the chunk)."""
    rows: int = 0
    n_seq: int = 1
    n_ubatch: int = 512
    batch: int = 0

    def for_chunk(self, i: int, n_chunks: int) -> int:
        if self.n_seq < 2:
            return self.rows
        in_batch = min(self.n_seq, n_chunks - i // self.n_seq * self.n_seq)
        return max(1, self.n_ubatch // in_batch)

    @staticmethod
    def of(n_batch: int, n_ubatch: int, n_ctx: int, n_ctx_file: int | None = None) -> "Passes":
        """llama-perplexity's passes for -b n_batch, -ub n_ubatch, -c n_ctx; n_ctx_file: the chunks' length where it
        is not -c (--kl-divergence: the base file's, its sequences a batch capped by those -c allows)."""
        n_par = max(1, n_batch // n_ctx)  # (its sequences: whole chunks of -c a batch)
        n_batch = min(n_batch, n_par * n_ctx)
        step = min(n_batch, n_ubatch)
        chunk = n_ctx_file or n_ctx
        n_seq = min(max(1, n_batch // chunk), n_par)
        if n_seq >= 2:
            return Passes(0, n_seq, step)
        return Passes(step if step < chunk else 0, batch=n_batch if n_batch < chunk else 0)


def _pass_rows(n_pass, i: int, n_chunks: int, n_ctx: int) -> int:
    rows = n_pass.for_chunk(i, n_chunks) if isinstance(n_pass, Passes) else n_pass
    return rows if 0 < rows < n_ctx else n_ctx


def perplexity(model, tokens: list[int], n_ctx: int, n_chunks: int = -1, bos_id: int | None = None,
               type_k: str = "f16", type_v: str = "f16",
               on_chunk: Callable[[int, float, float, int], None] | None = None,
               n_pass: int | Passes = 0) -> PerplexityResult:
    """n_pass: the rows of a forward pass (llama-perplexity's -b, -ub below n_ctx: a chunk in several); 0: a chunk
    in one."""
    n = chunk_count(len(tokens), n_ctx, n_chunks)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    chunk_ppl = []
    for i, chunk, rows in _chunks_logits(model, tokens, n_ctx, n, bos_id, type_k, type_v, n_pass):
        lp = torch.log_softmax(rows.double(), dim=-1)
        tgt = torch.tensor(chunk[first + 1:n_ctx])
        tok_nll = -lp.gather(1, tgt[:, None])[:, 0]
        nll += float(tok_nll.sum())
        nll2 += float((tok_nll ** 2).sum())
        count += tok_nll.numel()
        chunk_ppl.append(math.exp(nll / count))
        if on_chunk:
            on_chunk(i, nll, nll2, count)
    return _result(nll, nll2, count, n, chunk_ppl)


def _result(nll: float, nll2: float, count: int, n_chunks: int, chunk_ppl: list[float]) -> PerplexityResult:
    """llama-perplexity's final estimate from the sums of the scored rows' negative log-likelihoods."""
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return PerplexityResult(ppl, err, n_chunks, count, chunk_ppl)


def _chunks_logits(model, tokens, n_ctx: int, n_chunks: int, bos_id, type_k, type_v, n_pass: int | Passes = 0):
    """(chunk index, its tokens, the logits of its scored rows [n_ctx - 1 - first, V] fp32) for each chunk, each
    evaluated in a fresh context with its first token replaced by BOS where the model adds BOS, in passes of n_pass
    rows (0: one; Passes: llama-perplexity's, several chunks a pass where its batches hold several)."""
    if isinstance(n_pass, Passes) and n_pass.n_seq >= 2 and n_ctx >= STREAMS_MIN_CTX and model.sequences_ok():
        yield from _streams_logits(model, tokens, n_ctx, n_chunks, bos_id, type_k, type_v, n_pass)
        return
    first = n_ctx // 2
    cache = model.new_cache(n_ctx, type_k, type_v)
    for i in range(n_chunks):
        chunk = [int(t) for t in tokens[i * n_ctx:(i + 1) * n_ctx]]
        sent = list(chunk)
        if bos_id is not None:
            sent[0] = bos_id
        cache.truncate(0)
        step = _pass_rows(n_pass, i, n_chunks, n_ctx)
        batch = n_pass.batch if isinstance(n_pass, Passes) and 0 < n_pass.batch < n_ctx else n_ctx
        rows = []  # the scored rows of each pass
        for b in range(0, n_ctx, batch):  # batches of -b rows, each in passes of -ub (a batch's last pass: the rest)
            for s in range(b, min(b + batch, n_ctx), step):
                e = min(s + step, b + batch, n_ctx)
                logits = model.forward(torch.tensor(sent[s:e]), s, cache)  # [e - s, V]
                if e > first:
                    rows.append(logits[max(first - s, 0):n_ctx - 1 - s])
        yield i, chunk, (rows[0] if len(rows) == 1 else torch.cat(rows)).float().contiguous()


STREAMS_MIN_CTX = 16  # (below, a stream's 64 aligned cells would cost more cache than the chunks: each chunk alone)


def _streams_logits(model, tokens, n_ctx: int, n_chunks: int, bos_id, type_k, type_v, passes: Passes):
    """_chunks_logits where llama-perplexity's batches hold several chunks: each chunk a sequence with a stream (a
    cache) of its own, each pass the next rows of every chunk of the batch (split_equal's ubatch: the chunks' rows one
    after the other). So the pass's matmuls see all its rows, each chunk's attention its own rows and cells (here a
    region of one cache, starting at a multiple of 64 as a stream's cells start at 0: the attention kernels' tiles of
    64 positions and lanes fall alike), and the last layer runs on the rows llama-perplexity asks logits of (positions
    from n_ctx / 2 on)."""
    from .models.transformer import Sequences
    first, region = n_ctx // 2, -(-n_ctx // 64) * 64
    cache = model.new_cache(region * passes.n_seq, type_k, type_v)
    T = torch.tensor
    for g0 in range(0, n_chunks, passes.n_seq):
        group = range(g0, min(n_chunks, g0 + passes.n_seq))
        chunks = [[int(t) for t in tokens[i * n_ctx:(i + 1) * n_ctx]] for i in group]
        sents = [[bos_id] + c[1:] if bos_id is not None else c for c in chunks]
        R = passes.for_chunk(g0, n_chunks)
        rows: list[list[torch.Tensor]] = [[] for _ in group]
        cache.truncate(0)
        for m0 in range(0, n_ctx, R):
            m1 = min(n_ctx, m0 + R)
            toks = [t for s in sents for t in s[m0:m1]]
            pos = T([p for _ in group for p in range(m0, m1)])
            base = T([k * region for k in range(len(group)) for _ in range(m0, m1)])
            out = [r for r, p in enumerate(pos.tolist()) if p >= first]
            logits = model.forward(T(toks), 0, cache, seqs=Sequences(pos, base, base, base, base + pos),
                                   out_rows=T(out or [len(toks) - 1]))
            if not out:
                continue
            n = len(out) // len(group)  # (each chunk's outputs: its rows at positions >= first, the same count)
            for k in range(len(group)):
                rows[k].append(logits[k * n:(k + 1) * n])
        for k, i in enumerate(group):
            yield i, chunks[k], torch.cat(rows[k])[:n_ctx - 1 - first].float().contiguous()


# ---- llama-perplexity's --kl-divergence-base files and --kl-divergence -------------------------------------------
# A base file: b"_logits_", int32 n_ctx, int32 n_vocab, int32 n_chunk, the n_chunk * n_ctx tokens evaluated (int32),
# then for each chunk the scored rows' log-probabilities (n_ctx - 1 - n_ctx / 2 rows of nv = 2 * ((n_vocab + 1) / 2)
# + 4 uint16: two floats, scale and min_log_prob, then a 16-bit step per token; see kernels/ops.c). The same bytes as
# llama-perplexity writes from the same logits, so files go both ways between the two.
LOGITS_MAGIC = b"_logits_"


def _row_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def _ppl_lib():
    import ctypes

    from .kernels import cpu
    if not cpu.available():
        raise SharpiError(f"--kl-divergence needs sharpi's CPU kernels: {cpu.status().get('reason')}")
    lib = cpu._symbols()
    lib.sharpi_ppl_logprobs.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    lib.sharpi_ppl_logprobs.restype = ctypes.c_double
    lib.sharpi_kld_row.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_void_p]
    lib.sharpi_kld_row.restype = None
    return lib


def save_logprobs(model, tokens: list[int], n_ctx: int, n_chunks: int, path: str, bos_id: int | None = None,
                  type_k: str = "f16", type_v: str = "f16",
                  on_chunk: Callable[[int, float, float, int], None] | None = None,
                  n_pass: int | Passes = 0) -> PerplexityResult:
    """Perplexity as llama-perplexity computes it with --kl-divergence-base (each row's log-likelihood in float
    arithmetic), the scored rows' log-probabilities written to path (files.replaced: a run that fails leaves what
    was there)."""
    import numpy as np
    lib = _ppl_lib()
    n = chunk_count(len(tokens), n_ctx, n_chunks)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count, chunk_ppl = 0, []
    try:
        with replaced(path) as out:
            out.write(LOGITS_MAGIC + np.array([n_ctx], dtype=np.int32).tobytes())
            for i, chunk, rows in _chunks_logits(model, tokens, n_ctx, n, bos_id, type_k, type_v, n_pass):
                n_vocab = rows.shape[1]
                if i == 0:
                    out.write(np.array([n_vocab, n], dtype=np.int32).tobytes())
                    out.write(np.asarray(tokens[:n * n_ctx], dtype=np.int32).tobytes())
                nv = _row_width(n_vocab)
                lp = np.zeros((rows.shape[0], nv), dtype=np.uint16)
                for r in range(rows.shape[0]):
                    v = lib.sharpi_ppl_logprobs(rows[r].data_ptr(), n_vocab, chunk[first + 1 + r], lp[r].ctypes.data)
                    nll += v
                    nll2 += v * v
                out.write(lp.tobytes())
                count += rows.shape[0]
                chunk_ppl.append(math.exp(nll / count))
                if on_chunk:
                    on_chunk(i, nll, nll2, count)
    except OSError as e:
        raise SharpiError(f"cannot write {path}: {e.strerror or e}") from None
    return _result(nll, nll2, count, n, chunk_ppl)


def read_base_header(path: str):
    """(n_ctx, n_vocab, n_chunk, tokens, offset of the log-probabilities) of a --kl-divergence-base file."""
    import numpy as np
    try:
        with open(path, "rb") as f:
            head = f.read(20)
            if len(head) < 20 or head[:8] != LOGITS_MAGIC:
                raise SharpiError(f"{path} does not look like a file of log-probabilities (llama-perplexity's "
                                  "--kl-divergence-base)")
            n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(head[8:20], dtype=np.int32))
            if n_ctx < 3 or n_vocab < 1 or n_chunk < 1:
                raise SharpiError(f"{path}: a damaged header (n_ctx {n_ctx}, n_vocab {n_vocab}, {n_chunk} chunks)")
            off = 20 + 4 * n_ctx * n_chunk
            need = off + n_chunk * (n_ctx - 1 - n_ctx // 2) * _row_width(n_vocab) * 2
            size = os.fstat(f.fileno()).st_size
            if size < need:  # (before reading the tokens: a damaged header may ask for terabytes)
                raise SharpiError(f"{path}: cut short ({size} bytes, its header needs {need})")
            tokens = np.fromfile(f, dtype=np.int32, count=n_ctx * n_chunk)
    except OSError as e:
        raise SharpiError(f"cannot read {path}: {e.strerror or e}") from None
    if len(tokens) < n_ctx * n_chunk:
        raise SharpiError(f"{path}: cut short ({size} bytes, its header needs {need})")
    return n_ctx, n_vocab, n_chunk, tokens, off


def _sqrt(x: float) -> float:
    """C's sqrt: a negative argument (two uncertainties that cancel, as a model against its own base file
    leaves them, less rounding) is the x86 default NaN, which llama-perplexity prints as -nan."""
    return math.sqrt(x) if x >= 0 else -math.nan


def _div(a: float, b: float) -> float:
    """a / b as C divides doubles (a zero b: an infinity, or -nan for 0 / 0)."""
    if b:
        return a / b
    return -math.nan if a == 0 or a != a else math.copysign(math.inf, a) * math.copysign(1.0, b)


def printf_f(x: float, spec: str) -> str:
    """printf's %<spec> of a double: NaNs as glibc writes them (-nan with the sign bit), which Python's format does not."""
    if x == x:
        return format(x, spec)
    return format("-nan" if math.copysign(1.0, x) < 0 else "nan", ">" + spec.split(".")[0])


def _mean_unc(s: float, s2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def _cov(a: float, b: float, ab: float, count: int) -> float:
    return 0.0 if count < 10 else (ab / count - (a / count) * (b / count)) / (count - 1)


def kl_divergence(model, path: str, bos_id: int | None = None, type_k: str = "f16", type_v: str = "f16",
                  out: Callable[[str], None] = print, info: Callable[[str], None] | None = None,
                  n_pass: int | Passes = 0) -> dict:
    """llama-perplexity --kl-divergence: the base file's chunks evaluated again by this model, each scored row's
    distribution against the base's; llama-perplexity's table (a line a chunk) and statistics, through out (info:
    what is computed, once the file is found to fit the model)."""
    import numpy as np
    lib = _ppl_lib()
    n_ctx, n_vocab, n_chunk, tokens, off = read_base_header(path)
    if n_vocab != model.config.n_vocab:
        raise SharpiError(f"{path}: made with a vocabulary of {n_vocab} tokens, this model has {model.config.n_vocab}")
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
        raise SharpiError(f"{path}: damaged (token id {bad} outside its vocabulary of {n_vocab})")
    if info:
        info(f"kl_divergence: {path}, chunks of {n_ctx} tokens")
    first = n_ctx // 2
    nrow, nv = n_ctx - 1 - first, _row_width(n_vocab)
    acc = np.zeros(13, dtype=np.float64)
    kld_values = np.zeros(nrow * n_chunk, dtype=np.float32)
    p_diff_values = np.zeros(nrow * n_chunk, dtype=np.float32)
    row_out = np.zeros(2, dtype=np.float64)
    base = np.memmap(path, dtype=np.uint16, mode="r", offset=off, shape=(n_chunk, nrow, nv))
    out("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
        "            Same top p")
    for i, chunk, rows in _chunks_logits(model, tokens, n_ctx, n_chunk, bos_id, type_k, type_v, n_pass):
        b = np.ascontiguousarray(base[i])
        for r in range(nrow):
            lib.sharpi_kld_row(rows[r].data_ptr(), n_vocab, b[r].ctypes.data, chunk[first + 1 + r], acc.ctypes.data,
                               row_out.ctypes.data)
            kld_values[i * nrow + r], p_diff_values[i * nrow + r] = row_out
        count = int(acc[12])
        lp, lp_unc = _mean_unc(acc[0], acc[1], count)
        lb, lb_unc = _mean_unc(acc[2], acc[3], count)
        cov = _cov(acc[0], acc[2], acc[4], count)
        ratio_unc = _sqrt(lp_unc * lp_unc + lb_unc * lb_unc - 2.0 * cov)
        kl, kl_unc = _mean_unc(acc[5], acc[6], count)
        mse, mse_unc = _mean_unc(acc[8], acc[9], count)
        rms = math.sqrt(mse)
        top = acc[11] / count
        out(f"{i + 1:4d}    {math.exp(lp):9.4f} ± {math.exp(lp) * lp_unc:9.4f}    {lp - lb:10.5f} ± {printf_f(ratio_unc, '10.5f')}"
            f"    {kl:10.5f} ± {kl_unc:10.5f}    {100.0 * rms:6.3f} ± {100.0 * (0.5 / rms * mse_unc if rms else 0.0):6.3f} %"
            f"    {100.0 * top:6.3f} ± {100.0 * math.sqrt(top * (1 - top) / (count - 1)) if count > 1 else 0.0:6.3f} %")
    out("")
    count = int(acc[12])
    stats = {"count": count, "mean_kld": acc[5] / count, "same_top": acc[11] / count}
    if count < 100:  # (llama-perplexity: no statistics on so few values)
        return stats
    kld_values.sort()
    p_diff_values.sort()
    lp, lp_unc = _mean_unc(acc[0], acc[1], count)
    ppl, ppl_unc = math.exp(lp), math.exp(lp) * lp_unc
    lb, lb_unc = _mean_unc(acc[2], acc[3], count)
    ppl_b, ppl_b_unc = math.exp(lb), math.exp(lb) * lb_unc
    cov = _cov(acc[0], acc[2], acc[4], count)
    out("====== Perplexity statistics ======")
    out(f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_unc:10.6f}")
    out(f"Mean PPL(base)                : {ppl_b:10.6f} ± {ppl_b_unc:10.6f}")
    out(f"Cor(ln(PPL(Q)), ln(PPL(base))): {printf_f(_div(100.0 * cov, lp_unc * lb_unc), '6.2f')}%")
    ratio, ratio_unc = lp - lb, _sqrt(lp_unc * lp_unc + lb_unc * lb_unc - 2.0 * cov)
    out(f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {printf_f(ratio_unc, '10.6f')}")
    out(f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {printf_f(math.exp(ratio) * ratio_unc, '10.6f')}")
    ppl_cov = ppl * ppl_b * cov
    out(f"Mean PPL(Q)-PPL(base)         : {ppl - ppl_b:10.6f} ± "
        f"{printf_f(_sqrt(ppl_unc * ppl_unc + ppl_b_unc * ppl_b_unc - 2.0 * ppl_cov), '10.6f')}")
    out("")
    out("====== KL divergence statistics ======")
    kl, kl_unc = _mean_unc(acc[5], acc[6], count)
    out(f"Mean    KLD: {kl:10.6f} ± {kl_unc:10.6f}")
    out(f"Maximum KLD: {kld_values[-1]:10.6f}")
    for f, name in ((0.999, "99.9%"), (0.990, "99.0%"), (0.950, "95.0%"), (0.900, "90.0%")):
        out(f"{name}   KLD: {_percentile(kld_values, f):10.6f}")
    out(f"Median  KLD: {_median(kld_values):10.6f}")
    for f, name in ((0.100, "10.0%"), (0.050, " 5.0%"), (0.010, " 1.0%"), (0.001, " 0.1%")):
        out(f"{name}   KLD: {_percentile(kld_values, f):10.6f}")
    out(f"Minimum KLD: {kld_values[0]:10.6f}")
    out("")
    out("====== Token probability statistics ======")
    dp, dp_unc = _mean_unc(acc[7], acc[8], count)
    out(f"Mean    Δp: {100.0 * dp:6.3f} ± {100.0 * dp_unc:5.3f} %")
    out(f"Maximum Δp: {100.0 * float(p_diff_values[-1]):6.3f}%")
    for f, name in ((0.999, "99.9%"), (0.990, "99.0%"), (0.950, "95.0%"), (0.900, "90.0%"), (0.750, "75.0%")):
        out(f"{name}   Δp: {100.0 * _percentile(p_diff_values, f):6.3f}%")
    out(f"Median  Δp: {100.0 * _median(p_diff_values):6.3f}%")
    for f, name in ((0.250, "25.0%"), (0.100, "10.0%"), (0.050, " 5.0%"), (0.010, " 1.0%"), (0.001, " 0.1%")):
        out(f"{name}   Δp: {100.0 * _percentile(p_diff_values, f):6.3f}%")
    out(f"Minimum Δp: {100.0 * float(p_diff_values[0]):6.3f}%")
    mse, mse_unc = _mean_unc(acc[8], acc[9], count)
    rms = math.sqrt(mse)
    out(f"RMS Δp    : {100.0 * rms:6.3f} ± {printf_f(_div(100.0 * 0.5, rms) * mse_unc, '5.3f')} %")
    top = acc[11] / count
    out(f"Same top p: {100.0 * top:6.3f} ± {100.0 * math.sqrt(top * (1.0 - top) / (count - 1)):5.3f} %")
    stats.update(mean_kld=kl, ppl=ppl, ppl_base=ppl_b)
    return stats


def _percentile(values, fraction: float) -> float:
    """llama-perplexity's, in float: (1 - p) * v[i] + p * v[i + 1] at p = fraction * (n - 1)."""
    import numpy as np
    f32 = np.float32
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = f32(fraction) * f32(len(values) - 1)
    ip = int(p)
    p = f32(p - f32(ip))
    return float((f32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def _median(values) -> float:
    import numpy as np
    n = len(values)
    return float(values[n // 2] if n % 2 else np.float32(0.5) * (values[n // 2] + values[n // 2 - 1]))
