#!/usr/bin/env bash
# ROUNDS interleaved rounds of examples/torch_train.py, native then cuarena, each a JSON line
# {"round": i, "run": ...} appended to OUT/train.jsonl (stderr to OUT/train.err).
# Usage: bash notes/experiments/train-rounds.sh OUT ROUNDS   (from the repository root)
set -u
O=$1
for i in $(seq "$2"); do
  for a in native cuarena; do
    r=$(timeout 120 python3 examples/torch_train.py --allocator $a 2>>$O/train.err | tail -1)
    echo "{\"round\": $i, \"run\": $r}" >> $O/train.jsonl
  done
done
