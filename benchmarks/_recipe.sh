# The shell functions the 32K recipe scripts share (benchmarks/distill_recipe_32k.sh, train_recipe_32k.sh and
# frontier_32k.sh source this file; it runs nothing itself). steps_of reads PY, SEQ_LEN and BATCH; wants_ruler RULER_AT.

t() { local start=$SECONDS; "$@"; echo "  $((SECONDS - start)) s: ${*:1:3}" >&2; }  # a step and its seconds
# write a command's stdout to FILE only when it succeeds (a killed eval leaves no JSON that would be skipped later)
to_json() { local file=$1; shift; "$@" >"$file.part" && mv "$file.part" "$file"; }
steps_of() {  # 4M -> whole steps of BATCH x SEQ_LEN tokens (K / M / G: 1e3 / 1e6 / 1e9 tokens, rounded up)
  $PY - "$1" $((SEQ_LEN * BATCH)) <<'PY'
import math, re, sys
spec, per_step = sys.argv[1], int(sys.argv[2])
m = re.fullmatch(r"(\d+(?:\.\d*)?)([kKmMgG]?)", spec)
if m is None:
    sys.exit(f"error: TOKENS: not a token count: {spec!r} (e.g. 0, 500K, 4M, 1G)")
tokens = math.ceil(float(m[1]) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m[2].lower()])
print(-(-tokens // per_step))
PY
}
wants_ruler() { local x; for x in $RULER_AT; do [ "$x" = "$1" ] && return 0; done; return 1; }  # a TOKENS entry
