#!/usr/bin/env bash
# Session 24, call 3: why one-thread `large` on per-thread streams runs slower at 70e9b03+ than
# at b283c8d on the GPU machine only (calls 1 and 2; the host shows no difference and callgrind
# counts the same instructions a pair). Hardware counters and profiles of both builds there
# (gpu-bundle/perf/cuarena-{old,new}: symbols kept, debug info stripped).
O=$OUT/s24-call3
mkdir -p $O
{ which perf; perf --version; nproc; lscpu | grep -E "Model name|L1d|L2|L3|NUMA node"; cat /sys/kernel/mm/transparent_hugepage/enabled; } > $O/machine.txt 2>&1
args="--json --secs 1 --threads 1 --allocators cuarena --no-touch"
ev=cycles,instructions,branch-misses,L1-dcache-load-misses,LLC-load-misses,dTLB-load-misses,iTLB-load-misses
for r in 1 2 3; do
  for b in old new; do
    for w in "large ptds" "churn own" "churn ptds"; do
      set -- $w
      echo "== $b $1 $2 round $r" >> $O/stat.txt
      perf stat -e $ev -x, -o $O/stat.tmp ./gpu-bundle/perf/cuarena-$b $args --workloads $1 --streams $2 >> $O/rows.jsonl 2>/dev/null
      cat $O/stat.tmp >> $O/stat.txt
    done
  done
done
for b in old new; do
  perf record -o $O/perf-$b.data -F 4999 ./gpu-bundle/perf/cuarena-$b $args --secs 2 --workloads large --streams ptds > /dev/null 2>&1
  perf report -i $O/perf-$b.data --no-children --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -40 > $O/report-$b.txt
  perf annotate -i $O/perf-$b.data --stdio -s cuarena::allocator::Allocator::deallocate_fast 2>/dev/null | grep -E "^\s+[0-9]+\.[0-9]+ :" | sort -rn | head -40 > $O/annotate-free-$b.txt
  rm -f $O/perf-$b.data
done
ls $O; head -5 $O/machine.txt
