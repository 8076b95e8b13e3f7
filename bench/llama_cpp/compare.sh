#!/usr/bin/env bash
# kda against llama.cpp on the same weights (issue 28): a 4-layer Kimi-Linear at real widths (3 KDA + 1 MLA,
# 32 experts) from bench/make_checkpoint.py, converted to GGUF by llama.cpp's converter and quantized by
# llama-quantize (Q8_0, Q4_0), packed for kda by kda quantize (int8, int4). Per weights mode, in turns:
# llama-bench -p 512 -n 128 -t 2, then kda simulate on one 512-token request with 128 decode steps
# (prefill tokens/s = 512 / TTFT, decode tokens/s = 1 / the median step), and the prefill again warm (below),
# ROUNDS rounds. A manual
# measurement: it needs a llama.cpp build (LLAMA_BIN) and its source (for the converter), not part of the
# test suite. docs/performance.md has the figures and how llama.cpp was built.
#
#   bench/llama_cpp/compare.sh WORK_DIR LLAMA_SRC LLAMA_BIN [ROUNDS] > results.txt
#
# LLAMA_BENCH_FLAGS adds flags to every llama-bench run: on an AMX host llama.cpp 0c1e570's repacked
# (AMX) buffers abort on this model's Q8_0 (GGML_ASSERT(*cur_backend_id != -1)), so there
# LLAMA_BENCH_FLAGS="--repack 0".
set -euo pipefail
work=$1 src=$2 bin=$3 rounds=${4:-3}
kda=${KDA:-build/kda}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"
if [ ! -d "$work/bf16" ]; then
  /usr/bin/python3 "$here/../make_checkpoint.py" --out "$work/bf16" --layers 4 --experts 32
fi
[ -f "$work/bf16.gguf" ] || "$py" "$here/convert_to_gguf.py" "$src" "$work/bf16" --outtype bf16 --outfile "$work/bf16.gguf" >&2
[ -f "$work/q8_0.gguf" ] || "$bin/llama-quantize" "$work/bf16.gguf" "$work/q8_0.gguf" Q8_0 2 >&2
[ -f "$work/q4_0.gguf" ] || "$bin/llama-quantize" "$work/bf16.gguf" "$work/q4_0.gguf" Q4_0 2 >&2
for w in int8 int4; do
  [ -d "$work/$w" ] || "$kda" quantize --model "$work/bf16" --weights "$w" --out "$work/$w" >&2
done
kda_run() {  # kda_run DIR WEIGHTS [FLAGS...]
  local dir=$1 w=$2
  shift 2
  "$kda" simulate --model "$dir" --weights "$w" "$@" --requests 1 --prompt-len 512:512 --output-len 128 \
    --check 0 --json 2>/dev/null |
    /usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); print("pp512 %.1f tg128 %.1f" % (512e3 / d["ttft_ms_p50"], 1e3 / d["step_ms_p50"]))'
}
# The same prompt length after a first request has run (three 512-token requests one after another; the
# median TTFT is a warm one): llama-bench times its runs after a warm-up run, kda_run's TTFT is the
# process's first request.
kda_warm() {  # kda_warm DIR WEIGHTS [FLAGS...]
  local dir=$1 w=$2
  shift 2
  echo '[{"prompt_len":512,"output_len":4,"arrival_step":0},{"prompt_len":512,"output_len":4,"arrival_step":8},{"prompt_len":512,"output_len":4,"arrival_step":16}]' >"$work/warm_trace.json"
  "$kda" simulate --model "$dir" --weights "$w" "$@" --trace "$work/warm_trace.json" --check 0 --json 2>/dev/null |
    /usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); print("pp512 %.1f" % (512e3 / d["ttft_ms_p50"]))'
}
for r in $(seq "$rounds"); do
  for m in bf16:bf16 q8_0:int8 q4_0:int4; do
    g=${m%%:*} w=${m##*:}
    # shellcheck disable=SC2086  # the flags split into words
    "$bin/llama-bench" -m "$work/$g.gguf" -p 512 -n 128 -t 2 -r 5 ${LLAMA_BENCH_FLAGS:-} -o csv 2>/dev/null |
      /usr/bin/python3 -c 'import csv,sys
for row in csv.DictReader(sys.stdin):
    test = "pp%s" % row["n_prompt"] if row["n_gen"] == "0" else "tg%s" % row["n_gen"]
    print("round %s llama.cpp %s %s %.1f" % (sys.argv[1], sys.argv[2], test, float(row["avg_ts"])))' "$r" "$g"
    dir=$work/bf16
    [ "$w" = bf16 ] || dir=$work/$w
    echo "round $r kda $w $(kda_run "$dir" "$w")"
    echo "round $r kda $w warm $(kda_warm "$dir" "$w")"
    [ "$w" = bf16 ] || echo "round $r kda $w+head $(kda_run "$dir" "$w" --quantize-lm-head)"
  done
done
