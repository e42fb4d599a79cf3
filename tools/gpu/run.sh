#!/usr/bin/env bash
# One device call's worth of GPU work, by stage, from the repo root on the H200 (the `device` tool's `run`).
# Prepare once on the CPU machine (wheels for fla, fastapi/uvicorn/pydantic/openai):
#   grep -q '^/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude; ../shared/device/fetch_wheels.sh .whl opentelemetry-api
#   (fastapi 0.165 imports opentelemetry at start-up: without that wheel the server stage cannot start)
# then call run with carry [".whl"] and a command such as `bash tools/gpu/run.sh tests` (each stage fits ~9 min).
# Logs go to $OUT (or ./gpu-out); the last lines printed are the summary.
set -uo pipefail
stage=${1:?usage: tools/gpu/run.sh hundred-ninety-first|hundred-ninetieth|hundred-eighty-ninth|hundred-eighty-eighth|hundred-eighty-seventh|hundred-eighty-sixth|hundred-eighty-fifth|hundred-eighty-fourth|hundred-eighty-third|hundred-eighty-second|hundred-eighty-first|hundred-eightieth|hundred-seventy-ninth|hundred-seventy-eighth|hundred-seventy-seventh|hundred-seventy-sixth|hundred-seventy-fifth|hundred-seventy-fourth|hundred-seventy-third|hundred-seventy-second|hundred-seventy-first|hundred-sixty-ninth|hundred-sixty-eighth|hundred-sixty-seventh|hundred-sixty-sixth|hundred-sixty-fifth|hundred-sixty-fourth|hundred-sixty-third|hundred-sixty-second|hundred-sixty-first|hundred-sixtieth|hundred-fifty-ninth|hundred-fifty-eighth|hundred-fifty-seventh|hundred-fifty-sixth|hundred-fifty-fifth|hundred-fifty-fourth|hundred-fifty-third|hundred-fifty-second|hundred-fifty-first|hundred-fiftieth|hundred-forty-ninth|hundred-forty-eighth|hundred-forty-seventh|hundred-forty-fourth|hundred-forty-third|hundred-forty-second|hundred-forty-first|hundred-fortieth|hundred-thirty-ninth|hundred-thirty-eighth|hundred-thirty-seventh|hundred-thirty-sixth|hundred-thirty-fifth|hundred-thirty-fourth|hundred-thirty-third|hundred-thirty-second|hundred-thirty-first|hundred-thirtieth|hundred-twenty-ninth|hundred-twenty-eighth|hundred-twenty-seventh|hundred-twenty-sixth|hundred-twenty-fifth|hundred-twenty-fourth|hundred-twenty-third|hundred-twenty-second|hundred-twenty-first|hundred-twentieth|hundred-nineteenth|hundred-eighteenth|hundred-seventeenth|hundred-sixteenth|hundred-fifteenth|hundred-fourteenth|hundred-thirteenth|hundred-twelfth|hundred-eleventh|hundred-tenth|hundred-ninth|hundred-eighth|hundred-seventh|hundred-sixth|hundred-fifth|hundred-fourth|hundred-third|hundred-second|hundred-first|hundredth|ninety-ninth|ninety-eighth|ninety-seventh|ninety-sixth|ninety-fifth|ninety-fourth|ninety-third|ninety-second|ninety-first|ninetieth|eighty-ninth|eighty-eighth|eighty-seventh|eighty-sixth|eighty-fifth|eighty-fourth|eighty-third|eighty-second|eighty-first|eightieth|seventy-ninth|seventy-eighth|seventy-seventh|seventy-sixth|seventy-second|seventy-first|seventieth|sixty-ninth|sixty-eighth|sixty-seventh|sixty-sixth|sixty-fifth|sixty-fourth|sixty-third|sixty-second|sixty-first|sixtieth|fifty-ninth|fifty-eighth|fifty-seventh|fifty-sixth|fifty-fifth|fifty-fourth|fifty-first|fiftieth|forty-ninth|forty-eighth|forty-seventh|forty-fifth|forty-sixth|forty-fourth|forty-third|forty-second|forty-first|fortieth|thirty-ninth|thirty-eighth|thirty-seventh|thirty-sixth|thirty-fifth|thirty-fourth|thirty-third|thirty-second|thirty-first|thirtieth|twenty-ninth|twenty-eighth|twenty-seventh|split-prep|scale-words|sass-stalls|twenty-sixth|stalls|twenty-fifth|twenty-fourth|twenty-second|twenty-third|twenty-first|twentieth|ncu|sixteenth|seventeenth|eighteenth|nineteenth|conv-profile|fifteenth|thirteenth|fourteenth|twelfth|eleventh|seventh|eighth|ninth|tenth|window16|mgpu|mgpu4|mgpu5|mgpu-bisect|mgpu-bisect-n|mgpu-probe|first|second|third|fourth|fifth|sixth|tests|rowinv|launch|qmm-ab|prompt-ab|profile|engine|server|qmm-sweep|attention-compare|qmm|gdn|attention}
out=${OUT:-gpu-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::DeprecationWarning

# pytest with the Mosaic GPU decode qmm on (qmm.DECODE_IMPL = "mgpu"). $1: the time limit (s); the rest: pytest's.
pytest_mgpu() {
  local limit=$1
  shift
  timeout -s INT "$limit" python3 -c "import sys, pytest; from pallas_kernels import qmm; qmm.DECODE_IMPL = 'mgpu'; \
    sys.exit(pytest.main(sys.argv[1:]))" "$@"
}

# pytest -m gpu with -v logs in $out/gpu_tests_$2.log, stopped by SIGINT at the limit (so pytest still prints its
# summary); prints the results' last $3 lines. $1: the limit (s); the rest: pytest's arguments.
gpu_pytest() {
  local limit=$1 name=$2 lines=$3
  shift 3
  timeout -s INT "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short "$@" > "$out/gpu_tests_$name.log" 2>&1
  grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_$name.log" | cut -c1-200 | tail -"$lines"
}

# The bench at the 27B's shapes (bf16 KV, 1 and 16 streams, a 4K prompt) into $out/bench_27b.log. $1: the time
# limit (s); $2: the lines of its tail to print.
bench_27b() {
  timeout "$1" python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
    --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b.log" | tail -"$2"
}

# The demo's drafted decoding (eval drafts, one stream, 8 prompts of GPL-3) once for each argument, each one line of
# extra flags, into $out/demo_measure.log; prints the measured costs and the result line of each.
demo_evals() {
  for args in "$@"; do
    echo "$args"
    timeout 100 python3 -m qwen_jax eval drafts --model models/demo-mlx-8bit --drafter models/demo-dflash \
      --text /usr/share/common-licenses/GPL-3 --prompts 8 --gen-tokens 128 --streams 1 $args --compile-cache "" \
      2>&1 | tee -a "$out/demo_measure.log" | grep -E "draft-costs|prompts|rror" | tail -3
  done
}

# The synthetic 27B drafter's 16-row DFlash window at 1K of context (bench --draft-rows 16), once for each argument:
# a drafter flag ("" for bf16, "--drafter-bits N"), into $out/bench_drafter_bits.log. $1: each run's time limit (s).
drafter_windows() {
  local limit=$1
  shift
  for bits in "$@"; do
    echo "drafter ${bits:-bf16}"
    timeout "$limit" python3 -m qwen_jax bench --synthetic 27b --streams 1 --prompt-lengths "" --context 1024 \
      --rounds 16 --draft-rows 16 --drafter synthetic $bits --no-compile-timing --compile-cache "" 2>&1 \
      | tee -a "$out/bench_drafter_bits.log" | grep -iE "pipelined|decode  1|error" | tail -3
  done
}

# The demo model's drafted decoding (eval drafts, policy "always") with chains, then trees of branch 2 and 3.
demo_tree_evals() {
  for tree in 0 2 3; do
    timeout 80 python3 -m qwen_jax eval drafts --model models/demo-mlx-8bit --drafter models/demo-dflash \
      --text /usr/share/common-licenses/GPL-3 --prompts 8 --gen-tokens 128 --streams 1 --draft-policy always \
      --draft-tree $tree --compile-cache "" 2>&1 | tail -1
  done
}

# The one-stream 27B round (1K context) traced into $out/profile$2.txt. $1: the time limit (s); $2: a flag of
# decode_profile.py ("" for none); $3: the events to print besides the round's (a grep alternation).
profile_round() {
  timeout "$1" python3 tools/gpu/decode_profile.py --synthetic 27b --streams 1 --rounds 16 --trace /tmp/trace_pr \
    --profiled 0 $2 2>&1 | tee "$out/profile$(echo "$2" | tr -c 'a-zA-Z0-9_\n-' '_').txt" | grep -E "trace:|device-bound|pipelined|  ($3)" | head -7
}

# The engine's fp8 gate (concurrent == solo, fp8 pools) with the window's fp8 dots forced to one dtype. $1: the
# dtype (WindowTiles.fp8_dot); $2: the time limit (s); $3: the log's name. Prints the result lines.
fp8_gate_with_dots() {
  timeout -s INT "$2" python3 -c "import sys, dataclasses, pytest; from pallas_kernels import attention as at; \
shipped = at.window_tiles; \
at.window_tiles = lambda **kw: dataclasses.replace(shipped(**kw), fp8_dot='$1'); \
sys.exit(pytest.main(sys.argv[1:]))" -m gpu -v -p no:cacheprovider --tb=short \
    "tests/test_engine_gpu.py::test_concurrent_equals_solo_on_gpu[bfloat16-False-fp8]" > "$out/gpu_fp8_$3.log" 2>&1
  grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_fp8_$3.log" | cut -c1-300 | tail -4
}

# bench attention --trace over the sections $2 (comma-separated) within $1 s: the rows in $out/attention_$3.json and
# .log; prints the copy lines, failures and the summary tables.
attn_sections() {
  timeout "$1" python3 -m pallas_kernels.bench attention --sections "$2" --budget-s $(($1 - 20)) --trace "/tmp/trace_$3" \
    --json "$out/attention_$3.json" 2>&1 | tee "$out/attention_$3.log" | grep -E "^copy|FAILED"
  sed -n '/^###/,$p' "$out/attention_$3.log" | head -60
}

# The 16-row window's tile variants (row_block 64 / 32 beside the shipped tiles and the other walk).
attention_window16() {
  timeout 200 python3 -m pallas_kernels.bench attention --sections window16 --budget-s 180 \
    --json "$out/attention_window16.json" 2>&1 | tee "$out/attention_window16.log" | grep -A30 "^### 16-row"
}

# decode_profile.py with a trace, at 1 and 16 streams, for each value of one of its flags. $1: the flag; the rest:
# its values. Prints the round times, the busy time and the qmm's traced time.
profile_by() {
  local flag=$1
  shift
  for v in "$@"; do
    for s in 1 16; do
      echo "== $flag $v, $s streams"
      timeout 100 python3 tools/gpu/decode_profile.py --synthetic 27b "$flag" "$v" --streams $s --rounds 32 \
        --trace "$out/trace_${v}_$s" --profiled 0 2>&1 | tee "$out/profile_${v}_$s.txt" \
        | grep -E "round|busy|custom calls|kernel_mosaic|^ .*(xla|norms)"
      rm -rf "$out/trace_${v}_$s"
    done
  done
}

case "$stage" in
  hundred-ninety-first)
    # Prepared in sessions 51-52 (~8 min; not yet run): tensor parallelism's gpu gates (over a one-GPU mesh = the
    # plain engine bit for bit, on any machine; concurrent = solo and copy drafts = serial where there are two
    # GPUs), the thinking budget's and the engine's concurrent = solo gates, then the 27B bench: under -tp 2 beside
    # one device on a machine of two or more GPUs, else one device alone.
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 300 parallel 12 tests/test_parallel_gpu.py tests/test_engine_gpu.py -k \
      "parallel_gpu or concurrent_equals_solo or thinking"
    bench_27b 150 6
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
        --no-compile-timing --compile-cache "" -tp 2 2>&1 | tee "$out/bench_27b_tp2.log" | tail -6
    fi ;;
  hundred-ninetieth)
    # Session 50 (~9 min): the structured-output gates with the kernels on (drafted by copy drafts, among plain and
    # penalized streams, drafted as a tree engine's likeliest chains; session 48's compile fix), then the bench at HEAD.
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 330 structured_gates 8 tests/test_engine_gpu.py::test_drafted_structured_equals_serial_on_gpu \
      tests/test_engine_gpu.py::test_structured_and_penalized_on_gpu \
      tests/test_engine_gpu.py::test_tree_structured_equals_serial_on_gpu \
      "tests/test_engine_gpu.py::test_drafted_equals_serial_on_gpu[bf16]"
    bench_27b 200 12 ;;
  hundred-eighty-ninth)
    # Session 49 (~6.5 min; run it with timeout_s 420: at 256 rounds it ran 347 s and its table was cut): what one
    # structured-output stream costs the other streams (first run in session 49, on an H100): 1 and 15 free
    # streams at 1K of context alone, beside one structured stream (a JSON schema) of a new grammar (masks cold),
    # beside the same requests again (masks cached) and beside them as a plain stream (the control), the 27B's shapes
    # with random weights and a synthetic byte-level vocabulary of its size (tools/gpu/structured_cost.py); the
    # log's last lines are a table for BENCHMARKS.md.
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 385 python3 tools/gpu/structured_cost.py --synthetic 27b --streams 1,15 --rounds 224 --repeats 2 2>&1 \
      | tee "$out/structured_cost.log" | grep -vE "^(1|15) free streams, repeat" | tail -12 ;;
  hundred-eighty-eighth)
    # Session 48 (~5 min): drafted structured outputs (copy-draft windows whose rows carry grammar masks) against the
    # serial replies with the kernels on; the structured + penalized gate and copy drafts' gate again at HEAD.
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 400 drafted_structured 6 tests/test_engine_gpu.py::test_drafted_structured_equals_serial_on_gpu \
      tests/test_engine_gpu.py::test_structured_and_penalized_on_gpu \
      "tests/test_engine_gpu.py::test_drafted_equals_serial_on_gpu[bf16]" \
      "tests/test_engine_gpu.py::test_block_drafted_equals_serial_on_gpu[bf16-0]"
    ;;
  hundred-eighty-seventh)
    # Session 48 (~7 min): structured outputs and penalties with the kernels on (never run on the device before):
    # alone = among plain streams, no compile while serving; then the engine's batched concurrent = solo gate at HEAD.
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 400 structured 6 tests/test_engine_gpu.py::test_structured_and_penalized_on_gpu \
      "tests/test_engine_gpu.py::test_concurrent_equals_solo_on_gpu[bfloat16-False-bf16]" \
      "tests/test_engine_gpu.py::test_concurrent_equals_solo_on_gpu[bfloat16-False-fp8]" \
      "tests/test_engine_gpu.py::test_drafted_equals_serial_on_gpu[bf16]"
    ;;
  hundred-eighty-sixth)
    # Session 46 (~4 min; hundred-eighty-third cut to what the lease had left): the demo's adaptive trees on costs it
    # measures at start (--draft-costs measure, with the ~50 ms time floor a timing) beside "always" trees, twice
    # each: whether the measured table repeats from one start to the next.
    nvidia-smi --query-gpu=name --format=csv,noheader
    demo_evals "--draft-tree 2 --draft-costs measure" "--draft-tree 2 --draft-policy always" \
      "--draft-tree 2 --draft-costs measure" ;;
  hundred-eighty-fifth)
    # Session 46 (~5 min): the synthetic 27B drafter's 16-row DFlash window at 1K of context in bf16 and quantized
    # at load to 8 bits (--drafter-bits 8, what docs and --help recommend; session 45 timed 4 bits only) and 4.
    nvidia-smi --query-gpu=name --format=csv,noheader
    drafter_windows 95 "" "--drafter-bits 8" "--drafter-bits 4" ;;
  hundred-eighty-fourth)
    # Session 46 (~10 min): issue #5's tables at HEAD (the attention kernels alone, 1- and 16-row windows, bf16 and
    # fp8 pools, 1 and 16 streams, traced), then the 27B engine bench at HEAD (decode at 1 and 16 streams, a 4K
    # prompt; the last H200 figure is session 39's 159.8 forwards/s at one stream).
    nvidia-smi --query-gpu=name --format=csv,noheader
    attn_sections 320 decode,window tables
    bench_27b 240 8 ;;
  eighty-seventh)
    # Session 21, last call (~9 min): the shipped state (f16 window dots for fp8 pools, fp8 prompts on Mosaic GPU):
    # the engine's gates and the fp8 attention gpu tests, then the 27B engine bench with an fp8 KV cache and with
    # bf16, one after the other.
    gpu_pytest 170 engine 9 tests/test_engine_gpu.py
    gpu_pytest 90 attn_fp8 8 tests/test_attention.py -k "gpu_27b and fp8"
    for kv in fp8 bf16; do
      timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 32 \
        --kv-cache $kv --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b_$kv.log" | tail -14
    done ;;
  hundred-second)
    # Prepared in session 25, not run (~9 min): what that session could not time. The window gpu tests (fresh_jit's
    # ping-pong and 8-bit dequant checks, test_gpu_27b_fp8_pool's step bits with f16 dots and FP8_SPLIT's bits, the
    # merge row splits, the strict xfail of fp8 bf16 dots), the 16-row tail at the shipped row-split rule, the
    # issue's tables (fp8 16-row windows in three Triton programs). Then hundred-third: if FP8_SPLIT's 16-row
    # windows come within 1.3x of a 1-row decode near Triton's, it is the way to ship fp8 pools on Mosaic GPU (a
    # change of the fp8 bits: the engine's gates).
    gpu_pytest 240 window 26 tests/test_attention.py tests/test_attention_window_mgpu.py -k "window or gpu_27b"
    attn_sections 130 merge_variants merge_variants
    attn_sections 170 decode,window decode_window ;;
  hundred-fourth)
    # Session 26 (~8 min): the merge's window-key sum in key order (`attention._window_key_sum`): the merge-splits
    # probe with it and with the old sum over the columns (bf16 and fp8 16-row windows, three draws), then the window
    # gpu tests (every merge row and column split now at the shipped bits, fp8 with bf16 dots included) and the
    # Mosaic GPU fp8 pool test (its 8-bit dequantization check no longer compares the shipped layout with itself;
    # FP8_SPLIT with bf16 partials).
    timeout 200 python3 tools/gpu/merge_rows_probe.py --sums 2>&1 | tee "$out/merge_sums_probe.log" | cut -c1-600
    gpu_pytest 130 window 8 tests/test_attention.py -k "test_window_gpu_27b"
    gpu_pytest 100 window_mgpu 4 tests/test_attention_window_mgpu.py -k "fp8_pool" ;;
  hundred-fifteenth)
    # Session 28 (~8 min): short contexts in short chunks (WindowTiles.short_chunk): the new gpu test, the window
    # gpu tests, every engine gate, then the windows at 1K-8K keys with short chunks and fixed ones alternated.
    gpu_pytest 170 short 14 tests/test_attention_window_mgpu.py tests/test_attention.py \
      -k "short_chunks or gpu_27b_windows or gpu_27b_fp8_pool or window_gpu_27b or fold_in_merge_gpu"
    gpu_pytest 170 engine 10 tests/test_engine_gpu.py
    timeout 150 python3 -m pallas_kernels.bench attention --sections short_chunks --budget-s 135 --trace /tmp/trace_sc \
      --json "$out/attention_short.json" 2>&1 | tee "$out/attention_short.log" | grep -E "^copy|FAILED" ;;
  hundred-forty-first)
    # Session 33 (~9 min): the gates of the four prepared changes in one call (sessions 31-32's stages 137-139,
    # trimmed). Their gpu tests: fp8 V key-major and the chunk max (kv_quant.FP8_V_LAYOUT, attention.FP8_V_MAX), the
    # serial step's GDN with its norm (ops.STEP_NORM), the residual add's norm on programs of their own
    # (ops.RESIDUAL_NORM_TAIL "rows", RESIDUAL_NORM_ROWS 16), the tiny model's step with q packed by the attention
    # prep (ops.PACK_QUERIES) and with each of these apart. Then every engine gate with STEP_NORM, the rows tail and
    # PACK_QUERIES on together (the fp8-vkeys gates set the V layout and max themselves). Timing is
    # hundred-forty-second's.
    gpu_pytest 170 vkeys 14 tests/test_attention.py tests/test_kv_quant.py -k "keys_major or chunk_v_max or write_kernel_gpu"
    gpu_pytest 130 stepnorm 8 tests/test_gdn.py tests/test_model_consistency.py -k "step_norm or pieces"
    gpu_pytest 70 rows 6 tests/test_residual.py -k "norm"
    timeout -s INT 200 python3 -c "import sys, pytest; from qwen_jax.model import ops; ops.STEP_NORM = True; \
      ops.RESIDUAL_NORM_TAIL = 'rows'; ops.RESIDUAL_NORM_ROWS = 16; ops.PACK_QUERIES = True; sys.exit(pytest.main(sys.argv[1:]))" -m gpu -v \
      -p no:cacheprovider --tb=short tests/test_engine_gpu.py > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-200 | tail -14 ;;
  hundred-fifty-first)
    # Prepared in session 36 (~8 min): the Mosaic GPU pass 1 over an fp8 pool with V key-major, both MMAs on the e4m3
    # codes (no dequantization; q and P' in two e4m3 parts each; attention_window_mgpu, dequant "e4m3"; off:
    # FP8 keeps fp8 pools on the Triton pass 1). Its gpu test (27B shape: float64, step bits, stream alone, stages),
    # then the fp8 pass 1s side by side, traced (window_fp8: Triton as shipped, Mosaic GPU dequantizing V by rows,
    # and e4m3), 1- and 16-row windows. If e4m3 meets the fp8 targets (1-row >= 80 % of copy at >= 32K, 16-row <=
    # 1.3x), route fp8 pools to it (awm.FP8 for key-major pools) and run the engine's fp8 gates.
    gpu_pytest 150 e4m3 6 tests/test_attention_window_mgpu.py -k "e4m3"
    attn_sections 300 window_fp8 e4m3
    ;;
  hundred-fifty-fourth)
    # Session 38 (~5 min): hundred-fifty-first cut to fit what was left of a lease after a machine's start. The e4m3
    # pass 1's gpu test, then the fp8 pass 1s side by side (window_fp8, traced) until its budget runs out.
    gpu_pytest 100 e4m3 6 tests/test_attention_window_mgpu.py -k "e4m3"
    attn_sections 200 window_fp8 e4m3
    ;;
  hundred-sixty-fifth)
    # Session 42 (~7 min): DFlash tree windows on the device. The block-drafted = serial gates with chains and with
    # trees of branch 3 (the random tiny drafter's trees, then an oracle's ladders kept through second children
    # only), bf16 and fp8; then the demo's drafted decoding with chains and with trees of 16 rows.
    gpu_pytest 330 tree_gates 8 tests/test_engine_gpu.py -k "block_drafted"
    demo_tree_evals
    ;;
  hundred-eighty-third)
    # Session 45 (~8 min): the draft policy's tables on this machine. The synthetic 27B's DFlash windows of 2, 4, 8
    # and 16 rows, chains and trees of branch 2, at 1K of context (what the default tables hold, measured on an
    # H100 in sessions 40-43), then the demo's adaptive trees on costs it measures at start (--draft-costs measure,
    # with the ~50 ms time floor a timing) beside "always" trees.
    nvidia-smi --query-gpu=name --format=csv,noheader
    for tree in 0 2; do
      timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1 --prompt-lengths "" --context 1024 \
        --rounds 16 --draft-rows 2,4,8,16 --drafter synthetic --draft-tree $tree --no-compile-timing \
        --compile-cache "" 2>&1 | tee -a "$out/bench_costs.log" | grep -E "draft-costs|decode  1|rror" | tail -3
    done
    demo_evals "--draft-tree 2 --draft-costs measure" "--draft-tree 2 --draft-policy always" ;;
  hundred-eighty-second)
    # Session 45 (~3 min, an H200; hundred-eighty-first cut to what the lease had left): issue #5's 1-row decode
    # table alone (bf16 and fp8 pools, 4K / 32K / 128K, traced, against the copy bandwidth).
    nvidia-smi --query-gpu=name --format=csv,noheader
    attn_sections 170 decode decode ;;
  hundred-eighty-first)
    # Session 45 (~6 min, an H200): issue #5's tables at HEAD (the attention kernels alone, 1- and 16-row windows,
    # bf16 and fp8 pools, 1 and 16 streams, traced); the last H200 run of the bf16 1-row table was session 27's.
    nvidia-smi --query-gpu=name --format=csv,noheader
    attn_sections 330 decode,window tables ;;
  hundred-eightieth)
    # Session 45 (~7 min): window_rows now on by default: the engine's fp8 drafted == serial gates with it. Then the
    # synthetic 27B drafter in bf16 and quantized to 4 bits at load (--drafter-bits 4): a 16-row DFlash window at
    # 1K of context each way. Then the demo's adaptive trees on measured costs beside "always" trees.
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 150 rows_fp8 4 "tests/test_engine_gpu.py::test_drafted_equals_serial_on_gpu[fp8]" \
      "tests/test_engine_gpu.py::test_block_drafted_equals_serial_on_gpu[fp8-3]"
    drafter_windows 100 "" "--drafter-bits 4" ""
    demo_evals "--draft-tree 2 --draft-costs measure" "--draft-tree 2 --draft-policy always" ;;
  hundred-seventy-ninth)
    # Session 45 (~5 min): the demo's drafted decoding with the adaptive policy deciding from costs the engine
    # measured at start (--draft-costs measure; the tables are the 27B's), chains and trees of branch 2, beside
    # "always" trees (session 44: adaptive chains 1.09x, adaptive trees 1.18x, always trees 1.43x).
    nvidia-smi --query-gpu=name --format=csv,noheader
    demo_evals "--draft-tree 0 --draft-costs measure" "--draft-tree 2 --draft-costs measure" \
      "--draft-tree 2 --draft-policy always" ;;
  hundred-seventy-eighth)
    # Session 45 (~7 min; after hundred-seventy-sixth): window_rows' calls against the one-row calls (rows_probe), then
    # a 16-row DFlash chain window at 1K of context with the shared pass 1 and without it: at 1K no chunk is shared,
    # so this times only what the per-layer lax.cond (the straddle choice, read on the device) costs the launches.
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 150 python3 tools/gpu/rows_probe.py --contexts 1024,8192,32768 2>&1 | tee "$out/rows_probe.log" | tail -8
    for shared in True False True; do
      echo "SHARED_ROWS=$shared"
      timeout 130 python3 -c "import sys, runpy; from pallas_kernels import attention; \
attention.SHARED_ROWS = $shared; sys.argv = ['qwen_jax'] + sys.argv[1:]; runpy.run_module('qwen_jax', run_name='__main__')" \
        bench --synthetic 27b --streams 1 --prompt-lengths "" --context 1024 --rounds 16 --draft-rows 16 \
        --drafter synthetic --draft-tree 0 --no-compile-timing --compile-cache "" 2>&1 | tee -a "$out/bench_rows_1k.log" \
        | grep -iE "window|decode|error" | tail -4
    done ;;
  hundred-seventy-seventh)
    # Session 44 (~4 min; hundred-seventy-sixth cut to what the lease had left): attention.window_rows' gpu tests at
    # the 27B's shape (chains and trees, bf16 and fp8: every row the bits of its own one-row window), then its calls
    # timed against the one-row calls it replaces (tools/gpu/rows_probe.py: one stream of 16 chain rows).
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 110 window_rows 5 tests/test_attention_window_mgpu.py -k "window_rows"
    timeout 150 python3 tools/gpu/rows_probe.py --contexts 1024,8192,32768 2>&1 | tee "$out/rows_probe.log" | tail -8 ;;
  hundred-seventy-sixth)
    # Session 44 (~9 min): a drafted window's rows reading the keys below them once (attention.window_rows). Its
    # gpu tests at the 27B's shape (chains and trees, bf16 and fp8), the engine's drafted == serial gates (copy
    # chains, DFlash trees), then a 16-row DFlash chain window at 32K of context with the shared pass 1 and without
    # it (attention.SHARED_ROWS False: every row its own one-row call), in decode rounds of the same run.
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 100 window_rows 5 tests/test_attention_window_mgpu.py -k "window_rows"
    # the engine's gates with the shared pass 1 on (attention.SHARED_ROWS is off by default until these pass)
    timeout -s INT 200 python3 -c "import sys, pytest; from pallas_kernels import attention; \
attention.SHARED_ROWS = True; sys.exit(pytest.main(sys.argv[1:]))" -m gpu -v -p no:cacheprovider --tb=short \
      "tests/test_engine_gpu.py::test_drafted_equals_serial_on_gpu[bf16]" \
      "tests/test_engine_gpu.py::test_block_drafted_equals_serial_on_gpu[bf16-3]" > "$out/gpu_tests_rows_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_rows_engine.log" | cut -c1-200 | tail -4
    for shared in True False; do
      echo "SHARED_ROWS=$shared"
      timeout 170 python3 -c "import sys, runpy; from pallas_kernels import attention; \
attention.SHARED_ROWS = $shared; sys.argv = ['qwen_jax'] + sys.argv[1:]; runpy.run_module('qwen_jax', run_name='__main__')" \
        bench --synthetic 27b --streams 1 --prompt-lengths "" --context 32768 --rounds 16 --draft-rows 16 \
        --drafter synthetic --draft-tree 0 --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_rows_$shared.log" \
        | grep -iE "window|decode|error" | tail -4
    done ;;
  hundred-seventy-fifth)
    # Session 44 (~4 min; after hundred-seventy-fourth, same machine): the tree policy on the demo model (eval
    # drafts, one stream): chains and trees of branch 2 under the adaptive policy (the default), then trees always.
    for tree in 0 2; do
      timeout 90 python3 -m qwen_jax eval drafts --model models/demo-mlx-8bit --drafter models/demo-dflash \
        --text /usr/share/common-licenses/GPL-3 --prompts 8 --gen-tokens 128 --streams 1 --draft-policy adaptive \
        --draft-tree $tree --compile-cache "" 2>&1 | tail -1
    done
    timeout 90 python3 -m qwen_jax eval drafts --model models/demo-mlx-8bit --drafter models/demo-dflash \
      --text /usr/share/common-licenses/GPL-3 --prompts 8 --gen-tokens 128 --streams 1 --draft-policy always \
      --draft-tree 2 --compile-cache "" 2>&1 | tail -1 ;;
  hundred-seventy-fourth)
    # Session 44 (~6 min): a tree window's ancestors written from the window's rows themselves (kv_quant.write
    # share=, no broadcast of K/V to every row): the write's gpu tests (share 1 and 16), the tree windows' engine
    # gate, then hundred-seventy-first's trace of a 16-row chain and tree window (+489 us busy at d2d26be).
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 80 share 7 tests/test_kv_quant.py -k "prefix_copy_gpu"
    gpu_pytest 150 tree_engine 3 "tests/test_engine_gpu.py::test_block_drafted_equals_serial_on_gpu[bf16-3]"
    timeout 150 python3 tools/gpu/draft_profile.py --rows 16 --windows 6 --drafter synthetic --tree 0,2 \
      --pipelined --trace "$out/trace" > "$out/draft_profile.log" 2>&1
    grep -E "untraced|^===|^trace:|Error|error" "$out/draft_profile.log" | cut -c1-200
    grep -A14 "^=== tree2" "$out/draft_profile.log" | tail -13 ;;
  hundred-seventy-third)
    # Session 44 (~8 min, an H200): issue #5's tables at HEAD (the attention kernels alone, 1- and 16-row windows,
    # bf16 and fp8 pools, 1 and 16 streams, traced; the last H200 run of this section was session 27's, before the
    # fp8 pool's V went key-major), then the tail probe prepared in session 37 (hundred-fifty-third).
    nvidia-smi --query-gpu=name --format=csv,noheader
    attn_sections 330 decode,window tables
    bash "$0" hundred-fifty-third ;;
  hundred-seventy-second)
    # Session 44 (~8 min, an H200): session 43's tree gates on an H200 (leaf lists, the prefix copy, tree windows
    # equal serial decoding), then the bench at HEAD (#6's figures; the last H200 ones are session 39's).
    nvidia-smi --query-gpu=name --format=csv,noheader
    gpu_pytest 60 tree_units 5 tests/test_gdn.py tests/test_kv_quant.py -k "leaf_lists or prefix_copy"
    gpu_pytest 150 tree_engine 4 "tests/test_engine_gpu.py::test_block_drafted_equals_serial_on_gpu[bf16-3]" \
      "tests/test_engine_gpu.py::test_block_drafted_equals_serial_on_gpu[fp8-3]"
    bench_27b 300 5 ;;
  hundred-seventy-first)
    # Session 43 (~3 min, the last device minutes of the session): the GDN window's leaf lists and the kv write's
    # prefix copy on the device (gpu tests at the 27B's shapes), then hundred-sixty-eighth's trace again, chains
    # against trees of branch 2. (The engine gates test_block_drafted_equals_serial_on_gpu[bf16-3] and [fp8-3]
    # then ran as their own calls on the warm machine.)
    gpu_pytest 50 tree_units 5 tests/test_gdn.py tests/test_kv_quant.py -k "leaf_lists or prefix_copy"
    timeout 120 python3 tools/gpu/draft_profile.py --rows 16 --windows 6 --drafter synthetic --tree 0,2 \
      --pipelined --trace "$out/trace" > "$out/draft_profile.log" 2>&1
    grep -E "untraced|^===|^trace:|Error|error" "$out/draft_profile.log" | cut -c1-200
    grep -A12 "^=== tree2" "$out/draft_profile.log" | tail -11
    ;;
  hundred-sixty-ninth)
    # Session 43 (~5 min; prepared, not run: no H200 came): the bench at HEAD (#6's figures; on an H200 the last
    # ones are session 39's).
    nvidia-smi --query-gpu=name --format=csv,noheader
    bench_27b 300 5 ;;
  hundred-sixty-eighth)
    # Session 43 (~4 min): where a tree window's extra time goes at the 27B's shapes. A 16-row DFlash window with
    # chains, then trees of branch 2, pipelined, traced kernel by kernel beside a decode round (hundred-sixty-
    # seventh: 1.60 rounds a chain window, 1.89 a tree window). Every device event goes to $out. (It ran at
    # be8b667 with --tree 0,2,2L: trees built with top_k_small, 3c8ffb6, then with jax.lax.top_k; XLA's TopK kernel
    # took 51 us a window, so top_k_small was reverted.)
    timeout 420 python3 tools/gpu/draft_profile.py --rows 16 --windows 6 --drafter synthetic --tree 0,2 \
      --pipelined --dump --trace "$out/trace" > "$out/draft_profile.log" 2>&1
    grep -E "untraced|^===|^trace:|Error|error" "$out/draft_profile.log" | cut -c1-200
    ;;
  hundred-sixty-seventh)
    # Session 42 (~6 min): hundred-sixty-sixth and -fifth's evals again after the tree's bookkeeping became whole-
    # window array operations (ancestors by squaring, once a window; acceptance without a loop over the rows).
    # hundred-sixty-sixth measured a 16-row tree window at 1.81 decode rounds against a chain's 1.59.
    bash "$0" hundred-sixty-sixth
    demo_tree_evals
    ;;
  hundred-sixty-sixth)
    # Session 42 (~7 min): what a tree window costs at the 27B's shapes (the synthetic drafter's blocks of 16),
    # beside chain windows of the same rows and the decode round, one stream at 1K of context.
    for tree in 0 2; do
      timeout 270 python3 -m qwen_jax bench --synthetic 27b --streams 1 --prompt-lengths "" --context 1024 \
        --rounds 16 --draft-rows 8,16 --drafter synthetic --draft-tree $tree --no-compile-timing \
        --compile-cache "" 2>&1 | tee "$out/bench_27b_tree$tree.log" | grep -E "^decode|^block "
    done
    ;;
  hundred-sixty-fourth)
    # Prepared in session 41 (~7 min): the draft policy (qwen_jax/engine/policy.py, adaptive by default) on the
    # device. The drafted = serial gates with it (copy and block drafts, bf16 and fp8: windows of changing rows and,
    # for copy drafts, serial rounds between them), then the demo model's drafted decoding under each policy
    # (session 41 before the policy: 700.0 -> 1084.6 tok/s, 1.55x, on an H100).
    gpu_pytest 330 policy_gates 6 tests/test_engine_gpu.py -k "drafted"
    for policy in adaptive always; do
      timeout 100 python3 -m qwen_jax eval drafts --model models/demo-mlx-8bit --drafter models/demo-dflash \
        --text /usr/share/common-licenses/GPL-3 --prompts 8 --gen-tokens 128 --streams 1 --draft-policy $policy \
        --compile-cache "" 2>&1 | tail -1
    done
    ;;
  hundred-sixty-third)
    # Prepared in session 41 (~8 min): session 40's engine gates (hundred-sixty-second), then images on the device:
    # the tower, the media pool and the app with the kernels on (tests/test_images_gpu.py), and the CPU suite's image
    # files run on the GPU as they stand (their tolerances were set on the CPU; a failure there is a finding).
    gpu_pytest 300 session40 8 tests/test_engine_gpu.py \
      -k "(concurrent and bfloat16-False-bf16) or (drafted and bf16) or (resumed and bf16)"
    gpu_pytest 200 images 4 tests/test_images_gpu.py
    timeout -s INT 150 python3 -m pytest -m "gpu or not gpu" -q -p no:cacheprovider --tb=short tests/test_vision.py \
      tests/test_media.py > "$out/images_cpu_files_on_gpu.log" 2>&1
    grep -hE "^FAILED|^E |passed|failed" "$out/images_cpu_files_on_gpu.log" | cut -c1-200 | tail -8
    ;;
  hundred-sixty-second)
    # Prepared in session 40 (~4 min): the engine's gates after the session's program changes (prompt programs take a
    # media pool and embed rows; draft windows keep the host's M-RoPE delta): batched concurrent = solo, copy and
    # block drafts = serial, resumed = fresh, bf16.
    gpu_pytest 300 session40 8 tests/test_engine_gpu.py \
      -k "(concurrent and bfloat16-False-bf16) or (drafted and bf16) or (resumed and bf16)"
    ;;
  hundred-sixty-first)
    # Prepared in session 40 (~6 min): DFlash block drafts. The gate (drafted = serial with the tiny random drafter
    # and with an oracle's drafts, bf16 and fp8), then the 27B's block windows with a synthetic bf16 drafter at the
    # 27B drafter's shapes (5 layers, blocks of 16), beside the decode round and copy-draft windows of the same rows.
    gpu_pytest 240 block_drafts 6 tests/test_engine_gpu.py -k "block_drafted"
    timeout 200 python3 -m qwen_jax bench --synthetic 27b --streams 1 --prompt-lengths "" --context 1024 \
      --rounds 16 --draft-rows 4,16 --drafter synthetic --no-compile-timing --compile-cache "" 2>&1 \
      | tee "$out/bench_27b_block.log" | grep -E "^decode|^block "
    ;;
  hundred-sixtieth)
    # Prepared in session 39 (~4 min): the fused draft window (acceptance and commit in the draft program). Its
    # gate against the serial step (bf16), then one stream's 4- and 16-row windows at 1K beside the decode round,
    # as the engine runs them and pipelined (first token and lengths from the device, each window enqueued before
    # the previous one is fetched); session 39 before the fusion: 23.63 / 24.22 ms against 6.41.
    gpu_pytest 150 drafts_bf16 6 tests/test_engine_gpu.py -k "drafted and bf16"
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1 --prompt-lengths "" --context 1024 \
      --rounds 16 --draft-rows 4,16 --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b_draft.log" \
      | grep -E "^decode|^draft "
    ;;
  hundred-fifty-ninth)
    # Prepared in session 39 (~7 min): the engine's two exactness gates not yet run on the device. The prompt cache
    # (resumed == fresh, bf16 and fp8 caches), then copy drafts (drafted == serial, bf16 and fp8).
    gpu_pytest 160 prompt_cache 6 tests/test_engine_gpu.py -k "resumed"
    gpu_pytest 240 drafts 6 tests/test_engine_gpu.py -k "drafted"
    ;;
  hundred-fifty-eighth)
    # Prepared in session 39 (~5 min): the copy drafts' cost curve on the 27B. One stream's chain windows of 2, 4,
    # 8 and 16 rows (draft + commit) beside its decode round, at 1K and 32K of context (the second run loads the
    # first's compiled programs from a shared cache).
    for ctx in 1024 32768; do
      timeout 280 python3 -m qwen_jax bench --synthetic 27b --streams 1 --prompt-lengths "" --context $ctx \
        --rounds 16 --draft-rows 2,4,8,16 --no-compile-timing --compile-cache /tmp/cc_draft 2>&1 \
        | tee -a "$out/bench_27b_draft.log" | grep -E "^decode|^draft "
    done ;;
  hundred-fifty-seventh)
    # Session 38 (~2.5 min): hundred-fifty-sixth's bf16 case alone, for what a lease has left after a start.
    gpu_pytest 150 drafts_bf16 6 tests/test_engine_gpu.py -k "drafted and bf16"
    ;;
  hundred-fifty-sixth)
    # Prepared in session 38 (~4 min): copy drafts on the device. The engine's drafted replies against the fused
    # serial step (chain windows of up to 16 rows, bf16 and fp8 caches; tests/test_engine_gpu.py).
    gpu_pytest 240 drafts 6 tests/test_engine_gpu.py -k "drafted"
    ;;
  hundred-fifty-fifth)
    # Session 38 (~2.5 min): what a lease has left after a machine's start and three refusals. The fp8 pass 1s side
    # by side only (window_fp8, traced), stopping at its budget; the e4m3 gpu test waits for hundred-fifty-fourth.
    attn_sections 150 window_fp8 e4m3
    ;;
  hundred-fifty-third)
    # Prepared in session 37 (~2 min): what a merge in the window pass 1's tail would cost (docs/kernels/attention.md,
    # session 37). The tail probe with bf16 parts of [8, 256] (a 1-row window's partials), the last CTA of each
    # group reading the 31 others' one after another or all at once by TMA; kernels alone from a trace, with and
    # without the tail; 4 groups (one stream's KV heads) and 64 (16 streams). The merge launch it would replace
    # takes ~5 µs (session 24).
    for groups in 4 64; do
      timeout 100 python3 tools/gpu/tail_probe.py --groups $groups --dtype bfloat16 --store tma,generic \
        --gather registers,tma --calls 100 --trace /tmp/trace_tail 2>&1 | tee -a "$out/tail_probe_gather.log" \
        | grep -E "calls equal|FAILED|skipped"
    done ;;
  hundred-fifty-second)
    # Prepared in session 37 (~9.5 min; after hundred-fifty-first): the e4m3 pass 1 in the engine. Its
    # concurrent == solo gate (the tiny 4-bit model, fp8 pools key-major with the chunk max, awm.FP8 on); the fp8
    # cache against bf16 through the decode path's windows on the tiny 4-bit model, by pass 1 (`eval kv --path
    # decode`); then the engine's fp8 decode at 32K of context, the Triton pass 1 (shipped), then e4m3.
    gpu_pytest 180 engine_e4m3 6 tests/test_engine_gpu.py -k "chunkmax"
    for w in triton mgpu; do
      timeout 80 python3 -m qwen_jax eval kv --model captures/tiny-mlx-4bit --path decode --fp8-window $w \
        --max-tokens 400 --compile-cache "" 2>&1 | tee -a "$out/eval_kv_decode.log" | tail -1
    done
    for w in triton mgpu; do
      timeout 120 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths "" --context 32768 \
        --rounds 32 --kv-cache fp8 --fp8-window $w --no-compile-timing --compile-cache "" 2>&1 \
        | tee -a "$out/bench_27b_fp8_window.log" | grep -E "window|decode"
    done ;;
  hundred-forty-eighth)
    # Prepared in session 36 (~9 min, for an H200): issue #5's and #6's tables at session 36's defaults (the "halves"
    # conversion; an fp8 pool's V key-major with the chunk max), which session 36 measured on an H100 only. The
    # attention kernels alone (1- and 16-row windows, bf16 and fp8, 1 and 16 streams; traced), then the engine's
    # bench with a bf16 and with an fp8 cache.
    attn_sections 300 decode,window tables
    bench_27b 140 4
    timeout 120 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
      --kv-cache fp8 --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b_fp8.log" | tail -4 ;;
  hundred-forty-ninth)
    # Prepared in session 36 (~9 min): the gpu suite's attention, KV and engine half at session 36's defaults.
    gpu_pytest 280 suite_attention 12 tests/test_attention.py tests/test_kv_quant.py tests/test_attention_mgpu.py \
      tests/test_attention_window_mgpu.py tests/test_attn_prep.py
    gpu_pytest 250 suite_engine 12 tests/test_engine_gpu.py tests/test_model_consistency.py ;;
  hundred-fiftieth)
    # Prepared in session 36 (~9 min): the gpu suite's matmul, GDN and norm half at session 36's defaults.
    gpu_pytest 280 suite_qmm 12 tests/test_qmm.py tests/test_qmm_mgpu.py tests/test_swiglu.py
    gpu_pytest 250 suite_gdn 12 tests/test_gdn.py tests/test_residual.py tests/test_rownorm.py ;;
  hundred-forty-seventh)
    # Prepared in session 34 (~7.5 min): the decode qmm's "halves" conversion (qmm_mgpu.CONVERSION "halves": lane
    # words with each pair's fields in the word's two 16-bit halves, two instructions a pair; the bits of
    # "subnormal"). Its gpu tests (the oracle and row invariance, "words"' bits at 1/5/16 rows with and without row
    # scales, the prompt path's dequantization pass on that order), the kernel alone against "subnormal" at 8-row
    # pieces (alternated), then the one-stream round traced as shipped and with it.
    gpu_pytest 200 halves 14 tests/test_qmm_mgpu.py -k "halves or lane_order"
    timeout 170 python3 tools/gpu/mgpu_probe.py --rows 8 --probes subnormal,halves,subnormal,halves \
      --shapes 5120x34816,17408x5120,5120x6144,6144x5120,5120x16480 --trace /tmp/trace_halves 2>&1 \
      | tee "$out/mgpu_halves.log" | tail -21
    for v in "" "--mgpu-conversion halves"; do
      profile_round 55 "$v" "kernel_mosaic"
    done ;;
  hundred-forty-fourth)
    # Prepared in session 33 (~7 min): the defaults session 33 shipped (ops.PACK_QUERIES; ops.STEP_NORM up to one
    # stream), which no call ran as a whole: every engine gate at the defaults, the one-stream round traced, then the
    # bench.
    gpu_pytest 220 engine 12 tests/test_engine_gpu.py
    profile_round 60 "" "kernel_mosaic|gdn_step|rownorm_gated|attn_prep|residual_add"
    bench_27b 140 4 ;;
  hundred-forty-third)
    # Prepared in session 33 (~9 min): what an fp8 pool's key-major V (kv_quant.FP8_V_LAYOUT "keys") with the chunk
    # max (attention.FP8_V_MAX "chunk") still needs before it ships. The chunk max's gpu test with the fixed
    # float64 oracle; the pass 1s traced (kernels alone, by layout); then the engine's fp8 bench by layout (the
    # decode write stores a row as a column of its page: its cost in a round), 1 and 16 streams at 4K and 32K.
    gpu_pytest 120 chunkmax 6 tests/test_attention.py -k "chunk_v_max_gpu or keys_major_gpu"
    attn_sections 250 v_layout v_layout
    for lay in rows keys; do
      timeout 90 python3 -c "import runpy, sys; from pallas_kernels import attention; \
        attention.FP8_V_MAX = 'chunk' if sys.argv[-1] == 'keys' else 'block'; sys.argv = ['qwen_jax'] + sys.argv[1:]; \
        runpy.run_module('qwen_jax', run_name='__main__')" bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 \
        --rounds 32 --kv-cache fp8 --no-compile-timing --compile-cache "" --fp8-v-layout $lay 2>&1 \
        | tee "$out/bench_27b_fp8_$lay.log" | tail -4 | sed "s/^/$lay /"
    done ;;
  hundred-forty-second)
    # Session 33 (~9.5 min): the timing of hundred-forty-first's changes. The fp8 pass 1 by V layout (bench
    # attention --sections v_layout, as far as 250 s go: one stream's 4K / 32K / 128K first), then the round traced at
    # 1 and 16 streams as shipped and with STEP_NORM, the rows tail (16 rows) and PACK_QUERIES on. (Session 33 ran it
    # with, in the same call, `bench attention --sections v_layout --budget-s 180` without a trace, whose logs took
    # the stage's file names, and the bench with those three switches on; a third call traced one stream with
    # PYTHONPATH=$PWD as shipped, with the three, and with --pack-queries alone, then ran the bench at the defaults.)
    attn_sections 270 v_layout v_layout
    for st in 1 16; do
      for v in "" "--step-norm --residual-norm-rows 16 --residual-norm-tail rows --pack-queries"; do
        timeout 70 python3 tools/gpu/decode_profile.py --synthetic 27b --streams $st --rounds 16 --trace /tmp/trace_sn \
          --profiled 0 $v 2>&1 | tee "$out/profile_s${st}_$(echo "$v" | tr -c 'a-z0-9\n' '_').txt" \
          | grep -E "trace:|events|device-bound|pipelined|  (residual_add|rownorm_rms|rownorm_gated|gdn_step|attn_prep)" \
          | sed "s/^/s$st /" | head -10
      done
    done ;;
  hundred-fortieth)
    # Prepared in session 32 (not run; ~8 min), after hundred-thirty-ninth: bench attention --sections v_layout,
    # kernels alone: the fp8 pass 1 over V by rows (shipped), key-major, and key-major with V's scales relative to
    # the chunk's max (at 32- and 64-key blocks), 1- and 16-row windows at 1 stream (4K / 32K / 128K) and 16
    # streams (4K / 32K); then the fp8 prompt and the write by layout. Ship what its gates passed and what is
    # faster (kv_quant.FP8_V_LAYOUT, attention.FP8_V_MAX).
    attn_sections 470 v_layout v_layout ;;
  hundred-thirty-ninth)
    # Prepared in session 32 (no device lent; ~6 min): an fp8 pool's V key-major (kv_quant.KVPool.v_layout "keys",
    # FP8_V_LAYOUT, "rows" by default) and V's scales relative to the chunk's max (WindowTiles.fp8_v_max "chunk",
    # attention.FP8_V_MAX, "block" by default). Their gpu tests: the write kernel's bytes; the 27B's windows at 1
    # and 16 rows and a 30K-key stream, and the Triton prompt, key-major bit for bit the row layout; the chunk max
    # right against float64, its bits free of other streams, the table width and launch choices. Then the engine's
    # fp8 gates: as shipped, key-major, key-major with the chunk max.
    gpu_pytest 240 vkeys 14 tests/test_attention.py tests/test_kv_quant.py -k "keys_major or chunk_v_max or write_kernel_gpu"
    gpu_pytest 150 engine_vkeys 5 tests/test_engine_gpu.py -k "fp8" ;;
  hundred-thirty-eighth)
    # Prepared in session 31 (not run; ~8 min): the fused residual add's norm on programs of its own, a row each
    # (residual.residual_add_norm tail "rows", ops.RESIDUAL_NORM_TAIL; they wait on the add programs' count), for
    # more than one row: its gpu tests (both tails at 1, 8 and 16 rows), every engine gate with it up to 16 rows,
    # then 4 and 16 streams traced with the add and norm apart beyond one row (the default) and fused up to 16.
    # If the gates pass and the rounds are faster, make "rows" the tail and raise RESIDUAL_NORM_ROWS.
    gpu_pytest 100 rows 6 tests/test_residual.py -k "norm"
    timeout -s INT 200 python3 -c "import sys, pytest; from qwen_jax.model import ops; ops.RESIDUAL_NORM_TAIL = 'rows'; \
      ops.RESIDUAL_NORM_ROWS = 16; sys.exit(pytest.main(sys.argv[1:]))" -m gpu -v -p no:cacheprovider --tb=short \
      tests/test_engine_gpu.py > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-200 | tail -10
    for st in 4 16; do
      for v in "" "--residual-norm-rows 16 --residual-norm-tail rows"; do
        timeout 60 python3 tools/gpu/decode_profile.py --synthetic 27b --streams $st --rounds 16 --trace /tmp/trace_rn \
          --profiled 0 $v 2>&1 | tee "$out/profile_s${st}_$(echo "$v" | tr -c 'a-z0-9\n' '_').txt" \
          | grep -E "trace:|device-bound|pipelined|  (residual_add|rownorm_rms)" | sed "s/^/s$st /" | head -6
      done
    done ;;
  hundred-thirty-seventh)
    # Prepared in session 31 (no device was left to run it; ~9 min): the serial step's GDN recurrence with its
    # output norm in one launch (gdn.step_norm, ops.STEP_NORM, off by default until this passes): its gpu tests at
    # the 27B's heads, the tiny 4-bit model's step == verify + commit and == with each fused launch off, every engine
    # gate with it on, the round traced without and with it, then the bench with STEP_NORM on. If the gates pass
    # and the round is faster, turn STEP_NORM on.
    gpu_pytest 120 stepnorm 8 tests/test_gdn.py tests/test_model_consistency.py -k "step_norm or pieces"
    timeout -s INT 260 python3 -c "import sys, pytest; from qwen_jax.model import ops; ops.STEP_NORM = True; \
      sys.exit(pytest.main(sys.argv[1:]))" -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-200 | tail -10
    for v in "" --step-norm; do profile_round 60 "$v" "kernel_mosaic|gdn_step|rownorm_gated"; done
    timeout 130 python3 -c "import runpy, sys; from qwen_jax.model import ops; ops.STEP_NORM = True; \
      sys.argv = ['qwen_jax'] + sys.argv[1:]; runpy.run_module('qwen_jax', run_name='__main__')" bench \
      --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 --no-compile-timing --compile-cache "" 2>&1 \
      | tee "$out/bench_27b.log" | tail -3 ;;
  hundred-thirty-sixth)
    # Session 31 (~7 min): each residual add with the norm after it in one launch (residual.residual_add_norm,
    # ops.RESIDUAL_NORM): its gpu tests (the 27B's down projection and 5120-wide norm, bit for bit the two kernels),
    # the tiny 4-bit model's step == verify + commit and == with the adds apart, every engine gate, then the round
    # traced with and without.
    gpu_pytest 120 resnorm 6 tests/test_residual.py tests/test_model_consistency.py -k "norm or pieces"
    gpu_pytest 260 engine 10 tests/test_engine_gpu.py
    for v in "" --no-residual-norm; do profile_round 70 "$v" "kernel_mosaic|residual_add|rownorm_rms"; done ;;
  hundred-thirty-fifth)
    # Session 31 (~3 min, at 4481dc8): the decode qmm alone, each call asking L2 for the first 0/2/4/8 blocks of
    # each CTA of the next call (the next weight copy of the chain) at its own last step; then a weight that stays
    # in L2 from call to call (one copy: the most such a prefetch could give at the shapes that fit). At most
    # 0.5-0.8 us at the two smallest shapes, none at the others: the option was removed (daa3f88), so this stage
    # needs 4481dc8.
    timeout 150 python3 tools/gpu/mgpu_probe.py --rows 8 --probes subnormal --prefetch 0,2,4,8 --trace /tmp/probe_pf \
      --shapes 5120x6144,6144x5120,17408x5120,5120x16480,5120x34816 2>&1 | tee "$out/probe_pf.txt" \
      | grep -E "^ +[0-9]+x|failed" | cut -c1-200
    timeout 60 python3 tools/gpu/mgpu_probe.py --rows 8 --probes subnormal --copies 1 --trace /tmp/probe_l2 \
      --shapes 5120x6144,6144x5120,17408x5120 2>&1 | tee "$out/probe_l2.txt" | grep -E "^ +[0-9]+x|failed" \
      | sed "s/^/in L2 /" | cut -c1-200 ;;
  hundred-thirty-fourth)
    # Session 31 (~6 min): the 3 engine gates session 30 could not run after the gate began writing the o
    # projection's padding (1224e62), with the other 4 again; then the decode qmm alone at 8 groups a step (3 stages
    # fit) against 4, at 8-row pieces, and the one-stream round traced under each.
    gpu_pytest 260 engine 10 tests/test_engine_gpu.py
    for bg in 4 8; do
      timeout 75 python3 tools/gpu/mgpu_probe.py --rows 8 --stages 4 --block-groups $bg --probes subnormal \
        --trace /tmp/probe_bg --shapes 5120x34816,17408x5120,5120x6144,6144x5120,5120x16480 2>&1 \
        | tee "$out/probe_bg$bg.txt" | grep -E "^ +[0-9]+x|failed" | sed "s/^/bg$bg /" | cut -c1-200
    done
    for v in "" --mgpu-block-groups=8; do profile_round 70 "$v" "kernel_mosaic"; done ;;
  hundred-thirty-third)
    # Session 30, the last ~5 min of device time: the attention output's gate writes the o projection's padded rows
    # (attention.finish, ops.Padded a registered pytree): the model's gpu step test, every engine gate, the round
    # traced.
    gpu_pytest 80 model 3 tests/test_model_consistency.py tests/test_residual.py -k "pieces or residual"
    gpu_pytest 150 engine 10 tests/test_engine_gpu.py
    profile_round 60 "" "kernel_mosaic|loop_pad|loop_convert" ;;
  hundred-thirty-second)
    # Session 30, the last ~6 min of device time: the 27B decode program at 4 layers (3 GDN, 1 attention), one
    # stream, compiled with XLA's dumps on, its optimized HLO kept: which ops the glue fusions left around the
    # attention layer (loop_convert / loop_pad) hold, for the next session.
    mkdir -p /tmp/hlo
    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" timeout 240 python3 tools/gpu/decode_profile.py \
      --synthetic 27b --layers 4 --streams 1 --rounds 2 --profiled 0 > "$out/hlo_run.log" 2>&1
    f=$(ls -S /tmp/hlo/*after_optimizations.txt | head -1)
    cp "$f" "$out/decode_after_optimizations.txt"
    ls -S /tmp/hlo/*after_optimizations.txt | head -3; wc -c "$out/decode_after_optimizations.txt"
    grep -cE "^fused_computation|fusion" "$out/decode_after_optimizations.txt" ;;
  hundred-thirty-first)
    # Session 30, the last device time (~9 min): the attention prep on the qkv projection's pieces (PREP_PIECES now
    # covers both preps): its gpu tests, the tiny 4-bit model's step == verify + commit and == the preps on the
    # materialized outputs, every engine gate, the round traced with and without, then the bench.
    gpu_pytest 120 prep 6 tests/test_attn_prep.py tests/test_model_consistency.py -k "pieces"
    gpu_pytest 170 engine 10 tests/test_engine_gpu.py
    for v in "" --no-prep-pieces; do profile_round 60 "$v" "kernel_mosaic|attn_prep|gdn_decode_prep|loop_slice"; done
    bench_27b 150 3 ;;
  hundred-thirtieth)
    # Session 30 (~6 min): the swiglu gpu test at 8-row pieces (its row count fixed), then the bench at today's
    # defaults (8-row pieces, the GDN prep on pieces).
    gpu_pytest 90 swiglu 3 tests/test_swiglu.py
    bench_27b 240 3 ;;
  hundred-twenty-ninth)
    # Session 30 (~9 min): 8-row pieces (NARROW_ROWS 8) and the GDN prep on the in-projection's pieces
    # (PREP_PIECES): their gpu tests (the 8-row pieces' bits, the prep on pieces at the 27B's heads, the tiny 4-bit
    # model's step on pieces == verify + commit, residual, swiglu), every engine gate, the round traced with the
    # prep on pieces and without.
    gpu_pytest 240 kernels 12 tests/test_gdn.py tests/test_model_consistency.py tests/test_qmm_mgpu.py \
      tests/test_residual.py tests/test_swiglu.py -k "pieces or decode_prep or residual or swiglu or oracle"
    gpu_pytest 200 engine 10 tests/test_engine_gpu.py
    for v in "" --no-prep-pieces; do profile_round 70 "$v" "kernel_mosaic|gdn_decode_prep|loop_slice_fusion"; done ;;
  hundred-twenty-eighth)
    # Session 30 (~8 min): the decode qmm's pipeline depth and piece height: the kernel alone at 16 rows (4-6
    # stages) and 8 rows (4-7 stages), then the one-stream round traced at today's defaults, at the most stages that
    # fit, with 8-row pieces, and both.
    for r in 16 8; do
      for st in 4 5 6 $([ $r = 8 ] && echo 7); do
        timeout 75 python3 tools/gpu/mgpu_probe.py --rows $r --stages $st --probes subnormal --trace /tmp/probe_d \
          --shapes 5120x34816,17408x5120,5120x6144,5120x16480 2>&1 | tee "$out/probe_r${r}_s$st.txt" \
          | grep -E "^ +[0-9]+x|failed" | sed "s/^/r$r s$st /" | cut -c1-200
      done
    done
    for v in "" --mgpu-stages=7 --narrow-rows=8 "--narrow-rows=8 --mgpu-stages=7"; do
      profile_round 80 "$v" "kernel_mosaic"
    done ;;
  hundred-twenty-seventh)
    # Session 30 (~8 min): the decode qmm's "chain" accumulation (one accumulator across steps, buffers released a
    # step late) against "step": the kernel alone at 16 and 8 rows (PTX kept, for ptxas's warnings offline), the gpu
    # tests of both (oracle, rows, pieces, stages), the one-stream round traced under each. Measured at 4f17792:
    # right bits, slower at every shape (ptxas put every A fragment in the same registers and waited after each
    # wgmma); removed.
    mkdir -p /tmp/ptxc
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=/tmp/ptxc timeout 150 python3 tools/gpu/mgpu_probe.py --accumulate step,chain \
      --shapes 5120x34816,17408x5120,5120x6144,6144x5120,5120x16480 --probes subnormal --trace /tmp/probe_acc 2>&1 \
      | tee "$out/probe_acc16.txt" | grep -E "^ +[0-9]+x|failed" | cut -c1-200
    tar czf "$out/ptx.tgz" /tmp/ptxc/*.ptx 2>/dev/null
    timeout 80 python3 tools/gpu/mgpu_probe.py --rows 8 --accumulate step,chain --shapes 5120x34816,6144x5120 \
      --probes subnormal --trace /tmp/probe_acc8 2>&1 | tee "$out/probe_acc8.txt" | grep -E "^ +[0-9]+x|failed" | cut -c1-200
    gpu_pytest 200 acc 12 tests/test_qmm_mgpu.py -k accumulates
    for v in --accumulate=step --accumulate=chain; do profile_round 90 "$v" "kernel_mosaic"; done ;;
  hundred-twenty-sixth)
    # Session 29, the last ~6 min of device time: the decode qmm's step under Nsight Compute at today's defaults
    # (hundred-twenty-first's measure, "subnormal" conversion, loads in place), then the bench again.
    timeout -s INT 120 ncu --profile-from-start off --clock-control none --kernel-name regex:"mosaic|qmm" \
      --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
      --export "$out/qmm_sass" python3 tools/gpu/kernel_ncu.py --cases qmm_5120x34816_m1 > "$out/sass_run.log" 2>&1
    ncu --import "$out/qmm_sass.ncu-rep" --page source --csv --print-source sass > "$out/qmm_sass.csv" 2> "$out/sass_page.err"
    ncu --import "$out/qmm_sass.ncu-rep" --page details > "$out/qmm_details.txt" 2>&1
    python3 tools/gpu/sass_stalls.py "$out/qmm_sass.csv" --top 10 | cut -c1-160 | tail -28
    grep -E "Duration|DRAM Throughput|Issued Warp|No Eligible|Eligible Warps" "$out/qmm_details.txt" | cut -c1-120
    rm -f "$out/qmm_sass.ncu-rep"
    bench_27b 200 3 ;;
  hundred-twenty-fifth)
    # Session 29, the last device time (~9.5 min): the residual adds after the output projections in one kernel each
    # (residual_add on the decode qmm's pieces): its gpu test, every engine gate, the one-stream round traced with it
    # on and off, then the bench.
    gpu_pytest 70 residual 3 tests/test_residual.py
    gpu_pytest 200 engine 10 tests/test_engine_gpu.py
    for v in "" --no-residual; do profile_round 70 "$v" "kernel_mosaic|residual_add|loop_add"; done
    bench_27b 170 3 ;;
  hundred-twenty-fourth)
    # Session 29, the last ~8 min of device time: the decode qmm alone with its lane words' loads staggered and in
    # place (the default now) and at 8 groups a step; the engine's gates at today's defaults; the bench.
    for v in 1 0; do
      timeout 80 python3 tools/gpu/mgpu_probe.py --staggered $v --shapes 5120x34816,17408x5120,5120x6144 \
        --probes subnormal --trace /tmp/probe_st 2>&1 | tee "$out/probe_st$v.txt" | grep -E "^ +[0-9]+x|failed" | cut -c1-200
    done
    timeout 80 python3 tools/gpu/mgpu_probe.py --block-groups 8 --stages 3 --shapes 5120x34816,17408x5120 \
      --probes subnormal --trace /tmp/probe_bg 2>&1 | tee "$out/probe_bg8.txt" | grep -E "^ +[0-9]+x|failed" | cut -c1-200
    gpu_pytest 130 engine 10 tests/test_engine_gpu.py
    bench_27b 220 3 ;;
  hundred-twenty-third)
    # Session 29 (~8 min): "subnormal" the default, its splats folded into the FMA (PTX halves): the gpu tests
    # (subnormal and words bits with row scales, unstaggered loads, piece heights, swiglu), the kernel alone with the
    # lane words' loads staggered and in place (PTX kept), the one-stream round under each, then the bench.
    gpu_pytest 170 qmm 12 tests/test_qmm_mgpu.py tests/test_swiglu.py -k "subnormal or unstaggered or wide_pieces or swiglu"
    for v in 1 0; do
      mkdir -p /tmp/ptx$v
      MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx$v timeout 100 python3 tools/gpu/mgpu_probe.py --staggered $v \
        --shapes 5120x34816,17408x5120,5120x6144 --probes words,subnormal --trace /tmp/probe_sub 2>&1 \
        | tee "$out/probe$v.txt" | grep -E "^ +[0-9]+x"
    done
    tar czf "$out/ptx.tgz" /tmp/ptx*/*.ptx 2>/dev/null
    for v in --staggered-loads=1 --staggered-loads=0; do profile_round 100 "$v" "qmm|kernel_mosaic"; done
    bench_27b 220 5 ;;
  hundred-twenty-second)
    # Session 29 (~8 min): the decode qmm's "subnormal" conversion (3 instructions a weight pair instead of 4):
    # its gpu tests (the oracle, rows, and the "words" bits with and without row scales), the kernel alone beside
    # "words" with each compiled kernel's SASS opcodes counted, the one-stream round traced under each, and the
    # engine's gates with it as the default.
    gpu_pytest 150 subnormal 8 tests/test_qmm_mgpu.py -k "subnormal"
    mkdir -p /tmp/sass
    MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=/tmp/sass timeout 100 python3 tools/gpu/mgpu_probe.py \
      --shapes 5120x34816,17408x5120,5120x6144 --probes words,subnormal --trace /tmp/probe_sub 2>&1 \
      | tee "$out/probe_subnormal.txt" | grep -v "^WARNING"
    ls /tmp/sass | head -20
    python3 - <<'PY'
import collections, os, re
for f in sorted(os.listdir("/tmp/sass")):
    text = open(os.path.join("/tmp/sass", f), errors="replace").read()
    ops = collections.Counter(re.findall(r"\b(HFMA2|HADD2|PRMT|LOP3|IMAD|SEL|HGMMA|LDS|SHF|FFMA)\b", text))
    print(f[:60], len(text), dict(ops.most_common()))
PY
    mkdir -p "$out/sass" && find /tmp/sass -size -3M -type f -exec cp {} "$out/sass/" \;
    for c in words subnormal; do profile_round 100 "--mgpu-conversion=$c" "qmm|xla|kernel_mosaic"; done
    timeout -s INT 150 python3 -c "import sys, pytest; from pallas_kernels import qmm_mgpu; \
      qmm_mgpu.CONVERSION = 'subnormal'; sys.exit(pytest.main(sys.argv[1:]))" -m gpu -v -p no:cacheprovider \
      --tb=short tests/test_engine_gpu.py > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-200 | tail -10 ;;
  hundred-twenty-first)
    # Session 29 (~4 min): where the Mosaic GPU decode qmm's step goes. Nsight Compute's warp-state samples per SASS
    # instruction and by opcode for the MLP's gate/up kernel (5120 -> 34816, M = 1), its stall reasons per issued
    # instruction, then the kernel alone with and without its compute at 16 and 8 rows (traced).
    timeout -s INT 120 ncu --profile-from-start off --clock-control none --kernel-name regex:"mosaic|qmm" \
      --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
      --export "$out/qmm_sass" python3 tools/gpu/kernel_ncu.py --cases qmm_5120x34816_m1 > "$out/sass_run.log" 2>&1
    tail -3 "$out/sass_run.log"
    ncu --import "$out/qmm_sass.ncu-rep" --page source --csv --print-source sass > "$out/qmm_sass.csv" 2> "$out/sass_page.err"
    ncu --import "$out/qmm_sass.ncu-rep" --page details > "$out/qmm_details.txt" 2>&1
    tail -3 "$out/sass_page.err"
    python3 tools/gpu/sass_stalls.py "$out/qmm_sass.csv" --top 30 > "$out/qmm_stalls.txt"
    cut -c1-180 "$out/qmm_stalls.txt" | head -75
    grep -E "Duration|DRAM Throughput|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Issued Warp|Active Warps|Eligible Warps|Stall" \
      "$out/qmm_details.txt" | cut -c1-150 | head -30
    for r in 16 8; do
      timeout 100 python3 tools/gpu/mgpu_probe.py --shapes 5120x34816,17408x5120,5120x6144 --rows $r \
        --probes words,words_no_compute --trace /tmp/probe_$r 2>&1 | tee "$out/probe_$r.txt" | grep -v "^WARNING"
    done ;;
  hundred-twentieth)
    # Session 28, the last ~5 min of device time: the MLP's activation kernel (swiglu: the gate/up pieces summed,
    # SwiGLU'd and padded for the down projection in one launch): its gpu test, every engine gate, then the
    # 1-stream round traced (hundred-nineteenth's short-chunk round is the baseline).
    gpu_pytest 50 swiglu 4 tests/test_swiglu.py
    gpu_pytest 115 engine 10 tests/test_engine_gpu.py
    timeout 95 python3 tools/gpu/decode_profile.py --synthetic 27b --streams 1 --rounds 16 --trace /tmp/trace_sw \
      --profiled 0 2>&1 | tee "$out/profile_swiglu.txt" \
      | grep -E "trace:|device-bound|pipelined|  (loop_pad|swiglu|kernel_mosaic)" | head -8 ;;
  hundred-nineteenth)
    # Session 28, the last ~5 min of device time: the 1-stream round traced with short chunks off, then on (the
    # bench gained a third of what the window table predicts): device busy, events and the families a round.
    for v in 65536 128; do
      timeout 110 python3 tools/gpu/decode_profile.py --synthetic 27b --streams 1 --rounds 16 --trace /tmp/trace_$v \
        --profiled 0 --short-chunk $v 2>&1 | tee "$out/profile_short_$v.txt" \
        | grep -E "trace:|device-bound|pipelined|  (qmm|attention|norms|gdn|kv write|xla)" | head -10
    done ;;
  hundred-eighteenth)
    # Session 28, the last ~8 min of device time: the merge's column blocks narrowed where that lets 8 short chunks'
    # partials fit the early merge (16 streams); two engine gates that cross stream counts, the short-chunk rule
    # again, then the bench.
    gpu_pytest 80 engine 4 tests/test_engine_gpu.py -k "stream_bucket or False-bf16"
    timeout 150 python3 -m pallas_kernels.bench attention --sections short_rule --budget-s 135 --trace /tmp/trace_sr \
      --json "$out/attention_short_rule.json" 2>&1 | tee "$out/attention_short_rule.log" | grep -E "^copy|FAILED"
    timeout 220 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
      --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b.log" | tail -5 ;;
  hundred-seventeenth)
    # Session 28 (~3 min): hundred-fifteenth's short chunks won at 1 stream and lost at 16 (more CTAs than the GPU
    # holds, and more partials to merge): the rule at 8 and at 4 chunks beside fixed chunks, bf16 pools.
    timeout 170 python3 -m pallas_kernels.bench attention --sections short_rule --budget-s 155 --trace /tmp/trace_sr \
      --json "$out/attention_short_rule.json" 2>&1 | tee "$out/attention_short_rule.log" | grep -E "^copy|FAILED" ;;
  hundred-sixteenth)
    # Session 28 (~7 min): forwards/s with short chunks off / on alternated (1K and 4K context), then the bench.
    timeout 200 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 --context 1024,4096 \
      --variants "short=65536;short=128;short=65536;short=128" 2>&1 | tee "$out/engine_ab_short.log" | tail -14
    timeout 220 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
      --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b.log" | tail -5 ;;
  hundred-fourteenth)
    # Prepared in session 27, not run (~9 min): at the preps' final form (decode_prep in parts), the rest of the
    # engine's gpu gates (chunk cuts, pools in place, fixed shapes), forwards/s with both preps on and off alternated,
    # then the bench for the issue's table.
    gpu_pytest 150 engine 8 tests/test_engine_gpu.py -k "True or chunk_cuts or in_place"
    timeout 170 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 \
      --variants "prep=0,aprep=0;prep=1,aprep=1;prep=0,aprep=0;prep=1,aprep=1" 2>&1 \
      | tee "$out/engine_ab_prep.log" | tail -8
    timeout 220 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
      --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b.log" | tail -5 ;;
  hundred-thirteenth)
    # Session 27, the last ~3 min of device time: decode_prep in 1 + Hv/Hk parts a key head (it took 6.7 µs a call
    # as one program a key head): its gpu test, then the 1-stream round traced with both preps on.
    gpu_pytest 60 prep 4 tests/test_gdn.py -k "gpu_decode_prep"
    timeout 80 python3 tools/gpu/decode_profile.py --synthetic 27b --streams 1 --rounds 16 --trace /tmp/trace_on \
      --profiled 0 2>&1 | tee "$out/profile_on.txt" | grep -E "trace:|device-bound|pipelined|gdn_decode_prep" ;;
  hundred-twelfth)
    # Session 27, the last ~4 min of device time: the 1-stream round traced with both preps on, then off (device busy
    # and events a round: the host's launch rate moved the forwards/s of hundred-eleventh by +-15 %).
    for v in on off; do
      flag=$([ $v = off ] && echo --no-decode-prep)
      timeout 115 python3 tools/gpu/decode_profile.py --synthetic 27b --streams 1 --rounds 16 --trace /tmp/trace_$v \
        --profiled 0 $flag 2>&1 | tee "$out/profile_$v.txt" | grep -E "trace:|device-bound|pipelined" | head -4
    done ;;
  hundred-eleventh)
    # Session 27 (~4 min): hundred-tenth's decode_prep gpu test failed on its own draw (two streams on slot 0, the
    # scratch slot, raced): again with live slots drawn from 1 up; then forwards/s off / on alternated, GDN alone last.
    gpu_pytest 90 prep 4 tests/test_gdn.py -k "gpu_decode_prep"
    timeout 200 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 \
      --variants "prep=0,aprep=0;prep=1,aprep=1;prep=0,aprep=0;prep=1,aprep=1;prep=1,aprep=0" 2>&1 \
      | tee "$out/engine_ab_prep.log" | tail -9 ;;
  hundred-tenth)
    # Session 27, the last ~9 min of device time (hundred-eighth's machine stopped answering): the two preps' gpu
    # tests, the engine's gates that compare bits (concurrent == solo bf16 / fp32 / fp8 pools, the decode row in
    # every stream bucket), then forwards/s with both preps on, off, on.
    gpu_pytest 100 prep 10 tests/test_gdn.py tests/test_attn_prep.py -k "gpu_decode_prep or gpu_attn"
    gpu_pytest 170 engine 8 tests/test_engine_gpu.py -k "False or stream_bucket"
    timeout 250 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 \
      --variants "prep=1,aprep=1;prep=0,aprep=0;prep=1,aprep=1" 2>&1 | tee "$out/engine_ab_prep.log" | tail -8 ;;
  hundred-eighth)
    # Session 27, attempted once: the machine stopped answering and was given back (no output); hundred-tenth to
    # hundred-thirteenth ran its parts. ~8 min: GDN verify and step rows in one launch (`gdn.decode_prep`),
    # attention rows' q/k norms and RoPE in one (`attn_prep`): their gpu tests at the 27B heads (reference, serial
    # steps == chain and tree windows, alone == among others), the engine's gpu gates (every decode path's bits are
    # new), then the 1-stream round traced with both on and both off (device busy, launches).
    gpu_pytest 110 prep 10 tests/test_gdn.py tests/test_attn_prep.py -k "gpu_decode_prep or gpu_step_27b or gpu_attn"
    gpu_pytest 200 engine 10 tests/test_engine_gpu.py
    for v in on off; do
      flag=$([ $v = off ] && echo --no-decode-prep)
      timeout 110 python3 tools/gpu/decode_profile.py --synthetic 27b --streams 1 --rounds 32 --trace /tmp/trace_$v \
        --profiled 0 --dump "$out/round_$v" $flag 2>&1 | tee "$out/profile_$v.txt" | grep -E "round|busy|fusions|gdn" \
        | head -12
      gzip -f "$out/round_$v.hlo.txt"
    done ;;
  hundred-ninth)
    # Prepared in session 27, not run (hundred-eleventh ran a shorter form). ~6 min: decode forwards/s with both preps
    # on and off, alternated, then the GDN one alone.
    timeout 330 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 \
      --variants "prep=1,aprep=1;prep=0,aprep=0;prep=1,aprep=1;prep=0,aprep=0;prep=1,aprep=0" \
      2>&1 | tee "$out/engine_ab_prep.log" | tail -9 ;;
  hundred-seventh)
    # Prepared in session 26, not run (~8 min): the issue's decode and window tables at the fp8 merge fix (fp8 16-row
    # windows not re-timed since a880d81), then the 27B engine bench (not re-measured since session 24).
    attn_sections 200 decode,window decode_window
    timeout 220 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
      --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b.log" | tail -14 ;;
  hundred-sixth)
    # Session 26, the last ~3 min of device time: the 1-row decodes after the merge took the window's fp8 rows
    # widened (a880d81; its dots' operand layout changed), kernels alone.
    attn_sections 110 decode decode ;;
  hundred-fifth)
    # Session 26 (~9 min): hundred-fourth found the fp8 flips in the merge's MMA (codes widened in the kernel: K four
    # elements a thread in mma.sync, not in wgmma), not in the window-key sum. With the window's fp8 rows widened
    # before the merge (`_window_rows_for_merge`): the probe, the window gpu tests (tickets included), the engine's
    # gpu gates (the fp8 windows' bits changed), then the 16-row tail's launches (the merge's cost with the sum in
    # key order).
    timeout 110 python3 tools/gpu/merge_rows_probe.py --sums 2>&1 | tee "$out/merge_sums_probe.log" | cut -c1-600
    gpu_pytest 110 window 9 tests/test_attention.py -k "test_window_gpu_27b or tickets_gpu"
    gpu_pytest 200 engine 10 tests/test_engine_gpu.py
    attn_sections 120 merge_variants merge_variants ;;
  hundred-third)
    # Prepared in session 25, run in session 26 (~8 min): the Mosaic GPU window tests (hundred-second's pytest ran
    # out of time before them: fresh_jit's ping-pong and 8-bit dequant checks, test_gpu_27b_fp8_pool's step bits
    # with f16 dots and FP8_SPLIT's bits), then window_fp8 with "mgpu shared" (attention_window_mgpu.FP8_SPLIT).
    gpu_pytest 200 window_mgpu 10 tests/test_attention_window_mgpu.py
    attn_sections 220 window_fp8 window_fp8 ;;
  hundred-first)
    # Session 25, last ~7 min: which merge launch choices keep a 16-row window's bits compiled (hundredth found the
    # fp8 bf16-dot window's bits changed by the rows split), then the window gpu tests at the new merge_rows rule.
    timeout 230 python3 tools/gpu/merge_rows_probe.py 2>&1 | tee "$out/merge_rows_probe.log" | cut -c1-400
    gpu_pytest 150 window 8 tests/test_attention.py -k "window_gpu_27b" ;;
  hundredth)
    # Session 25 (~10 min): the merge's rows in programs of their own (attention.merge_rows, a launch choice: the
    # early merge for 16-row windows): the window gpu tests (merge_block_rows 16 / 32 / 128 against the rule among
    # them), the 16-row tail's launch choices at five windows, then the issue's decode and window tables.
    gpu_pytest 240 window 24 tests/test_attention.py tests/test_attention_window_mgpu.py -k "window or gpu_27b"
    timeout 190 python3 -m pallas_kernels.bench attention --sections merge_variants --budget-s 170 --trace /tmp/vtrace \
      --json "$out/attention_merge_variants.json" 2>&1 | tee "$out/attention_merge_variants.log" \
      | grep -E "^copy|FAILED" ; grep -A16 "^### merge_variants" "$out/attention_merge_variants.log"
    timeout 170 python3 -m pallas_kernels.bench attention --sections decode,window --budget-s 150 --trace /tmp/dtrace \
      --json "$out/attention_decode_window.json" 2>&1 | tee "$out/attention_decode_window.log" \
      | grep -E "^copy|FAILED" ; sed -n '/^###/,$p' "$out/attention_decode_window.log" | head -60 ;;
  ninety-ninth)
    # Session 25 at 422d874 (~6 min): pass 1's first page indices loaded before the context length is waited on
    # (attention_window_mgpu.EARLY_PAGES, a launch choice; no gain, removed after this run, so the stage runs only at
    # 422d874): the window gpu tests, then off against on at the decode points, kernels alone; then the 16-row
    # windows' tail launch choices (the fold pass against the fused merge at 1 stream and 32K first).
    gpu_pytest 200 window_mgpu 14 tests/test_attention_window_mgpu.py
    timeout 170 python3 -m pallas_kernels.bench attention --sections early_pages --budget-s 150 --trace /tmp/etrace \
      --json "$out/attention_early_pages.json" 2>&1 | tee "$out/attention_early_pages.log" | grep -E "^copy|FAILED" ; \
      grep -A8 "^### early_pages" "$out/attention_early_pages.log"
    timeout 150 python3 -m pallas_kernels.bench attention --sections merge_variants --budget-s 130 --trace /tmp/vtrace \
      --json "$out/attention_merge_variants.json" 2>&1 | tee "$out/attention_merge_variants.log" \
      | grep -E "^copy|FAILED" ; grep -A16 "^### merge_variants" "$out/attention_merge_variants.log" ;;
  ninety-eighth)
    # Session 25 at a2df415 (~3 min): mma_rows "n" with a 16-row window's two warpgroups of 48 rows in one CTA
    # (sharing the K/V slots; ninety-seventh ran them as two CTAs): the gpu tests, then "m" against "n" at every
    # point of the mma_rows section. "n" was wrong in one CTA and 1.65-2.11x on 16-row windows; removed after it
    # (with its tests and bench section, so this stage runs only at a2df415).
    gpu_pytest 150 mma_n 6 tests/test_attention_window_mgpu.py -k "mma_n or gpu_27b_windows"
    timeout 280 python3 -m pallas_kernels.bench attention --sections mma_rows --budget-s 260 --trace /tmp/mtrace \
      --json "$out/attention_mma_rows.json" 2>&1 | tee "$out/attention_mma_rows.log" | grep -E "^copy|FAILED" ; \
      grep -A12 "^### mma_rows" "$out/attention_mma_rows.log" ;;
  ninety-seventh)
    # Session 24 at 4106ede (16-row windows as two CTAs of 48 rows), last ~3 min of device time: the window's pass 1 with the packed rows as the MMAs' N (mma_rows
    # "n", prepared): its gpu test (compiled: right, the step's bits, row bits across its two CTAs), then its time
    # against "m" at the 1-stream 4K and 32K decodes and 16-row windows, as far as the budget reaches.
    gpu_pytest 110 mma_n 6 tests/test_attention_window_mgpu.py -k "mma_n or gpu_27b_windows"
    timeout 150 python3 -m pallas_kernels.bench attention --sections mma_rows --budget-s 130 --trace /tmp/mtrace \
      --json "$out/attention_mma_rows.json" 2>&1 | tee "$out/attention_mma_rows.log" | grep -E "^copy|FAILED" ; \
      grep -A12 "^### mma_rows" "$out/attention_mma_rows.log" ;;
  ninety-sixth)
    # Session 24, ~3 min: probes for the two ways on for the window's pass 1 (docs/kernels/attention.md, run 17):
    # a merge at the end of pass 1 on global semaphores, and the MMA operands swapped for few rows.
    timeout 150 python3 tools/gpu/tail_probe.py 2>&1 | tee "$out/tail_probe.log" | tail -4
    timeout 60 python3 tools/gpu/tail_probe.py --groups 64 --chunks 128 --rows 96 --calls 50 2>&1 \
      | tee -a "$out/tail_probe.log" | tail -4
    timeout 100 python3 tools/gpu/swap_probe.py 2>&1 | tee "$out/swap_probe.log" | tail -6 ;;
  ninety-fifth)
    # Session 24, last call (~9 min): the engine's gates at the [M, 1] column folds (same bits claimed), then the
    # 27B engine bench at the shipped defaults (bf16 KV).
    gpu_pytest 240 engine 10 tests/test_engine_gpu.py
    timeout 200 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
      --no-compile-timing --compile-cache "" 2>&1 | tee "$out/bench_27b.log" | tail -14 ;;
  ninety-fourth)
    # Session 24 (5264c32; 5 min with the start; fold_tickets lost and was removed after it): the fold pass and the
    # merge in one launch by tickets (WindowTiles.fold_tickets) beside
    # the shipped rule and the loop merge at every decode case that runs a fold pass, and beside the fused merge at
    # the 1-stream bf16 32K decode; then its bits compiled (fold pass and fused-merge gpu tests) and the window gpu
    # tests. The summary's last column is every device event of a call (the tickets' memset shows there).
    timeout 280 python3 -m pallas_kernels.bench attention --sections merge_loads --budget-s 250 --trace /tmp/strace \
      --json "$out/attention_fold_tickets.json" 2>&1 | tee "$out/attention_fold_tickets.log" | grep -E "^copy|^  FAILED" ; \
      grep -A40 "^### decode_sweep" "$out/attention_fold_tickets.log"
    gpu_pytest 220 window 14 tests/test_attention.py -k "fold_in_merge or fold_pass_gpu or window_gpu" ;;
  ninety-third)
    # Prepared in session 23, run in session 24 (~7 min with the start): the fused merge with the groups side by
    # side (merge_loads "groups") against the early merge, then the window gpu tests. It lost (5.9 against 5.1 µs)
    # and was removed; the run also timed the [M, 1] column folds (the fold pass 5.2 -> 3.1 µs).
    timeout 260 python3 -m pallas_kernels.bench attention --sections merge_loads --budget-s 240 --trace /tmp/strace \
      --json "$out/attention_merge_groups.json" 2>&1 | tee "$out/attention_merge_groups.log" | grep -E "^copy|^  FAILED" ; \
      grep -A40 "^### decode_sweep" "$out/attention_merge_groups.log"
    gpu_pytest 200 window 14 tests/test_attention.py -k "fold_in_merge or fold_pass_gpu or window_gpu or tickets_gpu" ;;
  ninety-second)
    # Session 23, the last ~3 min of device time: Nsight Compute on the early merge of the 1-stream bf16 32K decode
    # (the fused 32-chunk merge, 4.7-5.1 µs, ~2.5 µs over a one-partial merge that neither its instructions nor its
    # round trips explain): where its warps stall, by reason and by source line.
    timeout -s INT 150 ncu --profile-from-start off --clock-control none --kernel-name regex:"attn_window_merge" \
      --section SpeedOfLight --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis --section SourceCounters --section InstructionStats \
      --export "$out/merge" python3 tools/gpu/kernel_ncu.py --cases attn_decode_32k > "$out/ncu_run.log" 2>&1
    tail -4 "$out/ncu_run.log"
    ncu --import "$out/merge.ncu-rep" --page details > "$out/merge.txt" 2>&1
    ncu --import "$out/merge.ncu-rep" --page source --csv > "$out/merge_source.csv" 2>&1
    grep -iE "Duration|Stall|Warp Cycles|Issue Slots|Executed Instructions|L2 Hit|Mem.*Busy|Registers|Grid Size|Block Size" \
      "$out/merge.txt" | cut -c1-150 | head -60 ;;
  ninety-first)
    # Session 23, ~9 min: ninetieth again after the early merge's rework (partial weights by exp2, per-row values
    # as columns, the window dot's conversions held behind every load): its time against the loop merge, its bits
    # compiled, and the engine's gates (the weights' exp2 changes every merge's bits, the same way in every path).
    bash "$0" ninetieth ;;
  ninetieth)
    # Session 23, ~10 min: the merge's early loads (WindowTiles.merge_loads, a launch choice): 1-row decode, kernels
    # alone, early against loop at every context and pool, launches of the early merge at 32K; then its bits against
    # the loop merge compiled, the window gpu tests, and the engine's gates on the new default.
    timeout 260 python3 -m pallas_kernels.bench attention --sections merge_loads --budget-s 240 --trace /tmp/strace \
      --json "$out/attention_merge_loads.json" 2>&1 | tee "$out/attention_merge_loads.log" | grep -E "^copy|^  FAILED" ; \
      grep -A40 "^### decode_sweep" "$out/attention_merge_loads.log"
    gpu_pytest 200 window 14 tests/test_attention.py -k "fold_in_merge or fold_pass_gpu or window_gpu or tickets_gpu"
    gpu_pytest 240 engine 10 tests/test_engine_gpu.py ;;
  eighty-ninth)
    # Session 22, ~8 min: the merge folding the chunk groups itself (a launch choice: its bits against the fold
    # pass and merge, compiled), the engine's gates on the new defaults, then decode_sweep (the tail's launch
    # choices at 1 stream, kernels alone). Run at d78938a, whose merge also loaded every partial at once where they
    # fit (removed in 114219b; its gpu test cases went with it).
    gpu_pytest 150 fold_in_merge 8 tests/test_attention.py -k "fold_in_merge or fold_pass_gpu"
    gpu_pytest 240 engine 10 tests/test_engine_gpu.py
    timeout 200 python3 -m pallas_kernels.bench attention --sections decode_sweep --budget-s 180 --trace /tmp/strace \
      --json "$out/attention_tails.json" 2>&1 | tee "$out/attention_tails.log" | grep -E "^copy|^  FAILED" ; \
      grep -A40 "^### decode_sweep" "$out/attention_tails.log" ;;
  eighty-eighth)
    # Session 22, ~6 min: the fp8 1-row decode's tile candidates and the shipped decode at every context (kernels
    # alone, by kernel, % against the traced copy; at 689943d these were one section, decode_sweep, which now times
    # the tail's launch choices), then Nsight Compute on the 32K decode's launches, bf16 (Mosaic GPU pass 1) and
    # fp8 (Triton pass 1), as the engine's tiles run them.
    timeout 330 python3 -m pallas_kernels.bench attention --sections fp8_tiles_sweep,decode_sweep --budget-s 300 \
      --trace /tmp/strace \
      --json "$out/attention_sweep.json" 2>&1 | tee "$out/attention_sweep.log" | grep -E "^copy|^  FAILED" ; \
      grep -A45 "^### decode_sweep" "$out/attention_sweep.log"
    NCU_CASES=attn_decode_32k,attn_decode_32k_fp8 bash "$0" ncu ;;
  eighty-sixth)
    # Session 21, ~8 min: f16 window dots normalise P·vs by the row's max over the keys it sees (session 20's fp8
    # gate failure: a block max over stale slots). The fp8 engine gate with f16 dots, the f16 window gpu tests,
    # then window_fp8: the Triton pass 1 with bf16 and with f16 dots against the Mosaic GPU one (8-bit layout).
    fp8_gate_with_dots float16 150 f16dots
    gpu_pytest 100 window_f16 4 tests/test_attention.py -k "window_gpu_27b and f16"
    timeout 300 python3 -m pallas_kernels.bench attention --sections window_fp8 --budget-s 280 --trace /tmp/ftrace \
      --json "$out/attention_fp8.json" 2>&1 | tee "$out/attention_fp8.log" | grep -A10 "^### window_fp8" ;;
  eighty-fourth)
    # Session 21, ~7 min: fp8 pools' prompt chunks on the Mosaic GPU kernel (dequantizing gather): its gpu tests,
    # the fp8 window gpu tests (bf16 window dots, the 8-bit dequantization layout's bits), the engine's gates.
    gpu_pytest 170 prompt_fp8 4 tests/test_attention_mgpu.py -k "fp8"
    gpu_pytest 120 fp8 4 tests/test_attention_window_mgpu.py -k "fp8"
    gpu_pytest 200 engine 9 tests/test_engine_gpu.py ;;
  eighty-fifth)
    # Session 21, ~8 min: prompt chunks (cuDNN, Triton and Mosaic GPU over bf16 and fp8 pools), then eighty-third's
    # fp8 windows (Triton pass 1 against Mosaic GPU in both dequantization layouts), kernels alone.
    timeout 220 python3 -m pallas_kernels.bench attention --sections prompt_mgpu --budget-s 200 \
      --json "$out/attention_prompt.json" 2>&1 | tee "$out/attention_prompt.log" | grep -A12 "^### prompt_mgpu"
    timeout 300 python3 -m pallas_kernels.bench attention --sections window_fp8 --budget-s 280 --trace /tmp/ftrace \
      --json "$out/attention_fp8.json" 2>&1 | tee "$out/attention_fp8.log" | grep -A10 "^### window_fp8" ;;
  eighty-third)
    # Prepared in session 20 (not run), ~7 min: fp8 pools at today's tiles (bf16 window dots since 8069675): the fp8
    # window gpu tests (the 8-bit dequantization layout's bits among them) and the engine's gates, then the Triton
    # pass 1 against the Mosaic GPU one in both dequantization layouts, kernels alone.
    gpu_pytest 120 fp8 4 tests/test_attention_window_mgpu.py -k "fp8"
    gpu_pytest 170 engine 9 tests/test_engine_gpu.py
    timeout 280 python3 -m pallas_kernels.bench attention --sections window_fp8 --budget-s 260 --trace /tmp/ftrace \
      --json "$out/attention_fp8.json" 2>&1 | tee "$out/attention_fp8.log" | grep -A10 "^### window_fp8" ;;
  eighty-second)
    # Session 20, the last ~2 min: eighty-first's fp8 engine gate failed (concurrent != solo at the first decode
    # step, fp8 pools on the shipped Triton pass 1 with f16 window dots); the same gate with bf16 window dots.
    fp8_gate_with_dots bfloat16 120 bf16dots ;;
  eighty-first)
    # Session 20, last call (~4 min): the fp8 window gpu test (the step against row 0 with bf16 merge dots; f16 ones
    # differed in eightieth), then the engine's gates with the new fp8-pool one.
    gpu_pytest 90 fp8 4 tests/test_attention_window_mgpu.py -k "fp8"
    gpu_pytest 170 engine 9 tests/test_engine_gpu.py ;;
  eightieth)
    # Session 20, ~6 min: fp8 pools on the Mosaic GPU pass 1 (codes dequantized to bf16 in shared memory): its gpu
    # test (partials = the bf16 pass over the dequantized pool, bit for bit), then the shipped Triton pass 1 against
    # it, 1- and 16-row windows, kernels alone.
    gpu_pytest 150 fp8 6 tests/test_attention_window_mgpu.py -k "fp8 or bf16_partials"
    timeout 300 python3 -m pallas_kernels.bench attention --sections window_fp8 --budget-s 280 --trace /tmp/ftrace \
      --json "$out/attention_fp8.json" 2>&1 | tee "$out/attention_fp8.log" | grep -A10 "^### window_fp8" ;;
  seventy-ninth)
    # Session 20, ~6 min: the window's fp32 / bf16 partials again, with every kernel of a call traced (busy) and the
    # call's span (gaps included) beside its attention kernels alone, where the chained figures of seventy-eighth
    # read 43-75 µs a call above the kernels; then the 27B engine bench at the shipped defaults.
    timeout 300 python3 -m pallas_kernels.bench attention --sections window_partials --budget-s 280 --trace /tmp/ptrace \
      --json "$out/attention_partials.json" 2>&1 | tee "$out/attention_partials.log" | grep -A10 "^### window_partials"
    python3 -c "
import json
for r in json.load(open('$out/attention_partials.json')):
    if r.get('impl') == 'kernel':
        print(r['tag'], r['streams'], r['rows'], r['context'], 'chained %.1f kernels %.1f busy %.1f span %.1f' % (
            r['us'], r.get('alone_us', -1), r.get('traced_busy_us', -1), r.get('traced_span_us', -1)))"
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  seventy-eighth)
    # Session 20, ~9 min: bf16 partials shipped (awm.PARTIALS): the attention and window gpu tests, the engine's
    # gates, then issue #5's decode and window tables at the shipped tiles, kernels alone, beside cuDNN and the
    # plain-XLA reference.
    gpu_pytest 170 attention 6 tests/test_attention_window_mgpu.py tests/test_attention.py tests/test_kv_quant.py
    gpu_pytest 150 engine 8 tests/test_engine_gpu.py
    timeout 250 python3 -m pallas_kernels.bench attention --sections decode,window,xla --budget-s 230 --trace /tmp/atrace \
      --json "$out/attention_shipped.json" 2>&1 | tee "$out/attention_shipped.log" | sed -n '/^### /,$p' | head -60 ;;
  seventy-seventh)
    # Session 20, ~7 min: the window's O partials in bf16 (WindowTiles.partials): its gpu tests (bf16 partials are
    # the fp32 ones rounded, at the 27B shape) and the shipped window tests, then fp32 against bf16 partials at
    # 1- and 16-row windows, kernels alone (the two windows that missed 1.3x first).
    timeout -s INT 200 python3 -m pytest -m gpu -q -x tests/test_attention_window_mgpu.py 2>&1 \
      | tee "$out/window_tests.log" | tail -4
    timeout 330 python3 -m pallas_kernels.bench attention --sections window_partials --budget-s 300 --trace /tmp/ptrace \
      --json "$out/attention_partials.json" 2>&1 | tee "$out/attention_partials.log" | grep -A10 "^### window_partials" ;;
  seventy-sixth)
    # Session 19, ~5 min: the GDN prompt pass at today's tiles beside fla's chunk_gated_delta_rule (carry .whl),
    # T = 1K/4K/16K/64K, the 27B's heads (first measured side by side in session 11).
    # (the shipped bf16 tiles named: before a1aeec9, --no-sweep timed PromptTiles(), the tf32 ones)
    JAX_PLATFORMS=cuda timeout 450 python3 -m pallas_kernels.bench gdn --t 4096,1024,16384,65536 --skip verify,conv,step \
      --prompt-tiles "block_v=32,num_warps=4,precision=bf16,store_dtype=bfloat16,transposed=1,fused_output=1" \
      --iters 20 > "$out/gdn_prompt.log" 2>&1
    tail -40 "$out/gdn_prompt.log" ;;
  seventy-second)
    # Session 18, last ~5 min: the 27B decode round at today's defaults, traced launch by launch at 1 and 16 streams
    # (1K context), with the compiled HLO and the events in order ($out/round_S.events.tsv, .hlo.txt) for the
    # per-layer launch list.
    for s in 1 16; do
      timeout 130 python3 tools/gpu/decode_profile.py --synthetic 27b --streams $s --rounds 32 --trace /tmp/trace_$s \
        --profiled 0 --dump "$out/round_$s" 2>&1 | tee "$out/profile_$s.txt" | grep -E "round|busy|fusions" | head -8
      gzip -f "$out/round_$s.hlo.txt"
    done ;;
  seventy-first)
    # Session 18: GDN verify windows and commits at 1/4/16 rows x 16/4/1 streams, also timed from a profiler trace
    # (the kernels alone: the chained figures overlap or carry launch gaps), beside fla's fused_recurrent (carry
    # .whl). ~3 min.
    JAX_PLATFORMS=cuda timeout 300 python3 -m pallas_kernels.bench gdn --skip prompt,conv,step --no-sweep --iters 20 \
      --trace /tmp/gtrace --json "$out/gdn_verify.json" > "$out/gdn_verify.log" 2>&1
    grep -E "^copy|^fla" "$out/gdn_verify.log"; sed -n '/^Verify window/,$p' "$out/gdn_verify.log" | head -60 ;;
  seventieth)
    # Session 18: the 16-row window's tail (fold pass, merge) under its launch choices (warps, unroll, the fold's
    # head-dim columns; same bits) at the two windows that miss 1.3x (1 stream at 128K, 16 streams at 4K), kernels
    # alone, then the window gpu tests (bits of the launch choices). ~5 min.
    timeout 330 python3 -m pallas_kernels.bench attention --sections merge_variants --budget-s 300 --trace /tmp/mtrace \
      --json "$out/attention_merge.json" 2>&1 | tee "$out/attention_merge.log" | grep -A14 "^### merge_variants" ;;
  sixty-eighth|sixty-ninth)
    # Session 18: issue #3's table at the shipped kernels (qmm() as the model calls it: the Mosaic GPU decode kernel
    # up to 256 rows, the prompt path from 64), each jax call also timed from a profiler trace (busy time a call),
    # beside the XLA dequant + matmul (M <= 16), a bf16 matmul and torch's int4; sixty-eighth the three largest
    # projections, sixty-ninth the other four (lm_head among them). ~5 min each.
    if [ "$stage" = sixty-eighth ]; then shapes=5120x17408,17408x5120,5120x12288; else
      shapes=5120x10240,5120x6144,6144x5120,5120x248320; fi
    timeout 560 python3 -m pallas_kernels.bench qmm --shapes "$shapes" --m 1,4,16,64,256,1024,4096 --ref-max-m 16 \
      --trace /tmp/qtrace --json "$out/qmm_$stage.json" > "$out/qmm_$stage.log" 2>&1
    grep -vE "^  [0-9]+->" "$out/qmm_$stage.log" | grep -v "^WARNING" | tail -45 ;;
  sixty-seventh)
    # Session 18 (run at bae187f, the cluster fold's code since removed): tools/gpu/cluster_probe.py, clusters
    # of 2 / 4 / 8 CTAs exchanging fp32 tiles through distributed shared memory, bits against numpy's ordered sum.
    timeout 150 python3 tools/gpu/cluster_probe.py 2>&1 | tee "$out/cluster_probe.log" | grep -E "^cluster" ;;
  sixty-sixth)
    # Session 17, the last ~5 min of device time: the merge's head-dim columns a program (merge_block_d, a launch
    # choice) for 16-row bf16 windows at the two windows sixty-third missed 1.3x on (1 stream 128K, 16 streams 4K),
    # then 1 stream at 32K and 4K; kernels alone.
    timeout 290 python3 -m pallas_kernels.bench attention --sections merge_variants --budget-s 260 --trace /tmp/mtrace \
      --json "$out/attention_merge.json" 2>&1 | tee "$out/attention_merge.log" | grep -A8 "^### merge_variants" ;;
  sixty-fifth)
    # Session 17, last call (~7 min): sixty-fourth's in-process A/B was noise (32 rounds; one stream at 73-91
    # forwards/s against the bench's 123); here the bench itself, a process a run, 128 rounds, the window's pass 1
    # at 512 / 1024-key chunks alternating, 1K cached tokens, 1 and 16 streams.
    for c in 512 1024 512 1024; do
      echo "== chunk $c"
      timeout 115 python3 -c "import runpy, sys; from pallas_kernels import attention_window_mgpu as awm; \
awm.CHUNK = $c; sys.argv = ['qwen_jax', 'bench', '--synthetic', '27b', '--streams', '1,16', '--prompt-lengths', '', \
'--rounds', '128', '--no-compile-timing']; runpy.run_module('qwen_jax', run_name='__main__')" 2>&1 \
        | tee "$out/bench_chunk_$c.log" | grep -E "^decode " | tail -2
    done ;;
  sixty-fourth)
    # Session 17, third call (~6 min): the engine's decode with the window's pass 1 at 256 / 512 / 1024-key chunks
    # (sixty-third's bench put one stream at 1K at 123.2 forwards/s after the move to 1024, session 15 127.1), at
    # 1K and 8K cached tokens, 1 and 16 streams, one process.
    timeout 480 python3 tools/gpu/engine_ab.py --streams 1,16 --context 1024,8192 --rounds 32 \
      --variants "chunk=512;chunk=1024;chunk=256" 2>&1 | tee "$out/engine_ab_chunk.log" | grep -vE "^\[|Warn|warn" \
      | tail -14 ;;
  sixty-third)
    # Session 17, second call (~8.5 min): the window's Mosaic GPU pass 1 at 1024-key chunks with rows split on small
    # grids (the new defaults, from sixty-second's table): its gpu tests, the window_mgpu table (Triton beside
    # Mosaic GPU pass 1, kernels alone), the engine's gates, the 27B bench.
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention_window_mgpu.py \
      > "$out/gpu_tests_window_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_window_mgpu.log" | cut -c1-200 | tail -8
    timeout 160 python3 -m pallas_kernels.bench attention --sections window_mgpu --budget-s 140 --trace /tmp/wtrace \
      --json "$out/attention_window_mgpu.json" 2>&1 | tee "$out/attention_window_mgpu.log" \
      | grep -A12 "^### window_mgpu"
    timeout -s INT 140 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -8
    timeout 140 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  sixty-second)
    # Session 16 (prepared, not run: the session had no device time). The window's Mosaic GPU pass 1 storing its
    # partials from one warpgroup (real rows rounded up to 8: the new default), each warpgroup's rows in a CTA of
    # their own (row_block 64), the two warpgroups taking turns (PING_PONG), chunks 512 / 1024 / 2048: its gpu tests
    # first (the default store path has not run on the device yet), then every variant's kernels alone (trace),
    # ~9 min. Pick from the table: the chunk (order: window_tiles for bf16 pools), split/ping-pong (launch).
    timeout -s INT 170 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention_window_mgpu.py \
      > "$out/gpu_tests_window_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_window_mgpu.log" | cut -c1-200 | tail -10
    timeout 390 python3 -m pallas_kernels.bench attention --sections window_mgpu_variants --budget-s 370 \
      --trace /tmp/wtrace --json "$out/attention_wmv.json" 2>&1 | tee "$out/attention_wmv.log" \
      | grep -A30 "^### window_mgpu_variants" ;;
  sixty-first)
    # Session 15, last call (~8 min): the Mosaic GPU kernels through the shared lowering cache (mgpu_lowering: the
    # decode qmm, the prompt attention, the window pass 1): their gpu tests and the engine's gates; the window bench
    # with each call's kernels timed alone (trace); the 27B bench (warm compile with the cache).
    timeout -s INT 170 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention_window_mgpu.py \
      tests/test_attention_mgpu.py tests/test_qmm_mgpu.py -k "window or 27b or (matches_oracle and words)" \
      > "$out/gpu_tests_cached.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_cached.log" | cut -c1-200 | tail -14
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -8
    timeout 170 python3 -m pallas_kernels.bench attention --sections window_mgpu --budget-s 150 --trace /tmp/wtrace \
      --json "$out/attention_window_mgpu_alone.json" 2>&1 | tee "$out/attention_window_mgpu_alone.log" \
      | grep -A12 "^### window_mgpu"
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  sixtieth)
    # Session 15, third call (~8 min): the Mosaic GPU window pass 1 writing 8 rows, not 16, with one warpgroup:
    # its gpu tests, the window_mgpu bench again, then the 27B bench at this session's defaults (3 compute
    # warpgroups in the decode qmm, the Mosaic GPU prompt attention and window pass 1).
    timeout -s INT 100 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention_window_mgpu.py \
      > "$out/gpu_tests_window_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_window_mgpu.log" | cut -c1-200 | tail -8
    timeout 150 python3 -m pallas_kernels.bench attention --sections window_mgpu --budget-s 130 \
      --json "$out/attention_window_mgpu.json" 2>&1 | tee "$out/attention_window_mgpu.log" | grep -A12 "^### window_mgpu"
    timeout 300 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  fifty-ninth)
    # Session 15, second call (~8 min): the Mosaic GPU window pass 1 (attention_window_mgpu): its gpu tests, the
    # bench beside the Triton pass 1 (1- and 16-row bf16 windows, 1 stream at 4K / 32K / 128K, 16 streams at 4K /
    # 32K), the engine's gates with it as the GPU default (attention.WINDOW_IMPL "auto"), the one-stream round.
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention_window_mgpu.py \
      > "$out/gpu_tests_window_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_window_mgpu.log" | cut -c1-200 | tail -8
    timeout 200 python3 -m pallas_kernels.bench attention --sections window_mgpu --budget-s 180 \
      --json "$out/attention_window_mgpu.json" 2>&1 | tee "$out/attention_window_mgpu.log" | grep -A12 "^### window_mgpu"
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10
    timeout 80 python3 tools/gpu/decode_profile.py --synthetic 27b --rounds 32 --trace "$out/trace_1" --profiled 0 \
      2>&1 | tee "$out/profile_1.txt" | grep -E "round|busy|kernel_mosaic|attn|compiled" | head -16
    rm -rf "$out/trace_1" ;;
  fifty-eighth)
    # (Run once in session 15, first call; ACCUMULATE "direct" and mgpu_probe --accumulate were removed after it:
    # no gain.) The decode qmm with "direct" accumulation (one accumulator across the steps,
    # a step's MMAs in flight while the next step converts) against "fresh", the kernel alone; its device tests;
    # then the engine's gates and the one-stream round's busy time with the conv without transpose or concatenation
    # and the norms' weights read before the sum.
    for a in fresh direct; do
      timeout 100 python3 tools/gpu/mgpu_probe.py --accumulate $a --trace /tmp/probe_trace \
        --shapes 5120x34816,17408x5120,6144x5120,5120x16480 --probes words 2>&1 \
        | tee "$out/probe_acc_$a.log" | grep -vE "^\[|Warning|warn"
    done
    timeout -s INT 130 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      tests/test_rownorm.py tests/test_gdn.py -k "direct or rownorm or gpu_conv" > "$out/gpu_tests_direct.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_direct.log" | cut -c1-200 | tail -12
    timeout -s INT 140 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10
    timeout 75 python3 tools/gpu/decode_profile.py --synthetic 27b --rounds 32 --trace "$out/trace_1" --profiled 0 \
      2>&1 | tee "$out/profile_1.txt" | grep -E "round|busy|kernel_mosaic|rownorm|fusion" | head -24
    rm -rf "$out/trace_1" ;;
  fifty-seventh)
    # Session 15, first call (~8 min): can the Mosaic GPU decode qmm carry prompt rows (pieces of 128 / 256 rows,
    # 2 or 3 compute warpgroups) against the shipped prompt path (dequantization pass + Triton matmul) and cuBLAS at
    # M = 1024 on the shapes that miss the 70 % target; then fifty-sixth's 27B bench at session 14's defaults.
    timeout 230 python3 tools/gpu/prompt_probe.py --m 1024 2>&1 | tee "$out/prompt_probe.log" | grep -vE "^\[|Warn|warn"
    timeout 300 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  fifty-sixth)
    # Prepared in session 14, not yet run: the 27B bench at session 14's defaults (3 compute warpgroups in the decode
    # qmm, the Mosaic GPU prompt attention), prompt 4K and 32K, decode at 1 / 16 / 64 streams, and the qmm table.
    timeout 300 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6
    timeout 250 python3 -m pallas_kernels.bench qmm --m 1,16,64,256 --json "$out/qmm_table7.json" 2>&1 \
      | tee "$out/qmm_table7.log" | grep -vE "^\[" | tail -36 ;;
  fifty-fifth)
    # Session 14, last call (~5.5 min): the prompt kernel's 2K-prefix device test (cut off in fifty-fourth), the
    # engine's gates with the Mosaic GPU prompt kernel as the default on a GPU, then the one-stream decode round
    # (trace: busy time) with 3 and with 2 compute warpgroups.
    timeout -s INT 80 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention_mgpu.py \
      -k "4k_chunk and 2048" > "$out/gpu_tests_attn_2048.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_attn_2048.log" | cut -c1-200 | tail -6
    timeout -s INT 130 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine_mgpu_prompt.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine_mgpu_prompt.log" | cut -c1-160 | tail -10
    for w in 3 2; do
      timeout 75 python3 tools/gpu/decode_profile.py --synthetic 27b --mgpu-compute-wgs $w --rounds 32 \
        --trace "$out/trace_$w" --profiled 0 2>&1 | tee "$out/profile_wgs_$w.txt" \
        | grep -E "compute warpgroups|round|busy|kernel_mosaic" | head -8
      rm -rf "$out/trace_$w"
    done ;;
  fifty-fourth)
    # Session 14, last call (~9.5 min): 3 compute warpgroups a CTA (the new default): the kernel's oracle, stage and
    # piece tests and the engine's gates on the device, then the 27B decode with 3 and 2 alternated in one process;
    # then the Mosaic GPU prompt-chunk attention kernel's device tests and its bench beside cuDNN and the Triton one.
    timeout -s INT 100 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      -k "(oracle and words and (6144 or 392 or 16480)) or stage_counts or (wide and 17408)" \
      > "$out/gpu_tests_wgs3.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_wgs3.log" | cut -c1-160 | tail -12
    timeout -s INT 110 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10
    timeout 170 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 --variants "wgs=3;wgs=2;wgs=3" 2>&1 \
      | tee "$out/engine_ab_wgs.log" | grep -vE "^\[|Warning|warn" | tail -8
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention_mgpu.py \
      > "$out/gpu_tests_attn_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_attn_mgpu.log" | cut -c1-200 | tail -12
    timeout 90 python3 -m pallas_kernels.bench attention --sections prompt_mgpu 2>&1 \
      | tee "$out/bench_attn_mgpu.log" | grep -vE "^\[|Warning|warn" | tail -14 ;;
  fifty-first)
    # Session 14, fourth call (~3 min): more compute warpgroups a CTA (the kernel alone: copies take 27 of the
    # 38 us at 5120->34816, so the conversion's warps are the limit), 2 / 3 / 4 warpgroups of 64 features.
    for w in 2 3 4; do
      timeout 150 python3 tools/gpu/mgpu_probe.py --compute-wgs $w --trace /tmp/probe_trace \
        --shapes 5120x34816,17408x5120,6144x5120,5120x16480 --probes words,tiles,tiles_no_compute 2>&1 \
        | tee "$out/probe_wgs_$w.log" | grep -vE "^\[|Warning|warn"
    done ;;
  fiftieth)
    # Session 14, third call (~4 min): the kernel alone (profiler durations) at 16 and 8 rows, with and without
    # compute, in both layouts: is x's traffic or the copies' count the limit? (The "no_x" probe, x's block fixed,
    # failed to lower: a pipelined input must depend on the grid; removed after this run.)
    for r in 16 8; do
      timeout 200 python3 tools/gpu/mgpu_probe.py --rows $r --trace /tmp/probe_trace \
        --shapes 5120x34816,17408x5120,6144x5120 \
        --probes words,tiles,words_no_compute,tiles_no_compute 2>&1 \
        | tee "$out/probe_rows_$r.log" | grep -vE "^\[|Warning|warn"
    done ;;
  forty-ninth)
    # Session 14, second call (~3 min): the 27B decode round's device events in order and its compiled HLO, at 1
    # and 16 streams, to read which launches a layer makes and what each costs.
    for s in 1 16; do
      timeout 200 python3 tools/gpu/decode_profile.py --synthetic 27b --streams $s --rounds 32 --trace "$out/trace_$s" \
        --profiled 0 --dump "$out/decode_$s" 2>&1 | tee "$out/profile_$s.txt" | grep -vE "^\[|Warning|warn" | head -40
      rm -rf "$out/trace_$s"
    done ;;
  forty-eighth)
    # Session 14, first call (~4 min): the "tiles" layout (each step's weight block one contiguous 16 KB, scale and
    # bias rows one 1 KB block) against the weight's own rows: the probe with and without compute, at 4 and 8
    # stages, then the layout's same-bits tests on the device.
    for st in 4 8; do
      timeout 150 python3 tools/gpu/mgpu_probe.py --stages $st --shapes 5120x34816,17408x5120,5120x6144,6144x5120 \
        --probes words,tiles,words_no_compute,tiles_no_compute,words,tiles 2>&1 | tee "$out/probe_tiles_$st.log" \
        | grep -vE "^\[|Warning|warn"
    done
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      -k "tiles" > "$out/gpu_tests_tiles.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_tiles.log" | cut -c1-160 | tail -12 ;;
  forty-seventh)
    # Session 13, last call (~6 min): the issue's qmm table at all seven shapes, `qmm()` end to end (the Mosaic GPU
    # decode kernel, words conversion, wide pieces) for every decode row beside the Triton tiles, XLA, bf16, torch.
    timeout 330 python3 -m pallas_kernels.bench qmm --m 1,16,64,256 --json "$out/qmm_table7.json" 2>&1 \
      | tee "$out/qmm_table7.log" | grep -vE "^\[" | tail -36 ;;
  forty-fifth)
    # Session 13, fourth call (~7 min): lane-ordered words replace the natural ones (no second copy): the prompt
    # path's dequantization pass reads them (its gpu test against the natural words, the dequant tests), the
    # words kernel's oracle at two shapes, the engine's gates, then the 27B bench (prompt and decode) at the defaults.
    timeout -s INT 240 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      tests/test_qmm.py -k "lane_order or rounds_once or dequant or (oracle and words and (6144 or 392))" \
      > "$out/gpu_tests_lanes.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_lanes.log" | cut -c1-160 | tail -20
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10
    timeout 240 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  forty-sixth)
    # Session 13, fifth call (~4 min): the issue's qmm table at the decode rows for the four decode shapes, the
    # words kernel beside XLA, the bf16 matmul and torch's int4 matmul.
    timeout 280 python3 -m pallas_kernels.bench qmm --shapes 5120x17408,17408x5120,5120x6144,6144x5120 \
      --m 1,4,16,64,256 --json "$out/qmm_table.json" 2>&1 | tee "$out/qmm_table.log" | grep -vE "^\[" | tail -40 ;;
  forty-fourth)
    # Session 13, third call (~8 min): is the one-stream round host- or device-bound with the words conversion?
    # decode_profile with each conversion, alternated (enqueue onto an idle device, device-bound and pipelined
    # rounds), then the 27B bench at the defaults.
    for c in words nibbles words nibbles; do
      echo "== $c"
      timeout 60 python3 tools/gpu/decode_profile.py --synthetic 27b --rounds 64 --mgpu-conversion $c --profiled 0 \
        2>&1 | grep -E "round|enqueue"
    done
    timeout 300 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  forty-third)
    # Session 13, second call (~8 min): 8-row pieces (half the x bytes a step for calls of up to 8 rows): their
    # bits against 16-row pieces and their depths, the isolated sweep of the kernel's variants at the decode shapes,
    # the engine with the narrowest piece 16 and 8 alternated, and the one-stream round's trace at the defaults.
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      -k "pieces_same_bits or stage_counts" > "$out/gpu_tests_pieces.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_pieces.log" | cut -c1-160 | tail -14
    timeout 200 python3 -m pallas_kernels.bench qmm --sweep --mgpu --max-candidates 1 --m 1,16 \
      --shapes 5120x34816,17408x5120,5120x6144,6144x5120 --json "$out/qmm_sweep.json" > "$out/qmm_sweep.log" 2>&1
    grep -E "mosaic|decode" "$out/qmm_sweep.log" | cut -c1-150 | tail -60
    timeout 130 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 \
      --variants "narrow=16;narrow=8;narrow=16;narrow=8" 2>&1 | tee "$out/engine_ab.log" | tail -7
    timeout 70 python3 tools/gpu/decode_profile.py --synthetic 27b --rounds 32 --trace "$out/trace" --profiled 0 \
      2>&1 | tee "$out/profile.txt" | grep -E "round|busy|fusions|kernel_mosaic|custom" | head -20
    rm -rf "$out/trace" ;;
  forty-second)
    # Session 13, first call (~9 min): the "words" conversion of the Mosaic GPU decode kernel (lane words, 8-byte
    # shared-memory loads, four PTX instructions a weight pair). Its gpu tests (oracle for the three conversions,
    # rounded-once weights, wide pieces and stage counts same bits), the probe at three shapes (words beside the
    # nibbles kernel and its parts), the engine with each conversion alternated, then the engine's gates.
    timeout -s INT 260 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      > "$out/gpu_tests_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_mgpu.log" | cut -c1-160 | tail -40
    timeout 90 python3 tools/gpu/mgpu_probe.py --probes words,full,no_load,no_compute 2>&1 | tee "$out/probe.log"
    timeout 200 python3 tools/gpu/engine_ab.py --streams 1,16 --rounds 32 \
      --variants "conv=words;conv=nibbles;conv=words;conv=nibbles" 2>&1 | tee "$out/engine_ab.log" | tail -8
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10 ;;
  forty-first)
    # Queued for session 13, first call (~9 min): session 12's last change (norms writing the decode qmm's padding)
    # was gated (engine) and profiled but not benched, and the rownorm kernels' own gpu tests did not run with
    # out_rows: those tests, the engine gates, then the bench at the defaults with 64 streams.
    timeout -s INT 240 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_rownorm.py \
      tests/test_engine_gpu.py > "$out/gpu_tests.log" 2>&1
    grep -hE "FAILED|ERROR|^E |passed|failed" "$out/gpu_tests.log" | cut -c1-160 | tail -12
    timeout 240 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6 ;;
  fortieth)
    # Session 12, last call (~2 min): thirty-ninth's pipelined rounds came out against the trace (the first run of a
    # call reads slow), so the two orders alternate here, 64 rounds each, no trace.
    for v in --no-pad-at-norm "" --no-pad-at-norm ""; do
      echo "== ${v:-pad}"
      timeout 45 python3 tools/gpu/decode_profile.py --synthetic 27b --rounds 64 $v --profiled 0 2>&1 | grep -E "round"
    done ;;
  thirty-ninth)
    # Session 12, after thirty-eighth (~3.5 min): the norms feeding a decode qmm write its padded rows
    # (ops.PAD_AT_NORM, one pad launch fewer a projection below 16 rows): the engine's gates (the stream-bucket gate
    # compares padded buckets 1 and 4 with unpadded 16 and 64), then the one-stream round with it and without.
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_pad.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_pad.log" | cut -c1-160 | tail -10
    for v in "" --no-pad-at-norm; do
      echo "== ${v:-pad at norm}"
      timeout 70 python3 tools/gpu/decode_profile.py --synthetic 27b --rounds 32 $v --trace "$out/trace" \
        --profiled 0 2>&1 | tee -a "$out/profile_pad.txt" | grep -E "round|busy|fusions|kernel_mosaic|pad_fusion"
      rm -rf "$out/trace"
    done ;;
  thirty-eighth)
    # Session 12, last call (~5 min): the 27B bench at the new defaults (pieces of up to 64 rows, the output rounding
    # kept by reduce_precision), with 64 streams; then the rounding side by side in one process (the engine's rate).
    timeout 240 python3 -m qwen_jax bench --synthetic 27b --streams 1,16,64 --prompt-lengths 4096,32768 --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -6
    timeout 150 python3 tools/gpu/engine_ab.py --streams 1,16,64 --rounds 64 \
      --variants "round=barrier;round=reduce_precision;round=barrier;round=reduce_precision" 2>&1 \
      | tee "$out/engine_ab.log" | grep -v "^\[" | tail -8 ;;
  thirty-seventh)
    # Session 12, fifth call (~6 min): thirty-sixth found the host's enqueue of a decode call (10.7-12.9 ms, ~1775
    # launches) level with the device's round, so launches are the lever. qmm_mgpu.ROUNDING = "reduce_precision"
    # lets the kernel's epilogue fuse with its consumers: the engine's gates and the kernel's gpu tests with it,
    # then launches / enqueue / device-bound round / traced busy time against "barrier" (1 and 16 streams), then
    # XLA's command buffers with custom calls on top (the enqueue is what they would cut).
    python3 -c "import sys, pytest; from pallas_kernels import qmm_mgpu; qmm_mgpu.ROUNDING = 'reduce_precision'; \
      sys.exit(pytest.main(sys.argv[1:]))" -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      tests/test_qmm_mgpu.py -k "engine or oracle" > "$out/gpu_tests_rp.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_rp.log" | cut -c1-160 | tail -24
    profile_by --mgpu-rounding barrier reduce_precision
    echo "== reduce_precision, 1 stream, command buffers with custom calls"
    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1" \
      timeout 90 python3 tools/gpu/decode_profile.py --synthetic 27b --mgpu-rounding reduce_precision --rounds 32 \
      --profiled 0 2>&1 | tee "$out/profile_cmdbuf.txt" | grep -E "round" ;;
  thirty-sixth)
    # Session 12, fourth call (~4 min): the engine's decode rate swung between ~84 and ~66 forwards/s from one
    # variant to the next in thirty-fifth (one stream), so compare the pipeline depths on device time instead: the
    # device-bound round, the host's enqueue of a call, and the traced qmm time, 4 and 8 stages, 1 and 16 streams.
    profile_by --mgpu-stages 4 8 ;;
  thirty-fifth)
    # Session 12, third call (~7 min): pieces of up to 64 rows (qmm_mgpu.WIDE_ROWS = 64, the piece cut following M)
    # and pipeline depths up to what shared memory holds, through the kernel's gpu tests and the engine's gates
    # (the stream-bucket gate now has a 64-stream bucket: one 64-row piece); then the engine decode side by side:
    # session 11's kernel (4 stages, 16-row pieces) against wide pieces and 6 / 8 stages, at 1, 16 and 64 streams;
    # then the decode round's host/device split again (session 12's second call read 16.8 ms device-bound).
    timeout -s INT 200 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      tests/test_engine_gpu.py > "$out/gpu_tests.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests.log" | cut -c1-160 | tail -30
    timeout 290 python3 tools/gpu/engine_ab.py --streams 1,16,64 --rounds 32 \
      --variants "stages=4,wide=16;stages=4;stages=6;stages=8" 2>&1 | tee "$out/engine_ab.log" | grep -v "^\[" | tail -12
    timeout 80 python3 tools/gpu/decode_profile.py --synthetic 27b --profiled 0 2>&1 | tee "$out/decode_split.txt" \
      | tail -6 ;;
  first)
    # Session 5, call 1: what is unproven on the device (fma_ptx's single rounding, 8-bit prompt tiles, GDN), then
    # the decode switches on isolated kernels and the prompt implementations on isolated kernels.
    timeout -s INT 250 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE --durations=15 \
      "tests/test_qmm.py::test_gpu_dequant_same_weights_as_fused" "tests/test_qmm.py::test_gpu_matches_oracle" \
      tests/test_gdn.py > "$out/gpu_tests_1.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_1.log | cut -c1-160 | tail -40
    timeout 140 python3 -m pallas_kernels.bench qmm --sweep --shapes 5120x34816,17408x5120,5120x6144,6144x5120 \
      --m 1,16 --variants "prefetch=0,lop3=0;fma_ptx=1;fma_ptx=1,block_m=8" --budget-s 110 \
      --json "$out/qmm_ab.json" 2>&1 | tee "$out/qmm_ab.log" | tail -45
    timeout 150 python3 -m pallas_kernels.bench qmm --sweep --prompt-only --prompt-ms 1024,4096 --budget-s 120 \
      --json "$out/qmm_prompt.json" 2>&1 | tee "$out/qmm_prompt.log" | tail -40 ;;
  second)
    # Session 5, call 2: the prompt implementations end to end, and fma_ptx in the whole decode round.
    for impl in fused dequant; do
      timeout 170 python3 -m qwen_jax bench --synthetic 27b --streams "" --prompt-lengths 4096 \
        --no-compile-timing --compile-cache "" --qmm-prompt-impl $impl 2>&1 | tee "$out/prompt_$impl.log" | tail -4
    done
    timeout 230 python3 tools/gpu/launch_probe.py --synthetic 27b --variants default --tiles "fma_ptx=1" 2>&1 \
      | tee "$out/launch_ab.log" | tail -30 ;;
  third)
    # Session 5, call 3: with fma_ptx and the dequant prompt path shipped, the exactness gates that cover them
    # (qmm row invariance / split-K / 27B shapes; engine concurrent == solo), then the engine bench in full.
    timeout -s INT 250 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE --durations=10 \
      tests/test_qmm.py tests/test_engine_gpu.py --deselect tests/test_qmm.py::test_gpu_matches_oracle \
      > "$out/gpu_tests_3.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_3.log | cut -c1-160 | tail -40
    timeout 330 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | tail -25 ;;
  fourth)
    # Session 5, call 4: the Pallas dequantization pass (prompt path): same bits on the device, the kernels, the
    # 27B prompt pass end to end.
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE \
      tests/test_qmm.py -k "dequant_same_weights or dequant_27b" > "$out/gpu_tests_4.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_4.log | cut -c1-160 | tail -20
    timeout 200 python3 -m qwen_jax bench --synthetic 27b --streams "" --prompt-lengths 4096,32768 \
      --no-compile-timing --compile-cache "" 2>&1 | tee "$out/prompt_pass.log" | tail -5
    timeout 150 python3 -m pallas_kernels.bench qmm --sweep --prompt-only --prompt-ms 1024,4096 --budget-s 120 \
      --json "$out/qmm_prompt.json" 2>&1 | tee "$out/qmm_prompt.log" | grep -v "^\[" | tail -60 ;;
  fifth)
    # Session 5, call 5: the 27B prompt pass with the 8-row dequantization pass; the decode round's anatomy with
    # fma_ptx (kernel families from a trace).
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams "" --prompt-lengths 4096 \
      --no-compile-timing --compile-cache "" 2>&1 | tee "$out/prompt_pass.log" | tail -3
    timeout 200 python3 tools/gpu/decode_profile.py --synthetic 27b --trace "$out/trace" --profiled 0 2>&1 \
      | tee "$out/decode_trace.txt" | tail -45 ;;
  sixth)
    # Session 5, call 6: kernel calls shared in lowering (pallas_kernels/calls.py): the engine's gpu tests (pools
    # updated in place, concurrent == solo), then the bench with cold and warm compile.
    timeout -s INT 170 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE tests/test_engine_gpu.py \
      > "$out/gpu_tests_6.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_6.log | cut -c1-160 | tail -20
    timeout 200 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | tail -12 ;;
  mgpu)
    # The experimental Mosaic GPU decode qmm (pallas_kernels/qmm_mgpu.py): probes, the sweep beside the shipped
    # Triton tiles, its gpu tests, the 27B decode round with it.
    timeout 90 python3 tools/gpu/mgpu_probe.py --probes full,unsigned,no_xor,no_affine,no_load,no_compute 2>&1 \
      | tee "$out/mgpu_probe.log" | grep -v "^\[" | tail -20
    timeout 200 python3 -m pallas_kernels.bench qmm --sweep --shapes 5120x34816,17408x5120,5120x6144,6144x5120 \
      --m 1,16 --max-candidates 1 --mgpu --budget-s 170 --json "$out/qmm_mgpu.json" 2>&1 | tee "$out/qmm_mgpu.log" \
      | grep -v "^\[" | grep -E "^decode|^\*|mosaic" | cut -c1-125 | tail -70
    timeout -s INT 100 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE tests/test_qmm_mgpu.py \
      > "$out/gpu_tests_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_mgpu.log | cut -c1-200 | tail -12
    timeout 120 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths "" --rounds 32 \
      --no-compile-timing --compile-cache "" --qmm-decode-impl mgpu 2>&1 | tee "$out/bench_mgpu.log" | tail -2 ;;
  mgpu4)
    # The Mosaic GPU decode qmm (flat schedule, scales transposed at load) in the engine: the decode round, then the
    # engine's exactness gates with it (concurrent == solo, chunk cuts, stream buckets).
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths "" --rounds 32 \
      --no-compile-timing --compile-cache "" --qmm-decode-impl mgpu 2>&1 | tee "$out/bench_mgpu.log" | tail -2
    pytest_mgpu 200 -m gpu -v -p no:cacheprovider --tb=short -rfE tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_engine_mgpu.log | cut -c1-200 | tail -12
    timeout 150 python3 tools/gpu/decode_profile.py --synthetic 27b --qmm-decode-impl mgpu --trace "$out/trace" \
      --profiled 0 2>&1 | tee "$out/decode_trace.txt" | tail -30 ;;
  mgpu5)
    # Is the engine's decode round with the Mosaic GPU qmm host-bound, and do command buffers take its calls?
    # Then the kernel's gpu tests incl. the tiny checkpoint's shapes, and the engine's stream-bucket gate again.
    timeout 200 python3 tools/gpu/launch_probe.py --synthetic 27b --variants default,custom-calls-too \
      --qmm-decode-impl mgpu --timeout 95 2>&1 | tee "$out/launch_mgpu.log" | tail -16
    timeout -s INT 110 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE tests/test_qmm_mgpu.py \
      > "$out/gpu_tests_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E .{0,150}|passed|failed" "$out"/gpu_tests_mgpu.log | cut -c1-160 | tail -12
    pytest_mgpu 90 -m gpu -v -p no:cacheprovider --tb=line -rfE tests/test_engine_gpu.py \
      -k "stream_bucket" > "$out/gpu_tests_bucket.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|passed|failed" "$out"/gpu_tests_bucket.log | cut -c1-160 | tail -4 ;;
  mgpu-bisect)
    # Which Mosaic GPU qmm calls break the engine's stream-bucket gate: the gate with DECODE_IMPL = mgpu and the
    # kernel taking no call (scale layout only), only K = 256 weights, only K = 128 weights (tiny checkpoint).
    for only in none 256 128; do
      timeout -s INT 80 python3 -c "import sys, pytest; from pallas_kernels import qmm, qmm_mgpu; \
        qmm.DECODE_IMPL = 'mgpu'; ok = qmm_mgpu.supports; only = sys.argv[1]; \
        qmm_mgpu.supports = lambda x, w: only != 'none' and w.in_features == int(only) and ok(x, w); \
        sys.exit(pytest.main(sys.argv[2:]))" $only -m gpu -q -p no:cacheprovider --tb=no tests/test_engine_gpu.py \
        -k stream_bucket > "$out/bisect_$only.log" 2>&1
      echo "mgpu only for K=$only: $(grep -hE 'passed|failed' "$out/bisect_$only.log" | tail -1)"
    done ;;
  mgpu-bisect-n)
    # The same gate with the kernel only on the K = 128 weights of one output size N (tiny checkpoint: 768 attention
    # q/k/v, 392 GDN input projection, 512 MLP gate+up and lm_head, 128 GDN output projection).
    for n in 768 392 512 128; do
      timeout -s INT 60 python3 -c "import sys, pytest; from pallas_kernels import qmm, qmm_mgpu; \
        qmm.DECODE_IMPL = 'mgpu'; ok = qmm_mgpu.supports; n = int(sys.argv[1]); \
        qmm_mgpu.supports = lambda x, w: w.in_features == 128 and w.out_features == n and ok(x, w); \
        sys.exit(pytest.main(sys.argv[2:]))" $n -m gpu -q -p no:cacheprovider --tb=no tests/test_engine_gpu.py \
        -k stream_bucket > "$out/bisect_n$n.log" 2>&1
      echo "mgpu only for K=128, N=$n: $(grep -hE 'passed|failed' "$out/bisect_n$n.log" | tail -1)"
    done ;;
  seventh)
    # Session 7, call 1: why the Mosaic GPU qmm's K = 128, N = 512 calls break the stream-bucket gate (each op
    # alone at S = 1 vs 16, repeated, with non-finite other rows; the model's taps), then the attention candidates.
    timeout -s INT 150 python3 tools/gpu/rowinv_probe.py --qmm-decode-impl mgpu --only 128x512 \
      > "$out/rowinv_mgpu_512.log" 2>&1
    grep -vE "^(xla|kernel) " "$out/rowinv_mgpu_512.log" | grep -v Warning | grep -v "res = acc" | tail -22
    timeout 300 python3 -m pallas_kernels.bench attention --sections compare --budget-s 240 \
      --json "$out/attention_compare.json" 2>&1 | tee "$out/attention_compare.log" | tail -60 ;;
  eighth)
    # Session 7, call 2: the Mosaic GPU qmm's stream-bucket gate with its output rounding kept apart
    # (optimization_barrier), the attention fold pass compiled, then the decode candidates again.
    timeout -s INT 150 python3 tools/gpu/rowinv_probe.py --qmm-decode-impl mgpu > "$out/rowinv_mgpu.log" 2>&1
    grep -vE "^(xla|kernel) " "$out/rowinv_mgpu.log" | grep -v Warning | grep -v "res = acc" | tail -22
    pytest_mgpu 120 -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/engine_gpu_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/engine_gpu_mgpu.log" | cut -c1-160 | tail -12
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention.py \
      -k "window_gpu or fold" > "$out/attention_gpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/attention_gpu.log" | cut -c1-160 | tail -12
    timeout 200 python3 -m pallas_kernels.bench attention --sections compare --budget-s 170 \
      --json "$out/attention_compare.json" 2>&1 | tee "$out/attention_compare.log" | grep -A40 "### compare" ;;
  ninth)
    # Session 7, call 3: the new window defaults (flat walk, fold 8, f16 dots for fp8) on the device: gpu tests,
    # then decode at 1/16 streams and 16-row windows; then the stream-bucket gate with the Mosaic GPU qmm.
    timeout -s INT 100 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention.py \
      -k "window_gpu or fold or page_layouts" > "$out/attention_gpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/attention_gpu.log" | cut -c1-160 | tail -12
    timeout 230 python3 -m pallas_kernels.bench attention --sections decode,window --budget-s 200 \
      --json "$out/attention.json" 2>&1 | tee "$out/attention.log" | grep -A30 "^### decode"
    pytest_mgpu 170 -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      -k "stream_bucket or chunk_cuts" > "$out/engine_gpu_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/engine_gpu_mgpu.log" | cut -c1-160 | tail -12 ;;
  tenth)
    # Session 7, call 4: which page walk 16-row windows want; the GDN verify/conv/step tables (never run at S = 1,
    # trees, conv); then as much of the qmm issue table as the call has left (rows written as they come).
    # (Session 7 ran this section as "walks": shipped vs the other walk only; window16 adds the row blocks.)
    attention_window16
    JAX_PLATFORMS=cuda timeout 230 python3 -m pallas_kernels.bench gdn --iters 20 --skip prompt \
      --json "$out/gdn_step.json" > "$out/gdn_verify.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_verify.log" | tail -45
    timeout 170 python3 -m pallas_kernels.bench qmm --shapes 5120x17408,17408x5120,5120x6144,6144x5120,5120x10240,5120x12288,5120x248320 \
      --m 1,4,16,64,256,1024,4096 --json "$out/qmm.json" > "$out/qmm.log" 2>&1
    tail -40 "$out/qmm.log" ;;
  window16)
    # The 16-row window's tile variants alone (row_block 64 / 32 beside the shipped tiles and the other walk).
    attention_window16 ;;
  thirty-third)
    # Queued for session 12, first call (~7 min): the shipped path since session 11's last commits -- the Mosaic GPU
    # decode kernel through its lowering cache (one lowering and one compile a kernel a process; CPU-checked only):
    # the engine's gates and the kernel's gpu tests with it, then the bench's compile times (session 11 without
    # the cache: 33.4 s cold / 33.2 s warm) and decode rate.
    timeout -s INT 250 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      tests/test_qmm_mgpu.py -k "not wide" > "$out/gpu_tests_cache.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_cache.log" | cut -c1-160 | tail -20
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096 --rounds 16 2>&1 \
      | tee "$out/bench_27b.log" | grep -E "^compile|^prompt |^decode " | tail -5 ;;
  thirty-fourth)
    # Queued for session 12, second call (~8 min): wide pieces for the Mosaic GPU decode kernel (qmm_mgpu.WIDE_ROWS,
    # off): a row's bits in 16-, 32- and 64-row pieces, then verify-sized M beside the Triton tiles (pieces of 16
    # re-read the weight every 16 rows), then the round's anatomy at the defaults: where the non-qmm time goes now.
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py -k wide \
      > "$out/gpu_tests_wide.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_wide.log" | cut -c1-160 | tail -10
    timeout 200 python3 -m pallas_kernels.bench qmm --sweep --shapes 5120x17408,17408x5120 --m 16,64,256 \
      --max-candidates 1 --mgpu --budget-s 170 --json "$out/qmm_wide.json" 2>&1 | tee "$out/qmm_wide.log" \
      | grep -v "^\[" | grep -E "^decode|^\*|stages=4,block_groups=4,pre=True" | cut -c1-140 | tail -40
    timeout 150 python3 tools/gpu/decode_profile.py --synthetic 27b --trace "$out/trace" --profiled 0 2>&1 \
      | tee "$out/decode_trace.txt" | tail -30 ;;
  thirty-second)
    # Session 11: the Mosaic GPU decode kernel with its index maps on lax.div / lax.rem: its gpu tests and the
    # engine's stream-bucket gate (the default decode kernel on a GPU).
    timeout -s INT 70 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      -k "5120-6144 or 128-512 or 17408" 2>&1 | tail -3
    timeout -s INT 100 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      -k "stream_bucket" 2>&1 | tail -3 ;;
  thirty-first)
    # Session 11: the shipped decode kernel is the Mosaic GPU one now; its isolated speed (% of copy) on the issue's
    # decode shapes beside the Triton tiles, at M = 1 and 16, with its variants.
    timeout 200 python3 -m pallas_kernels.bench qmm --sweep --shapes 5120x17408,17408x5120,5120x6144,6144x5120 \
      --m 1,16 --max-candidates 1 --mgpu --budget-s 170 --json "$out/qmm_mgpu.json" 2>&1 | tee "$out/qmm_mgpu.log" \
      | grep -v "^\[" | grep -E "^decode|^\*|mosaic|copy" | cut -c1-140 | tail -60 ;;
  thirtieth)
    # Session 11, last call: the Mosaic GPU decode qmm is the default on a GPU now (qmm.DECODE_IMPL "auto"). Its own
    # gpu tests, the 27B bench at the defaults (compile cold / warm with its kernels), the server beside the engine.
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm_mgpu.py \
      > "$out/gpu_tests_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_mgpu.log" | cut -c1-160 | tail -8
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | grep -E "implementation|^compile|^prompt |^decode " | tail -9
    bash "$0" twenty-sixth ;;
  twenty-ninth)
    # Session 11: dispatch_probe found a Mosaic GPU launch no dearer for the host than a Triton one (enqueue 5.1 vs
    # 5.8 µs), so is the engine still slower with the Mosaic GPU decode qmm (session 6: 63.7 vs 80.2 forwards/s)?
    # One stream, the Triton tiles and the Mosaic GPU kernel in one run, the latter also with custom calls in the
    # command buffers; then the engine's exactness gates with the Mosaic GPU kernel on.
    cc="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
    for v in "triton|" "mgpu|" "mgpu|$cc"; do
      XLA_FLAGS="${v#*|}" timeout 110 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths "" \
        --rounds 32 --no-compile-timing --compile-cache "" --qmm-decode-impl "${v%%|*}" 2>&1 \
        | tee -a "$out/bench_impls.log" | grep -E "^decode [0-9]+ streams:" | sed "s/^/${v%%|*} ${v#*|}: /"
    done
    pytest_mgpu 200 -m gpu -v -p no:cacheprovider --tb=short -rfE tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_engine_mgpu.log | cut -c1-200 | tail -12 ;;
  twenty-eighth)
    # Session 11: what one launch costs the host, Triton against Mosaic GPU kernels, under three XLA command-buffer
    # settings (tools/gpu/dispatch_probe.py), then the queued split-prep stage.
    timeout 110 python3 tools/gpu/dispatch_probe.py --timeout 35 2>&1 | tee "$out/dispatch_probe.log" | grep -v "^\[" | tail -12
    bash "$0" split-prep ;;
  twenty-seventh)
    # Queued for session 11, first call: the engine's gpu gates and the qmm decode tests with session 10's
    # defaults (decode tiles with scale_words on and prefetch off, never run as a pair through the engine gates;
    # batched shapes by default), then the 27B bench (its decode last timed before scale_words).
    timeout -s INT 200 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      tests/test_qmm.py -k "engine or gpu_row_invariance or gpu_27b_shape or gpu_matches_oracle or gpu_split_k or same_weights" \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -20
    timeout 380 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | tail -8 ;;
  split-prep)
    # Queued for session 11: the GDN prep pass in two launches (PromptTiles.split_prep, built in session 10 after
    # the device budget was spent: offline 168 and 152 registers, 3 programs an SM each, against 255 and 2; CPU bits
    # equal to the one-launch prep) beside the shipped tiles and fla at 4K / 16K / 64K, then its gpu bits test.
    bf="precision=bf16,store_dtype=bfloat16,transposed=1,fused_output=1,block_v=32,num_warps=4"
    JAX_PLATFORMS=cuda timeout 280 python3 -m pallas_kernels.bench gdn --t 4096,16384,65536 --skip verify,conv,step \
      --iters 10 --prompt-tiles "$bf;$bf,split_prep=1" > "$out/gdn_prompt.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_prompt.log" | tail -30
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_gdn.py \
      -k "split_prep or prompt_exactness" > "$out/gpu_tests_gdn.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_gdn.log" | cut -c1-160 | tail -10 ;;
  scale-words)
    # Session 10: the decode kernel with its scales and biases read as uint32 words of group pairs (scale_words;
    # offline its SASS loses the shared-memory round trip of the scales, and without prefetch they ride cp.async):
    # bits against the shipped tiles, then the four decode shapes at M = 1 and 16.
    timeout -s INT 90 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm.py \
      -k "gpu_bit_neutral" > "$out/gpu_tests_qmm.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_qmm.log" | cut -c1-160 | tail -6
    timeout 150 python3 -m pallas_kernels.bench qmm --sweep --m 1,16 --budget-s 130 \
      --shapes 5120x17408,17408x5120,5120x6144,6144x5120 --variants "scale_words=1;scale_words=1,prefetch=0" \
      --json "$out/qmm_scale_words.json" > "$out/qmm_scale_words.log" 2>&1
    grep -vE "^\[|^ *$" "$out/qmm_scale_words.log" | cut -c1-130 | tail -40 ;;
  sass-stalls)
    # Session 10: where in its SASS the qmm decode kernel (5120 -> 17408, M = 1) stalls: Nsight Compute's warp
    # state samples per instruction, the 40 most sampled instructions with their text and the columns beside.
    timeout -s INT 150 ncu --profile-from-start off --clock-control none --kernel-name regex:"qmm" \
      --section SourceCounters --section WarpStateStats --export "$out/qmm_sass" \
      python3 tools/gpu/kernel_ncu.py --cases qmm_5120x17408_m1 > "$out/sass_run.log" 2>&1
    tail -3 "$out/sass_run.log"
    ncu --import "$out/qmm_sass.ncu-rep" --page source --csv --print-source sass > "$out/qmm_sass.csv" 2> "$out/sass_page.err"
    tail -3 "$out/sass_page.err"
    python3 tools/gpu/sass_stalls.py "$out/qmm_sass.csv"
    ;;
  stalls)
    # Session 10: what the warps of the qmm decode kernel and the GDN step / window wait on (Nsight Compute's stall
    # reasons as cycles a warp spends in each, per issued instruction), one launch each.
    reasons=barrier,long_scoreboard,short_scoreboard,wait,math_pipe_throttle,mio_throttle,lg_throttle,dispatch_stall,no_instruction,not_selected,selected,membar,branch_resolving,drain,imc_miss,misc,tex_throttle,sleeping
    metrics=gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
    for r in ${reasons//,/ }; do metrics+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
    timeout -s INT 200 ncu --profile-from-start off --clock-control none --kernel-name regex:"qmm|gdn_" \
      --metrics "$metrics" --csv python3 tools/gpu/kernel_ncu.py \
      --cases qmm_5120x17408_m1,qmm_17408x5120_m1,gdn_step_s16,gdn_window_s16_r16 > "$out/stalls.csv" 2> "$out/stalls.err"
    tail -3 "$out/stalls.err"
    python3 - "$out/stalls.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
k, m, v = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
seen = {}
for r in body:
    seen.setdefault((r[0], r[k]), {})[r[m].replace("smsp__average_warps_issue_stalled_", "").replace(
        "_per_issue_active.ratio", "")] = r[v]
for (i, name), d in seen.items():
    top = sorted(((float(x.replace(",", "")), key) for key, x in d.items() if key.isidentifier() and "__" not in key),
                 reverse=True)
    print(i, name, "time", d.get("gpu__time_duration.sum"), "regs", d.get("launch__registers_per_thread"),
          "warps%", d.get("sm__warps_active.avg.pct_of_peak_sustained_active"))
    print("   ", ", ".join(f"{key} {val:.2f}" for val, key in top[:8]))
PY
    ;;
  twenty-sixth)
    # Session 10, last call: the server at its defaults (--shapes auto: batched with the kernels on the 27B's
    # quantized weights) beside the engine alone.
    timeout 330 python3 -m server.bench --compare --synthetic 27b --concurrency 1,16 --prompt-tokens 1024 \
      --max-tokens 128 --max-model-len 4096 --parallel 16 --json "$out/server_bench.json" 2>&1 \
      | tee "$out/server_bench.log" | tail -12 ;;
  twenty-fifth)
    # Session 10: does a 64-row dequant tile (one warpgroup) give the 128-row tile's bits, and is it faster at the
    # N = 5120 shapes' M = 1024 (160 programs of the shipped tile on 132 SMs)? Then the engine alone with batched
    # shapes (server --shapes batched; the server ran fixed shapes: 62.9 / 482.6 tok/s at 1 / 16 concurrency).
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_qmm.py \
      -k "row_tile_height or dequant_27b" > "$out/gpu_tests_qmm.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_qmm.log" | cut -c1-160 | tail -8
    timeout 120 python3 -m pallas_kernels.bench qmm --sweep --prompt-only --prompt-ms 1024,4096 \
      --prompt-shapes 17408x5120,6144x5120,5120x10240 --dequant-candidates 9 --budget-s 100 \
      --json "$out/qmm_prompt_rows.json" > "$out/qmm_prompt_rows.log" 2>&1
    grep -E "^prompt|\*pallas|pallas dequant (64|128x256x64 w8 s3 g8 split2)|bf16 jnp.dot" "$out/qmm_prompt_rows.log" \
      | grep -v "^\[" | cut -c1-150
    timeout 330 python3 -m server.bench --engine --synthetic 27b --shapes batched --concurrency 1,16 \
      --prompt-tokens 1024 --max-tokens 128 --max-model-len 4096 --parallel 16 --json "$out/engine_batched.json" 2>&1 \
      | tee "$out/engine_batched.log" | tail -24 ;;
  twenty-fourth)
    # Queued for session 10: split-K for the dequant prompt matmul (built in session 9, untimed) at the three
    # shapes that miss "M = 1024 at >= 70 % of the bf16 matmul", M = 1024 and 4096, beside the shipped tiles and cuBLAS.
    timeout 300 python3 -m pallas_kernels.bench qmm --sweep --prompt-only --prompt-ms 1024,4096 \
      --prompt-shapes 17408x5120,6144x5120,5120x10240 --budget-s 270 --json "$out/qmm_prompt_split.json" 2>&1 \
      | tee "$out/qmm_prompt_split.log" | tail -50 ;;
  twenty-second)
    # Queued for session 10, first call: the window's fold and merge in pass 1's tail by atomic tickets
    # (WindowTiles.tail="tickets", built in session 9 after the device budget was spent; CPU interpret tests and an
    # offline H200 compile only: 154 registers at one row, 74.8 KB shared memory as pass 1 alone): its gpu test,
    # then the compare section, where "tickets tail" runs beside the shipped two-launch tail at 4K / 32K / 128K.
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention.py \
      -k "tickets or window_gpu or fold" > "$out/gpu_tests_attention.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_attention.log" | cut -c1-160 | tail -14
    timeout 300 python3 -m pallas_kernels.bench attention --sections compare --budget-s 260 \
      --json "$out/attention_compare.json" 2>&1 | tee "$out/attention_compare.log" | grep -v "^  section=" | tail -40 ;;
  twenty-third)
    # Queued for session 10: Nsight Compute on the kernels it did not reach in session 9 (qmm decode, the GDN step
    # and 16-row window, the 16-row attention window), then the server bench at the current defaults (last taken
    # at 9659462 in session 3).
    NCU_CASES=qmm_5120x17408_m1,qmm_17408x5120_m1,gdn_step_s16,gdn_window_s16_r16,attn_window16_4k \
      bash "$0" ncu
    timeout 330 python3 -m server.bench --compare --synthetic 27b --concurrency 1,16 --prompt-tokens 1024 \
      --max-tokens 128 --max-model-len 4096 --parallel 16 --json "$out/server_bench.json" 2>&1 \
      | tee "$out/server_bench.log" | tail -20 ;;
  twentieth)
    # Session 9, call 2: the GDN prompt tiles shipped after call 1 (fused_output, S^T in 32-column slices on 4
    # warps): their exactness tests, the engine's gpu gates, and the 27B engine bench (prefill with them; decode at
    # the 64x4 GDN step tiles of session 8).
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_gdn.py \
      -k "prompt_exactness or bf16_products" > "$out/gpu_tests_gdn.log" 2>&1
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_*.log | cut -c1-160 | tail -16
    timeout 300 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | tail -8 ;;
  twenty-first)
    # Session 9, last call: the GDN verify table at the shipped window tiles (64x4 since session 8) with the
    # window's redundant first state load removed, step at 64x4 / 16x1, fla beside; the window/step gpu tests.
    timeout -s INT 100 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_gdn.py \
      -k "window or step" > "$out/gpu_tests_gdn.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_gdn.log" | cut -c1-160 | tail -10
    JAX_PLATFORMS=cuda timeout 280 python3 -m pallas_kernels.bench gdn --skip prompt,conv --no-sweep --iters 20 \
      --step-tiles 64x4,16x1 --step-budget-s 60 > "$out/gdn_verify.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_verify.log" | tail -45 ;;
  ncu)
    # Session 9: Nsight Compute on one launch of each kernel still far from its floor (tools/gpu/kernel_ncu.py).
    # Only our kernels (--kernel-name): in session 9 Nsight Compute failed on an XLA fusion between two cases and on
    # the 16-row attention window's pass 1, and everything after a failure in the process went unprofiled.
    timeout -s INT 240 ncu --profile-from-start off --clock-control none --kernel-name regex:"qmm|gdn_|attn_" \
      --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --export "$out/kernels" python3 tools/gpu/kernel_ncu.py ${NCU_CASES:+--cases $NCU_CASES} > "$out/ncu_run.log" 2>&1
    tail -15 "$out/ncu_run.log"
    ncu --import "$out/kernels.ncu-rep" --page details > "$out/kernels.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|No Eligible" \
      "$out/kernels.txt" | cut -c1-150 | head -150 ;;
  sixteenth)
    # Session 9, call 1: the GDN prompt pass with the outputs computed in the state pass
    # (fused_output; no output pass, no chunk states or V' in memory) beside the shipped tiles and fla at 4K / 16K /
    # 64K, then the GDN gpu tests: prompt (incl. the fused tiles' exactness), step and window/commit at the new
    # WindowTiles default (64x4). `seventeenth` has the engine's gates (the conv's history barrier moved into
    # _conv_prompt after session 8's last device run: pools in place still to confirm on the GPU).
    bf="precision=bf16,store_dtype=bfloat16,transposed=1"
    JAX_PLATFORMS=cuda timeout 280 python3 -m pallas_kernels.bench gdn --t 4096,16384,65536 --skip verify,conv,step \
      --iters 10 --prompt-tiles "$bf,block_v=16,num_warps=2;$bf,fused_output=1,block_v=16,num_warps=2;\
$bf,fused_output=1,block_v=16,num_warps=4;$bf,fused_output=1,block_v=32,num_warps=4" > "$out/gdn_prompt.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_prompt.log" | tail -30
    timeout -s INT 230 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_gdn.py \
      -k "prompt or step or window" > "$out/gpu_tests_gdn.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_*.log | cut -c1-160 | tail -22 ;;
  eighteenth)
    # Session 9 (run by hand with --budget-s 190): verify rows past 16 on the decode tiles (M = 64 / 256 cost 3.7x / 15x of M = 16 in session 7): more
    # 16-row blocks a program (max_m_blocks, a launch choice: each row block's MMAs are the same whatever the count)
    # so each weight tile is read fewer times.
    timeout 250 python3 -m pallas_kernels.bench qmm --sweep --shapes 5120x17408,17408x5120,5120x6144 --m 16,64,256 \
      --variants "max_m_blocks=4;max_m_blocks=8;max_m_blocks=16" --budget-s 220 \
      --json "$out/qmm_mblocks.json" 2>&1 | tee "$out/qmm_mblocks.log" | tail -30 ;;
  nineteenth)
    # Session 9, call 3 (after ncu): the 1-row decode's candidates again (chunk 1024 added: the 32K decode is at 60 % of copy, 80 % wanted).
    timeout 300 python3 -m pallas_kernels.bench attention --sections compare --budget-s 260 \
      --json "$out/attention_compare.json" 2>&1 | tee "$out/attention_compare.log" | grep -v "^  section=" | tail -60 ;;
  seventeenth)
    # Superseded by `twentieth` (session 9): the engine's gpu gates and the 27B bench at session 8's defaults (GDN WindowTiles 64x4
    # for the serial step: the 16-stream round should lose ~1.6 ms by the kernel timings; prefill with the conv).
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10
    timeout 400 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | tail -8 ;;
  conv-profile)
    # Session 8, call 5: where the prompt conv's time goes (Pallas taps, the stacked reference, XLA shifted adds).
    timeout 120 python3 tools/gpu/conv_profile.py --trace "$out/conv_trace" 2>&1 | grep -v "^\[" | tail -60
    rm -rf "$out/conv_trace"
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      tests/test_gdn.py -k "chunk_cuts or conv_prompt or bfloat16-True" > "$out/gpu_tests_conv.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_conv.log" | cut -c1-160 | tail -10 ;;
  fifteenth)
    # Session 8, call 4: the prompt conv's Pallas pass; the shipped GDN prompt tiles over the issue's four T; the
    # engine's gpu gates with both; the 27B prefill; one decode bench with XLA's excess precision off.
    JAX_PLATFORMS=cuda timeout 60 python3 -m pallas_kernels.bench gdn --skip prompt,verify,step --iters 20 \
      > "$out/gdn_conv.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_conv.log" | tail -9
    JAX_PLATFORMS=cuda timeout 130 python3 -m pallas_kernels.bench gdn --t 1024,4096,16384,65536 \
      --skip verify,conv,step --iters 10 \
      --prompt-tiles "precision=bf16,store_dtype=bfloat16,transposed=1,block_v=16,num_warps=2" \
      > "$out/gdn_prompt.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_prompt.log" | tail -20
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      tests/test_gdn.py -k "chunk_cuts or concurrent or conv_prompt or exactness" > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10
    timeout 150 python3 -m qwen_jax bench --synthetic 27b --streams "" --prompt-lengths 4096,32768 \
      --no-compile-timing 2>&1 | tee "$out/bench_prefill.log" | tail -3
    XLA_FLAGS=--xla_allow_excess_precision=false timeout 100 python3 -m qwen_jax bench --synthetic 27b --streams 1 \
      --prompt-lengths "" --rounds 32 --no-compile-timing 2>&1 | tee "$out/bench_no_excess.log" | tail -2 ;;
  fourteenth)
    # Session 8, call 3: the prompt conv as shifted adds, the engine's gpu gates at the new shipped tiles (GDN
    # prompt in bf16 products on S^T, the conv), and the 27B engine bench: prefill 4K / 32K, decode 1 / 16 streams.
    JAX_PLATFORMS=cuda timeout 60 python3 -m pallas_kernels.bench gdn --skip prompt,verify,step --iters 20 \
      > "$out/gdn_conv.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_conv.log" | tail -9
    timeout -s INT 200 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      > "$out/gpu_tests_engine.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_engine.log" | cut -c1-160 | tail -10
    timeout 310 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | tail -30 ;;
  thirteenth)
    # Session 8, call 2: the GDN state pass on S^T (transposed=1) beside the bf16 tiles shipped after call 1; the
    # shipped tiles at 1K and 64K; the gpu tests of both kernels whose shipped tiles changed (GDN prompt, attention
    # windows with fp8 row blocks).
    bf="precision=bf16,store_dtype=bfloat16"
    JAX_PLATFORMS=cuda timeout 230 python3 -m pallas_kernels.bench gdn --t 4096,16384 --skip verify,conv,step \
      --iters 10 --prompt-tiles "$bf,block_v=32,num_warps=4;$bf,transposed=1,block_v=64,num_warps=4;\
$bf,transposed=1,block_v=64,num_warps=8;$bf,transposed=1,block_v=32,num_warps=4;$bf,transposed=1,block_v=16,num_warps=2" \
      > "$out/gdn_prompt.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_prompt.log" | tail -34
    JAX_PLATFORMS=cuda timeout 100 python3 -m pallas_kernels.bench gdn --t 1024,65536 --skip verify,conv,step \
      --iters 10 --prompt-tiles "$bf,block_v=32,num_warps=4" > "$out/gdn_prompt_ends.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_prompt_ends.log" | tail -14
    timeout -s INT 150 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_gdn.py \
      -k "prompt" > "$out/gpu_tests_gdn.log" 2>&1
    timeout -s INT 100 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_attention.py \
      -k "window_gpu or fold" > "$out/gpu_tests_attention.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_*.log | cut -c1-160 | tail -30 ;;
  twelfth)
    # Session 8, call 1: the GDN prompt pass at fla's precision (precision=bf16) and tile variants beside the
    # shipped tiles and fla, each launch timed alone; its gpu tests; the 16-row window's row blocks.
    JAX_PLATFORMS=cuda timeout 250 python3 -m pallas_kernels.bench gdn --t 4096,16384 --skip verify,conv,step \
      --iters 10 --prompt-tiles ";store_dtype=bfloat16;precision=bf16,store_dtype=bfloat16;\
precision=bf16,store_dtype=bfloat16,block_v=32,num_warps=4;precision=bf16,store_dtype=bfloat16,prep_warps=8;\
precision=bf16,store_dtype=bfloat16,block_v=32,num_warps=8" > "$out/gdn_prompt.log" 2>&1
    grep -vE "^\[|^  " "$out/gdn_prompt.log" | tail -40
    timeout -s INT 120 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_gdn.py \
      -k "prompt" > "$out/gpu_tests_gdn.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/gpu_tests_gdn.log" | cut -c1-160 | tail -12
    attention_window16 ;;
  eleventh)
    # Queued for the next session's first call: the 16-row window's row blocks (not yet timed), the decode round
    # at the session-7 attention defaults (engine numbers last taken in session 5), then the two engine gpu tests
    # not yet run with the Mosaic GPU qmm since its rounding fix.
    attention_window16
    timeout 200 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths "" --rounds 32 \
      2>&1 | tee "$out/bench_27b.log" | tail -8
    pytest_mgpu 180 -m gpu -v -p no:cacheprovider --tb=short tests/test_engine_gpu.py \
      -k "True or in_place" > "$out/engine_gpu_mgpu.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out/engine_gpu_mgpu.log" | cut -c1-160 | tail -8 ;;
  mgpu-probe)
    # Where the Mosaic GPU decode qmm's time goes: parts of its step left out, then its SASS (one shape).
    timeout 200 python3 tools/gpu/mgpu_probe.py 2>&1 | tee "$out/mgpu_probe.log" | grep -v "^\[" | tail -30
    timeout 100 python3 tools/gpu/mgpu_probe.py --probes no_compute,no_load --stages 8 --block-groups 4 2>&1 \
      | tee -a "$out/mgpu_probe.log" | grep -v "^\[" | tail -10
    MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$out/dump" timeout 100 \
      python3 tools/gpu/mgpu_probe.py --shapes 5120x34816 --probes full --reps 2 > "$out/dump.log" 2>&1
    ls -la "$out/dump" | head ;;
  tests)
    # SIGINT, not TERM, at the limit: pytest then still prints which tests passed and failed. Results go straight to
    # files (a piped -q run lost its summary to the timeout on 2026-11-30).
    # First half: what is unproven on the device -- the qmm rounding (fma_ptx) and 8-bit prompt tiles (both added
    # in session 4 after the device run), then the GDN tests (cut short in sessions 2 and 3). Second half: the rest
    # (engine, rownorm, attention, kv: all passed at 51ec6b5 / 9659462).
    timeout -s INT 270 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE --durations=15 \
      "tests/test_qmm.py::test_gpu_dequant_same_weights_as_fused" "tests/test_qmm.py::test_gpu_matches_oracle" \
      tests/test_gdn.py > "$out/gpu_tests_1.log" 2>&1
    timeout -s INT 270 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short -rfE --durations=15 \
      tests/test_qmm.py tests/test_engine_gpu.py tests/test_rownorm.py tests/test_attention.py \
      tests/test_kv_quant.py --deselect tests/test_qmm.py::test_gpu_dequant_same_weights_as_fused \
      --deselect tests/test_qmm.py::test_gpu_matches_oracle > "$out/gpu_tests_2.log" 2>&1
    grep -hE "(PASSED|FAILED|ERROR)( |$)|^E |passed|failed" "$out"/gpu_tests_*.log | cut -c1-160 | tail -60 ;;
  engine)
    timeout 560 python3 -m qwen_jax bench --synthetic 27b --streams 1,16 --prompt-lengths 4096,32768 --rounds 64 \
      2>&1 | tee "$out/bench_27b.log" | tail -40 ;;
  server)
    timeout 560 python3 -m server.bench --compare --synthetic 27b --concurrency 1,4,16 --prompt-tokens 1024 \
      --max-tokens 128 --max-model-len 4096 --parallel 16 --json "$out/server_bench.json" 2>&1 \
      | tee "$out/server_bench.log" | tail -40 ;;
  qmm-sweep)
    timeout 200 python3 -m pallas_kernels.bench qmm --sweep --prompt-ms 1024,4096 --json "$out/qmm_sweep.json" 2>&1 \
      | tee "$out/qmm_sweep.log" | tail -80 ;;
  attention-compare)
    timeout 200 python3 -m pallas_kernels.bench attention --sections compare --budget-s 140 \
      --json "$out/attention_compare.json" 2>&1 | tee "$out/attention_compare.log" | tail -60 ;;
  qmm)
    timeout 560 python3 -m pallas_kernels.bench qmm --shapes 5120x17408,17408x5120,5120x10240,5120x6144,6144x5120,5120x12288,5120x248320 \
      --m 1,4,16,64,256,1024,4096 --json "$out/qmm.json" 2>&1 | tee "$out/qmm.log" | tail -60 ;;
  gdn)
    JAX_PLATFORMS=cuda timeout 560 python3 -m pallas_kernels.bench gdn --iters 20 --skip prompt 2>&1 \
      | tee "$out/gdn_verify.log" | tail -60 ;;
  attention)
    timeout 560 python3 -m pallas_kernels.bench attention --sections decode,prompt,window,write,xla --budget-s 420 \
      --json "$out/attention.json" 2>&1 | tee "$out/attention.log" | tail -60 ;;
  launch)
    timeout 560 python3 tools/gpu/launch_probe.py --synthetic 27b \
      --variants default,no-command-buffers,custom-calls-too --tiles x_natural=1 --layers 16 2>&1 | tee "$out/launch_probe.log" | tail -30 ;;
  prompt-ab)
    # The qmm prompt implementations end to end: 27B prompt tok/s with the fused kernel and with dequantize +
    # Pallas matmul (the prefill goal is 9.4K tok/s at 4K), then the kernels alone.
    for impl in fused dequant; do
      timeout 200 python3 -m qwen_jax bench --synthetic 27b --streams "" --prompt-lengths 4096 \
        --no-compile-timing --compile-cache "" --qmm-prompt-impl $impl 2>&1 | tee "$out/prompt_$impl.log" | tail -4
    done
    timeout 150 python3 -m pallas_kernels.bench qmm --sweep --prompt-only --prompt-ms 1024,4096 --budget-s 120 \
      --json "$out/qmm_prompt.json" 2>&1 | tee "$out/qmm_prompt.log" | tail -30 ;;
  qmm-ab)
    # The qmm decode switches A/B: isolated kernels at the 27B's decode shapes, then the whole decode round.
    # (prefetch and lop3 are the defaults since 51ec6b5: the first variant turns them off again, for reference)
    ab="prefetch=0,lop3=0;fma_ptx=1;fma_ptx=1,block_m=8"
    timeout 150 python3 -m pallas_kernels.bench qmm --sweep --shapes 5120x34816,17408x5120,5120x6144,6144x5120 \
      --m 1,16 --variants "$ab" --budget-s 120 --json "$out/qmm_ab.json" 2>&1 | tee "$out/qmm_ab.log" | tail -45
    timeout 280 python3 tools/gpu/launch_probe.py --synthetic 27b --variants default --tiles "$ab" 2>&1 \
      | tee "$out/launch_ab.log" | tail -30 ;;
  profile)
    timeout 200 python3 tools/gpu/decode_profile.py --synthetic 27b --trace "$out/trace" --profiled 0 2>&1 \
      | tee "$out/decode_trace.txt" | tail -50
    timeout 300 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
      --log-file "$out/ncu.csv" python3 tools/gpu/decode_profile.py --synthetic 27b 2>&1 | tail -5
    python3 tools/gpu/decode_profile.py --summarize "$out/ncu.csv" | tee "$out/decode_profile.txt" | head -45 ;;
  rowinv)
    timeout 300 python3 tools/gpu/rowinv_probe.py 2>&1 | tee "$out/rowinv.log" | tail -40
    timeout 240 python3 tools/gpu/rowinv_probe.py --dtype float32 2>&1 | tee "$out/rowinv_f32.log" | tail -30 ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
# How big the persistent compilation cache grew (could it travel between calls within the 64 MiB carry limit?)
du -sh "${QWEN_JAX_CACHE_DIR:-$HOME/.cache/qwen_jax/jax}" 2>/dev/null | sed 's/^/compilation cache: /' || true  # no cache dir: not a failure of the stage
