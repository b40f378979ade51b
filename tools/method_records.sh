#!/usr/bin/env bash
# Every method (and the sync variants) on configs/tiny.py, one process and two, into OUT/NAME:
# the records a refactor must leave unchanged. Run it on the code before and after, then
#   python tools/compare_records.py BEFORE AFTER --per-worker a_edit_p2
# (docs/developer/tests-and-ci.md: what to expect). Usage: tools/method_records.sh OUT
set -u
OUT=${1:?usage: tools/method_records.sh OUT}
mkdir -p "$OUT"
run() {
  name=$1; shift
  rm -rf "$OUT/$name"
  python -m edit_jax train --config configs/tiny.py --run-dir "$OUT/$name" --no-progress steps=14 log_every=1 "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
}
for m in baseline post_local_sgd diloco edit co2; do run "$m" method="$m"; done
run edit_int8_ef method=edit sync.wire.kind=int8 sync.wire.error_feedback=true
run edit_frag2 method=edit sync.fragments=2
run edit_whole method=edit sync.layerwise=false
run edit_rs method=edit sync.outer_sharding=replica_shard
run diloco_adam method=diloco sync.outer.optimizer=adam
for m in diloco edit co2; do run "${m}_p2" method="$m" mesh.processes=2; done
run edit_int8_p2 method=edit sync.wire.kind=int8 sync.wire.error_feedback=true mesh.processes=2
run a_edit_p2 method=a_edit mesh.processes=2 sync.time.tau=0.5
