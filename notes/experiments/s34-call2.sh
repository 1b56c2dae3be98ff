#!/usr/bin/env bash
# Session 34, call 2: why PyTorch's eager step is 1.06-1.10x native under cuarena. cuarena's
# counters per steady step (torch_train_calls.py); the driver API calls of 100 steps under
# nsys, native against cuarena (if nsys is installed); 5 more interleaved runs of
# torch_train.py; then 10 host-test binaries on 16 cores, 2 runs each with 4 test threads, while the call has time.
source "$(dirname "$0")/gpu-checks.sh"
nvidia-smi --query-gpu=name --format=csv,noheader >> $O/summary.txt
echo "tools: $(which nsys ncu perf py-spy 2>/dev/null | tr '\n' ' ')" >> $O/summary.txt
# (call 2 ran notes/experiments/torch_train_calls.py, in git at 9b05e30; the same counters now come from
#  examples/torch_train.py --counters, whose JSON line carries them as per_step_after_10)
python3 examples/torch_train.py --allocator cuarena --counters > $O/calls.json 2> $O/calls.err
echo "calls rc=$?" >> $O/summary.txt
if command -v nsys >/dev/null; then
  for a in native cuarena; do
    timeout 200 nsys profile -t cuda,osrt -s none --cpuctxsw=none -o /tmp/prof-$a -f true \
      python3 examples/torch_train.py --allocator $a --steps 100 > $O/nsys-$a.out 2>&1
    nsys stats -r cuda_api_sum -f csv /tmp/prof-$a.nsys-rep > $O/api-$a.csv 2>>$O/nsys-$a.out
    echo "nsys $a rc=$? $(wc -l < $O/api-$a.csv) lines" >> $O/summary.txt
  done
fi
for i in 1 2 3 4 5; do
  for a in native cuarena; do
    python3 examples/torch_train.py --allocator $a 2>>$O/train.err | tail -1 >> $O/train.jsonl
  done
done
echo "train $(wc -l < $O/train.jsonl)" >> $O/summary.txt
for t in test-adversarial_streams test-adversarial_s27b test-legacy_frees test-return_rule test-regressions test-held_frees test-adversarial_s33_held test-capture test-host test-adversarial_s16; do
  [ -x gpu-bundle/$t ] || continue
  for r in 1 2; do
    [ $SECONDS -lt 540 ] || break
    (cd gpu-bundle && CUARENA_CLI=$PWD/cuarena timeout 120 ./$t --test-threads=4 > /tmp/h-$t-$r.log 2>&1); rc=$?
    echo "$t run $r rc=$rc $(grep 'test result' /tmp/h-$t-$r.log | tail -1)" >> $O/summary.txt
  done
done
tar czf $O/logs.tgz -C /tmp $(cd /tmp && ls h-*.log) 2>/dev/null
cat $O/summary.txt
