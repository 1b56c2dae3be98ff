#!/usr/bin/env bash
# Session 24, call 4: is the GPU machine's one-thread slowdown (calls 1-2: `large` on
# per-thread streams 0.64-0.78x of b283c8d, the same instruction count) code placement? The GPU
# machine's CPU is an Intel Xeon (the host's, where nothing changed, an AMD EPYC): Intel's
# jump-conditional-code erratum mitigation makes a branch that crosses or ends on a 32-byte
# boundary leave the decoded-uop cache. gpu-bundle/jcc: b283c8d (old) and 5f743a4 (new), each as
# built and with `-C llvm-args=-x86-branches-within-32B-boundaries` (-jcc); six rounds, the
# order reversed every other round.
O=$OUT/s24-call4
mkdir -p $O
bins="cuarena-old cuarena-old-jcc cuarena-new cuarena-new-jcc"
for r in 1 2 3 4 5 6; do
  order=$bins; [ $((r % 2)) = 0 ] && order=$(echo $bins | tr ' ' '\n' | tac | tr '\n' ' ')
  for b in $order; do
    for w in "large ptds" "churn own" "churn ptds" "large legacy" "churn legacy"; do
      set -- $w
      ./gpu-bundle/jcc/$b --json --secs 0.5 --threads 1 --workloads $1 --streams $2 --allocators cuarena --no-touch 2>/dev/null |
        sed "s/\"allocator\":\"cuarena\"/\"allocator\":\"$b\",\"round\":$r/" >> $O/jcc.jsonl
    done
  done
done
for b in $bins; do
  ./gpu-bundle/jcc/$b --json --secs 0.5 --threads 16 --workloads churn,large --streams ptds,own --allocators cuarena --no-touch 2>/dev/null |
    sed "s/\"allocator\":\"cuarena\"/\"allocator\":\"$b\"/" >> $O/jcc16.jsonl
done
wc -l $O/*.jsonl
