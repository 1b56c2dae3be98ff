#!/usr/bin/env bash
# Session 24, call 1: the current code (70e9b03: eleven sessions of reliability work since the
# tenth measurement) against b283c8d (the tenth measurement's code), side by side: the GPU tests
# bundled (test-gpu: the fence torture in every stream mode), the Python package, three
# interleaved rounds of every workload and stream mode at 1 and 16 threads, the table with
# cuMemAllocAsync and the harness, and PyTorch training three times each way.
# Bundle: GPU_BUNDLE_TESTS="gpu" bash tools/gpu-bundle.sh; b283c8d's benchmark binary built in
# its own worktree and target directory, copied to gpu-bundle/cuarena-old.
O=$OUT/s24-call1
mkdir -p $O
TESTS=1 TABLE=1 AB_ROUNDS=3 TRAIN_RUNS=3 bash tools/gpu-measure.sh $O 2>&1 | tee $O/summary.txt
