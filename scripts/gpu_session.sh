#!/usr/bin/env bash
# The GPU checks of the CUDA backend in three calls of the device tool, for a session that has a GPU.
#
# The device machine takes at most 64 MiB of files a call, reaches no network, has no `gguf` package,
# and stays warm (its /tmp kept) for 30 s after a call. So:
#
#   bash scripts/gpu_session.sh prepare    here, once: fills .gpu/a and .gpu/b (.gitignore'd, ~50 MB each):
#                                          gguf's wheel, the llama.cpp fixtures, skeletons of the Qwen
#                                          models (scripts/gguf_synth.py), SmolLM2 in two halves
#   device run, carry [".gpu/a"], command "bash scripts/gpu_session.sh part1"
#       kernels against gguf.quants (tests/test_cuda_kernels.py), then speed on random-weight stand-ins
#       of Qwen 1.5B / 0.5B built there: the matvec kernels per Qwen matrix (bench_cuda_kernels.py;
#       QMV_DEFS="-DQMV_MINB_MID=4;..." compares builds) and attention per split size, a decoding step's
#       kernels (profile_cuda.py),
#       scripts/bench.py, scripts/bench_spec_cost.py. Results in $OUT.
#   device run, carry [".gpu/b"], command "bash scripts/gpu_session.sh part2"   (at once: within 30 s)
#       SmolLM2 complete: the model-level GPU tests (tests/test_cuda_model.py: llama.cpp's greedy
#       continuations, graph replays, verify rows, speculative parity) and its real-tensor kernel tests.
#   The real Qwen pair end to end (1.6 GB: ~26 calls, ~10 minutes of device time): `ship-prepare` here,
#   then `ship NN` there once per piece (carry [".gpu/ship/pNN"]), then `real` (carry [".gpu/ship/w"]):
#   bench.py on the real 1.5B and bench_spec.py --which qwen (plain against -md, measured).
#   device run, carry [".gpu/b"], command "bash scripts/gpu_session.sh part3"   (at once again)
#       the matvec kernels per Qwen matrix and warp split (bench_cuda_kernels.py), and whole decodes
#       as the defaults have them, with the float matvecs (SHARPI_CUDA_DP4A=0), with one warp per row
#       (SHARPI_QMV_SPLIT=1), with nothing fused (SHARPI_CUDA_FUSE=0), and with
#       attention's splits combined by a launch of their own (SHARPI_CUDA_FUSE_COMBINE=0), and without
#       programmatic dependent launch (SHARPI_CUDA_PDL=0); then speculation's costs without it (whether
#       the draft's chain overlaps the verify pass more when no kernel waits resident on the SMs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SMOL=smollm2-135m-instruct-q4_1.gguf
Q15=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
Q05=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

at() { echo "== ${SECONDS}s: $*"; }  # where the call's 10 minutes went

install() {  # gguf (pure Python) from the carried wheel; everything else is on the machine
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl \
        || { echo "cannot install the carried gguf wheel" >&2; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
}

gguf_wheel() {  # here: the wheel of this machine's gguf version into $1 (the device has no gguf package)
    local ver
    ver=$(python3 -c "import importlib.metadata as m; print(m.version('gguf'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform any -d "$1" "gguf==$ver" || exit 1
}

case "${1:-}" in
prepare)
    models=${SHARPI_MODELS_DIR:-$HOME/.cache/sharpi/models}
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b
    gguf_wheel .gpu/a
    cp .gpu/a/*.whl .gpu/b/
    cp "${SHARPI_FIXTURES:-../shared/fixtures}/llamacpp_reference.json" .gpu/a/ || exit 1
    python3 scripts/gguf_synth.py skeleton "$models/$Q15" .gpu/a/q15.json.gz || exit 1
    python3 scripts/gguf_synth.py skeleton "$models/$Q05" .gpu/a/q05.json.gz || exit 1
    half=$(( ($(stat -c %s "$models/$SMOL") + 1) / 2 ))
    head -c "$half" "$models/$SMOL" > .gpu/a/smol.1
    tail -c +"$((half + 1))" "$models/$SMOL" > .gpu/b/smol.2
    sha256sum "$models/$SMOL" | cut -d' ' -f1 > .gpu/b/smol.sha256
    du -sh .gpu/a .gpu/b
    ;;
part1)
    install .gpu/a
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv | tee "$OUT/gpu.txt"
    mkdir -p /tmp/sharpi/real /tmp/sharpi/synth
    cp .gpu/a/smol.1 /tmp/sharpi/
    cat .gpu/a/llamacpp_reference.json > /tmp/sharpi/llamacpp_reference.json
    # the stand-ins under the registry's file names: it takes a file of the right size as cached
    python3 scripts/gguf_synth.py build .gpu/a/q15.json.gz /tmp/sharpi/synth/$Q15
    python3 scripts/gguf_synth.py build .gpu/a/q05.json.gz /tmp/sharpi/synth/$Q05
    at kernel tests
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_kernels.py tests/test_cuda_compile.py 2>&1 \
        | tee "$OUT/kernels.txt" | tail -n 15
    export SHARPI_MODELS_DIR=/tmp/sharpi/synth
    at bench_cuda_kernels.py
    python3 scripts/bench_cuda_kernels.py --ts 1,2,5,16 --splits auto --defs "${QMV_DEFS:-}" 2>&1 \
        | tee "$OUT/kernels_bench.txt"
    at attention
    python3 scripts/bench_cuda_kernels.py --attn 12:2:128:128:1,12:2:128:128:5,12:2:128:1000:1 2>&1 \
        | tee "$OUT/attn_bench.txt"
    # the loads in flight before (K: 8 a thread, V: 4 keys), the same bits
    SHARPI_CUDA_OPS_DEFS="-DATT_K_LOADS=8 -DATT_V_LOADS=4" python3 scripts/bench_cuda_kernels.py \
        --attn 12:2:128:128:1,12:2:128:1000:1 2>&1 | tee "$OUT/attn_bench_k8v4.txt"
    at profile_cuda.py
    # without programmatic launch: each kernel's time is its own (with it, a kernel starts while the one
    # before runs, and its time includes that wait)
    SHARPI_CUDA_PDL=0 python3 scripts/profile_cuda.py -m ${Q15%.gguf} -p 128 --rows 1,5 2>&1 | tee "$OUT/profile.txt"
    at bench.py
    python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 3 -p 128 -n 128 2>&1 | tee "$OUT/bench.txt"
    at bench.py, float matvecs
    SHARPI_CUDA_DP4A=0 python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 128 -n 128 2>&1 \
        | tee "$OUT/bench_float.txt"
    at bench_spec_cost.py
    python3 scripts/bench_spec_cost.py --device cuda --ks 2,4,6 2>&1 | tee "$OUT/spec_cost.txt"
    at done
    ;;
ship-prepare)  # here: the real Qwen pair (1.6 GB) in 62 MB pieces .gpu/ship/pNN, a call's carry each
    models=${SHARPI_MODELS_DIR:-$HOME/.cache/sharpi/models}
    rm -rf .gpu/ship && mkdir -p .gpu/ship
    (cd "$models" && sha256sum $Q15 $Q05 && stat -c '%n %s' $Q15 $Q05) > .gpu/ship/manifest
    cat "$models/$Q15" "$models/$Q05" | split -b ${SHIP_PIECE:-62M} -d -a 2 - .gpu/ship/piece
    for f in .gpu/ship/piece*; do n=${f##*piece}; mkdir -p .gpu/ship/p$n; mv "$f" .gpu/ship/p$n/piece; done
    mkdir -p .gpu/ship/w && mv .gpu/ship/manifest .gpu/ship/w/
    gguf_wheel .gpu/ship/w
    echo "$(ls .gpu/ship | grep -c '^p') pieces"
    ;;
ship)  # there: `ship NN`, carry [".gpu/ship/pNN"], NN = 00, 01, ... in order, each within 30 s of the last
    # (pieces carried before may still lie in the tree: only piece NN is read; one appended already is skipped)
    mkdir -p /tmp/sharpi
    next=$(cat /tmp/sharpi/ship.next 2>/dev/null || echo 00)
    if [ "$2" != "$next" ]; then
        echo "piece $2 not appended: the machine expects piece $next (a fresh machine starts at 00)"
        [ "$((10#$2))" -lt "$((10#$next))" ] && exit 0 || exit 1
    fi
    cat ".gpu/ship/p$2/piece" >> /tmp/sharpi/ship.bin || exit 1
    printf '%02d\n' $((10#$2 + 1)) > /tmp/sharpi/ship.next
    stat -c '%s bytes so far' /tmp/sharpi/ship.bin
    ;;
real)  # (carry [".gpu/ship/w"]) after the last piece: the real pair end to end, plain against speculative
    install .gpu/ship/w
    m=.gpu/ship/w/manifest
    d="$HOME/.cache/sharpi/models" && mkdir -p "$d"
    s15=$(awk -v f=$Q15 '$1 == f {print $2}' "$m")
    head -c "$s15" /tmp/sharpi/ship.bin > "$d/$Q15"
    tail -c +"$((s15 + 1))" /tmp/sharpi/ship.bin > "$d/$Q05"
    (cd "$d" && head -2 "$OLDPWD/$m" | sha256sum -c -) || exit 1
    python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 3 -p 128 -n 128 2>&1 | tee "$OUT/bench_real.txt"
    python3 scripts/bench_spec.py --device cuda --which qwen -n 128 --ks 2,4,6 2>&1 | tee "$OUT/spec_real.txt"
    ;;
quick)  # (carry .gpu/a) the stand-ins built, then only the decode speeds: plain, and what speculation costs
    install .gpu/a
    mkdir -p /tmp/sharpi/synth
    python3 scripts/gguf_synth.py build .gpu/a/q15.json.gz /tmp/sharpi/synth/$Q15
    python3 scripts/gguf_synth.py build .gpu/a/q05.json.gz /tmp/sharpi/synth/$Q05
    export SHARPI_MODELS_DIR=/tmp/sharpi/synth
    python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 3 -p 128 -n 128 2>&1 | tee "$OUT/bench.txt"
    SHARPI_CUDA_DP4A=0 python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 128 -n 128 2>&1 \
        | tee "$OUT/bench_float.txt"
    python3 scripts/bench_spec_cost.py --device cuda --ks 2,4,6 2>&1 | tee "$OUT/spec_cost.txt"
    ;;
part3)  # after part2, machine still warm: the stand-ins of part1 are in /tmp/sharpi/synth
    [ -d /tmp/sharpi/synth ] || { echo "part3 needs part1's machine (still warm)" >&2; exit 1; }
    install .gpu/b
    export SHARPI_MODELS_DIR=/tmp/sharpi/synth
    at bench_cuda_kernels.py, every warp split
    python3 scripts/bench_cuda_kernels.py --ts 1,2,5,16 2>&1 | tee "$OUT/kernels_splits.txt"
    at bench.py, the default
    python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 16 -n 128 2>&1 | tee "$OUT/bench_default.txt"
    # what the choices are worth in a whole decode: one warp per matrix row; every step its own launch
    at bench.py, float matvecs
    SHARPI_CUDA_DP4A=0 python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 16 -n 128 2>&1 \
        | tee "$OUT/bench_float.txt"
    at bench.py, one warp per matrix row
    SHARPI_QMV_SPLIT=1 python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 16 -n 128 2>&1 \
        | tee "$OUT/bench_split1.txt"
    at bench.py, nothing fused
    SHARPI_CUDA_FUSE=0 python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 16 -n 128 2>&1 \
        | tee "$OUT/bench_nofuse.txt"
    at bench.py, attention splits combined by a launch of their own
    SHARPI_CUDA_FUSE_COMBINE=0 python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 16 -n 128 2>&1 \
        | tee "$OUT/bench_combine_launch.txt"
    at bench.py, plain launches, no programmatic dependent launch
    SHARPI_CUDA_PDL=0 python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 1 -p 16 -n 128 2>&1 \
        | tee "$OUT/bench_nopdl.txt"
    # the draft's chain beside the verify pass ("draft || verify") overlapped little on the H200: with
    # programmatic launch each stream's next kernel sits resident on the SMs, waiting, which may be what
    # keeps the other stream's blocks out; the same costs without it tell
    at bench_spec_cost.py, no programmatic dependent launch
    SHARPI_CUDA_PDL=0 python3 scripts/bench_spec_cost.py --device cuda --ks 4 --reps 9 2>&1 \
        | tee "$OUT/spec_cost_nopdl.txt"
    at done
    ;;
part2)
    [ -f /tmp/sharpi/smol.1 ] || { echo "part2 needs part1's machine (still warm): run part1 again, then part2 at once" >&2; exit 1; }
    install .gpu/b
    mkdir -p "$HOME/.cache/sharpi/models"
    cat /tmp/sharpi/smol.1 .gpu/b/smol.2 > "$HOME/.cache/sharpi/models/$SMOL"
    echo "$(cat .gpu/b/smol.sha256)  $HOME/.cache/sharpi/models/$SMOL" | sha256sum -c - || exit 1
    export SHARPI_FIXTURES=/tmp/sharpi  # its llamacpp_reference.json, from part1
    # the bigger models' tests are marked slow: their files are not here
    at model tests
    python3 -m pytest -q -rs -p no:cacheprovider -m "not slow" tests/test_cuda_model.py 2>&1 \
        | tee "$OUT/model_tests.txt" | tail -n 30
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_kernels.py -k real_tensors 2>&1 \
        | tee "$OUT/real_tensors.txt" | tail -n 5
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_context_shift.py -k gpu 2>&1 \
        | tee "$OUT/context_shift.txt" | tail -n 5
    at bench.py SmolLM2
    python3 scripts/bench.py --device cuda -m ${SMOL%.gguf} --runs 3 2>&1 | tee "$OUT/bench_smol.txt"
    at done
    ;;
*)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
