#!/usr/bin/env bash
# Soak under churn: thousands of requests through one KDA layer with a pool of a few slots,
# a prefix cache whose budget evicts all the time, speculation (ngram, trees) and mixed batches on,
# parallel samples forked, resident memory sampled after every step. Passes when resident memory is
# flat after warm-up (the last sample within 5% of the one at the end of the first tenth of the steps),
# every slot and snapshot is accounted for at the end, and the self-check passes on sampled requests.
#   scripts/soak.sh [requests] [kda binary]      (default 2000, build/kda)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-2000}
KDA=${2:-build/kda}
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
"$KDA" simulate --layers 1 --precision fp32 --workload shared-prefix --prefix-groups 2 --shared-prefix-len 64 \
  --requests "$REQUESTS" --prompt-len 8:32 --output-len 6 --vocab 64 --seed 3 \
  --state-memory 20MiB --prefix-cache-memory 16MiB --cache-interval 64 --mixed --max-batch 8 \
  --speculative ngram --draft-topk 2 --parallel-samples 2 --check 8 --json >"$OUT"
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
keys = ["requests_completed", "steps", "wall_s", "slot_reuses", "prefix_cache_hit_rate", "prefix_cache_evictions",
        "spec_draft_tokens", "spec_accept_rate", "leaked_slots", "leaked_request_indices", "cache_consistent",
        "rss_bytes_peak", "rss_bytes_end", "rss_growth", "check_worst_error_ratio", "check_ok"]
for k in keys:
    print(f"  {k:24s} {j.get(k)}")
ok = (j["accounting_ok"] and j["check_ok"] and j["rss_growth"] <= 0.05
      and j["requests_completed"] == j["requests"])
print("soak:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
