#!/usr/bin/env bash
# Session 24, call 5: are one-thread `large` rows bimodal (3.6 or 5.5 M pairs/s, call 4) because
# the boundary-tag arrays of large superblocks (2 MiB of tags for a 128 MiB superblock) do or do
# not land in transparent huge pages? Ten runs; for each, the process's AnonHugePages sampled
# mid-run, and the row.
O=$OUT/s24-call5
mkdir -p $O
{ cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; grep -i huge /proc/meminfo; } > $O/thp.txt
for i in $(seq 10); do
  ./gpu-bundle/cuarena --json --secs 1.5 --threads 1 --workloads large --streams ptds --allocators cuarena --no-touch > $O/row.tmp 2>/dev/null &
  pid=$!
  sleep 1.2
  hp=$(awk '/AnonHugePages/ {s+=$2} END {print s}' /proc/$pid/smaps 2>/dev/null)
  rss=$(awk '/VmRSS/ {print $2}' /proc/$pid/status 2>/dev/null)
  wait $pid
  echo "{\"run\":$i,\"anon_huge_kb\":${hp:-0},\"rss_kb\":${rss:-0},\"row\":$(cat $O/row.tmp)}" >> $O/runs.jsonl
done
cat $O/thp.txt
python3 -c "
import json
for l in open('$O/runs.jsonl'):
    r=json.loads(l); print(r['run'], r['anon_huge_kb'], r['rss_kb'], round(r['row']['pairs_per_sec']/1e6,2), r['row']['p50_ns'])
"
