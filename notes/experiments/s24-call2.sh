#!/usr/bin/env bash
# Session 24, call 2: where one-thread `large` on per-thread streams and own-stream `churn` lost
# a third between b283c8d and 70e9b03 (call 1): the benchmark binary at every tenth commit that
# touched src/, benches/ or testkit/ (gpu-bundle/bisect/cuarena-aN-HASH, a0 = b283c8d,
# a7 = 70e9b03), four interleaved rounds of the two points and of per-thread churn.
O=$OUT/s24-call2
mkdir -p $O
for r in 1 2 3 4; do
  for b in $(ls gpu-bundle/bisect); do
    for w in "large ptds" "churn own" "churn ptds"; do
      set -- $w
      ./gpu-bundle/bisect/$b --json --secs 0.5 --threads 1 --workloads $1 --streams $2 --allocators cuarena --no-touch 2>/dev/null |
        sed "s/\"allocator\":\"cuarena\"/\"allocator\":\"$b\",\"round\":$r/" >> $O/bisect.jsonl
    done
  done
done
wc -l $O/bisect.jsonl
