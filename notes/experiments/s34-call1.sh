#!/usr/bin/env bash
# Session 34, call 1, on HEAD 73c4a84 (the final code of the thirty-third session, after its
# review refactors, which no GPU had run): which card came; the table (cuarena, cuMemAllocAsync
# and the harness, every workload and stream mode, 1 and 16 threads); PyTorch's eager training,
# native and cuarena interleaved, 5 runs each; torch.compile's reduce-overhead mode, 2 interleaved
# rounds (the held frees at capture end are new since the sixteenth measurement); then the
# bundled GPU tests with the GPU required and the Python package's tests.
source "$(dirname "$0")/gpu-checks.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $O/card.txt
cat $O/card.txt >> $O/summary.txt
TABLE=1 TESTS=0 TRAIN_RUNS=5 bash tools/gpu-measure.sh $O >> $O/summary.txt 2>&1
for r in 1 2; do
  for a in native cuarena; do
    PYTHONPATH=$PWD/python timeout 150 python3 examples/torch_train.py --compile reduce-overhead --steps 200 --allocator $a > $O/ro-$a-$r.json 2> $O/ro-$a-$r.err
    echo "compile round $r $a rc=$? $(tail -c 300 $O/ro-$a-$r.err | tr '\n' ' ')" >> $O/summary.txt
  done
done
rust_tests test-gpu test-ffi test-gpu_capture test-c_abi_capture_frees test-held_frees test-adversarial_s33_held test-capture test-adversarial_s32_declared test-adversarial_s28a
python_checks
cd $O && tar czf logs.tgz *.err *.log ro-*.json 2>/dev/null; rm -f *.err ro-*.json rust.log python.log
cat $O/summary.txt
