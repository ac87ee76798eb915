#!/usr/bin/env bash
# The GPU checks of the CUDA backend in three calls of the device tool, for a session that has a GPU.
#
# The device machine takes at most 64 MiB of files a call, reaches no network, has no `gguf` package,
# and stays warm (its /tmp kept) for 30 s after a call. So:
#
#   bash scripts/gpu_session.sh prepare    here, once: fills .gpu/a and .gpu/b (.gitignore'd, ~50 MB each):
#                                          gguf's wheel, the llama.cpp fixtures, skeletons of the Qwen
#                                          models (scripts/gguf_synth.py), SmolLM2 in two halves
#   device run, carry [".gpu/a"], command "bash scripts/gpu_session.sh part1"   (timeout_s 600; ~5 min)
#       kernels against gguf.quants (tests/test_cuda_kernels.py), then speed on random-weight stand-ins
#       of Qwen 1.5B / 0.5B built there: scripts/bench.py (DP4A and float matvecs),
#       scripts/bench_spec_cost.py, and a decoding step's kernels (profile_cuda.py). Results in $OUT.
#   device run, carry [".gpu/b"], command "bash scripts/gpu_session.sh part2"   (at once: within 30 s)
#       SmolLM2 complete: the model-level GPU tests (tests/test_cuda_model.py: llama.cpp's greedy
#       continuations, graph replays, verify rows, speculative parity) and its real-tensor kernel tests.
#   device run, carry [".gpu/b"], command "bash scripts/gpu_session.sh part3"   (at once again, if time is left)
#       the matvec kernels per Qwen matrix (bench_cuda_kernels.py: the model's warp split against one warp,
#       integer against float), attention per context and load depth, and whole decodes with nothing
#       fused (SHARPI_CUDA_FUSE=0) and without programmatic dependent launch (SHARPI_CUDA_PDL=0); then
#       speculation's costs without it (whether the draft's chain overlaps the verify pass more when no
#       kernel waits resident on the SMs).
#   `why` (carry [".gpu/a"]): Nsight Compute's view of the small kernels that make a step latency-bound.
#   Every step runs under a time limit (`timed`): 15 minutes of device time a task, the machine's start
#   included, hold part1 and part2 with room to spare, part3 only partly.
#   The real Qwen pair end to end (1.6 GB in 27 pieces): `ship-prepare` here, then `ship NN` there once per
#   piece (carry [".gpu/ship/pNN"]), then `real` (carry [".gpu/ship/w"]): bench.py on the real 1.5B and
#   bench_spec.py --which qwen (plain against -md, measured). On 2026-12-04 a call cost 7-9 s of device
#   time beyond its command (a ~50 MB carry), so the pieces take ~4-7 minutes, if each call follows the last
#   at once (the machine goes back after 30 s idle and a fresh one has lost the pieces).
#   What is still owed (2026-12-04: part1/part2 passed; `quick` and part3 measured): the real pair end to
#   end (ship + real) and `why`; `quick` again after a change to cuda/ or the GPU host code. Since then
#   (2026-12-04 evening) ops.cu changed (attention blocks of two heads for Q8_K rows, K/V loads hoisted, the
#   norm's weights loaded with x, the 8-bit rounding in registers), emulator-checked only (the kernel tests,
#   and on 2026-12-04 late all of tests/test_cuda_model.py emulated, Qwen 1.5B and its speculation included):
#   part1's kernel tests and part2's model tests first, then `quick` (its attn_bench compares the attention paths).
#   Since 2026-12-05 sampling (temp > 0) draws on the device (cuda/ops.cu's topk_part_f32 / topk_sample; emulator-
#   checked only): part1 and part2 run its tests, `quick` times it against SHARPI_DEVICE_SAMPLE=0 (spec_synth_t07_*).
#   Since 2026-12-06 each matvec also prefetches the pass's next matrix into the L2 (qmatvec.cu's QMV_KERNEL,
#   common.cuh's prefetch_ranges; emulator-checked only): `quick` times it against SHARPI_CUDA_AHEAD=0
#   (bench_ahead0 against bench), and part2's test_each_matvec_asks_for_the_next_matrix[cuda] checks the bits.
#   Order for the next device (2026-12-06): part1, part2, then `why` before `quick`. On the H200 a decode with nothing
#   fused (455 launches) ran as fast as the fused one (275), so what holds a step back is inside the small kernels
#   (attention ~20 us at 128 keys, a norm 5.7 us), which only the profiler can show.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SMOL=smollm2-135m-instruct-q4_1.gguf
Q15=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
Q05=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

at() { echo "== ${SECONDS}s: $*"; }  # where the call's 10 minutes went

# `timed SECS NAME CMD...`: CMD under a time limit (a 15-minute device lease has no room for one step that
# hangs), its output in $OUT/NAME.txt and here
timed() {
    local secs=$1 name=$2; shift 2
    at "$name ($*)"
    timeout -k 5 "$secs" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    [ "$rc" = 124 ] && echo "(stopped after $secs s)" >> "$OUT/$name.txt"
    tail -n "${TAIL:-40}" "$OUT/$name.txt"
    return $rc
}

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
    # the stand-ins, built on the CPU while the kernel tests run (passed by path: the model cache would
    # take them for damaged files, their sha256 not the registry's)
    (python3 scripts/gguf_synth.py build .gpu/a/q15.json.gz /tmp/sharpi/synth/$Q15 \
        && python3 scripts/gguf_synth.py build .gpu/a/q05.json.gz /tmp/sharpi/synth/$Q05) &
    # (tests/test_cuda_compile.py, nvcc and NVRTC builds, runs in CI: not here)
    TAIL=15 timed 200 kernels python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_kernels.py
    wait
    timed 100 bench python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 --runs 2 -p 128 -n 128
    timed 50 bench_float env SHARPI_CUDA_DP4A=0 python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 --runs 1 \
        -p 128 -n 128
    timed 120 spec_cost python3 scripts/bench_spec_cost.py --device cuda --target /tmp/sharpi/synth/$Q15 --draft /tmp/sharpi/synth/$Q05 --ks 2,4,6
    # without programmatic launch: each kernel's time is its own (with it, a kernel starts while the one
    # before runs, and its time includes that wait)
    timed 60 profile env SHARPI_CUDA_PDL=0 python3 scripts/profile_cuda.py -m /tmp/sharpi/synth/$Q15 -p 128 --rows 1,5
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
    timed 120 bench_real python3 scripts/bench.py --device cuda -m ${Q15%.gguf} --runs 3 -p 128 -n 128
    timed 300 spec_real python3 scripts/bench_spec.py --device cuda --which qwen -n 128 --ks 2,4,6 --temps 0,0.7
    ;;
quick)  # (carry .gpu/a) the stand-ins built, then the decode speeds: plain, what speculation costs, a step's kernels
    install .gpu/a
    mkdir -p /tmp/sharpi/synth
    python3 scripts/gguf_synth.py build .gpu/a/q15.json.gz /tmp/sharpi/synth/$Q15 &
    python3 scripts/gguf_synth.py build .gpu/a/q05.json.gz /tmp/sharpi/synth/$Q05
    wait
    timed 100 bench python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 --runs 2 -p 128 -n 128
    timed 120 spec_cost python3 scripts/bench_spec_cost.py --device cuda --target /tmp/sharpi/synth/$Q15 \
        --draft /tmp/sharpi/synth/$Q05 --ks 2,4,6
    timed 60 profile env SHARPI_CUDA_PDL=0 python3 scripts/profile_cuda.py -m /tmp/sharpi/synth/$Q15 -p 128 --rows 1,5
    timed 50 bench_float env SHARPI_CUDA_DP4A=0 python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 \
        --runs 1 -p 128 -n 128
    # matvecs asking the L2 for the next matrix too (the default since 2026-12-06, `bench` above) against not
    timed 60 bench_ahead0 env SHARPI_CUDA_AHEAD=0 python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 \
        --runs 2 -p 128 -n 128
    # attention alone (Qwen 1.5B's heads): a block of the two heads a Q8_K block spans, finished in the block
    # (the default since 2026-12-04 evening), against a head a block combined through the counters
    timed 60 attn_bench python3 scripts/bench_cuda_kernels.py --attn 12:2:128:128:1,12:2:128:1000:1
    # speculation end to end at the real pair's tokens per verify pass (measured on the CPU: 2.86, 4.50, 5.73
    # at k = 2, 4, 6), acceptance synthetic (the stand-ins' proposals are noise): without the look-ahead,
    # whose guess of the bonus token always misses on them (the real pair's hits 79% at k = 4)
    timed 150 spec_synth env SHARPI_SPEC_LOOKAHEAD=0 python3 scripts/bench_spec.py --device cuda --which qwen \
        --target /tmp/sharpi/synth/$Q15 --draft /tmp/sharpi/synth/$Q05 --ks 2,4,6 --synth-lens 2.86,4.5,5.73 \
        --temps 0 -n 128
    # sampling (temp 0.7, k = 4, at 4.50 tokens a pass: the real pair's at temp 0.7 too, README's CPU table): the draft's
    # proposals drawn on the device (sample_chain, since 2026-12-05) against drawn on the host one pass at a time
    for dev in 1 0; do
        timed 90 spec_synth_t07_dev$dev env SHARPI_SPEC_LOOKAHEAD=0 SHARPI_DEVICE_SAMPLE=$dev python3 scripts/bench_spec.py \
            --device cuda --which qwen --target /tmp/sharpi/synth/$Q15 --draft /tmp/sharpi/synth/$Q05 --ks 4 \
            --synth-lens 4.5 --temps 0.7 -n 128 --reps 2
    done
    at done
    ;;
why)  # (carry .gpu/a) what a decoding step's slow small kernels wait on: Nsight Compute's stall reasons for
    # attention (15-20 us at 128 keys on the H200), the RMSNorm (5.7 us for 1536 values) and the GLU, in a
    # Qwen 1.5B stand-in's eager decode (no graphs, no programmatic launch: ncu replays each kernel alone)
    install .gpu/a
    mkdir -p /tmp/sharpi/synth
    [ -f /tmp/sharpi/synth/$Q15 ] || python3 scripts/gguf_synth.py build .gpu/a/q15.json.gz /tmp/sharpi/synth/$Q15
    timed 300 ncu env SHARPI_CUDA_GRAPH=0 SHARPI_CUDA_PDL=0 ncu --clock-control none --target-processes all \
        -k 'regex:attn_partial|rms_norm_f32|glu_q8_f32' --launch-skip 120 -c 6 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        python3 -c "import sys; from sharpi_cli.entry import main; sys.argv = ['sharpi', '--device', 'cuda', '-m',
            '/tmp/sharpi/synth/$Q15', '-p', 'def f(x):', '-n', '8', '--temp', '0']; main()"
    at done
    ;;
part3)  # after part2, machine still warm: the stand-ins of part1 are in /tmp/sharpi/synth
    [ -d /tmp/sharpi/synth ] || { echo "part3 needs part1's machine (still warm)" >&2; exit 1; }
    install "$(ls -d .gpu/b .gpu/a 2>/dev/null | head -n 1)"
    # every kernel at one shared memory / L1 split (the most shared memory): if the driver reconfigures an SM between
    # kernels of other needs (the norms' and attention's shared memory, the matvecs' little), this shows it
    timed 60 bench_base python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 --runs 2 -p 128 -n 128
    timed 60 bench_carveout env SHARPI_CUDA_CARVEOUT=100 python3 scripts/bench.py --device cuda \
        -m /tmp/sharpi/synth/$Q15 --runs 2 -p 128 -n 128
    # per Qwen matrix: the model's warp split against the others, integer against float matvecs
    timed 90 kernels_bench python3 scripts/bench_cuda_kernels.py --ts 1,5,16 --splits auto,1 --kernels int,float
    # attention per context, and with the loads in flight before (K: 8 a thread, V: 4 keys), the same bits
    timed 40 attn_bench python3 scripts/bench_cuda_kernels.py --attn 12:2:128:128:1,12:2:128:128:5,12:2:128:1000:1
    timed 40 attn_bench_k8v4 env SHARPI_CUDA_OPS_DEFS="-DATT_K_LOADS=8 -DATT_V_LOADS=4" \
        python3 scripts/bench_cuda_kernels.py --attn 12:2:128:128:1,12:2:128:1000:1
    # what the choices are worth in a whole decode: nothing fused; plain launches (no programmatic
    # dependent launch)
    timed 60 bench_nofuse env SHARPI_CUDA_FUSE=0 python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 --runs 1 \
        -p 16 -n 128
    timed 60 bench_nopdl env SHARPI_CUDA_PDL=0 python3 scripts/bench.py --device cuda -m /tmp/sharpi/synth/$Q15 --runs 1 \
        -p 16 -n 128
    # the draft's chain beside the verify pass ("draft || verify") overlapped little on the H200: with
    # programmatic launch each stream's next kernel sits resident on the SMs, waiting, which may be what
    # keeps the other stream's blocks out; the same costs without it tell
    timed 90 spec_cost_nopdl env SHARPI_CUDA_PDL=0 python3 scripts/bench_spec_cost.py --device cuda --target /tmp/sharpi/synth/$Q15 --draft /tmp/sharpi/synth/$Q05 --ks 4 --reps 9
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
    TAIL=30 timed 240 model_tests python3 -m pytest -q -rs -p no:cacheprovider -m "not slow" tests/test_cuda_model.py
    TAIL=5 timed 60 real_tensors python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_kernels.py -k real_tensors
    TAIL=5 timed 60 context_shift python3 -m pytest -q -rs -p no:cacheprovider tests/test_context_shift.py -k gpu
    timed 60 bench_smol python3 scripts/bench.py --device cuda -m ${SMOL%.gguf} --runs 3
    at done
    ;;
*)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
