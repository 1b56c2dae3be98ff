#!/usr/bin/env bash
# Session 19, call 3: after MemPool's destructor was mended (call 2's probe aborted in it). The
# PyTorch API probe again (MemPool, use_mem_pool, graphed callables, torch.compile's
# reduce-overhead), the Python package's tests with the GPU required, and the bundled gpu_capture
# and ffi tests.
source "$(dirname "$0")/gpu-checks.sh"
PYTHONPATH=$PWD/python timeout 200 python3 notes/experiments/torch_api_probe.py > $O/probe-cuarena.jsonl 2> $O/probe-cuarena.err
echo "probe rc=$?" >> $O/summary.txt
grep '"ok": false' $O/probe-cuarena.jsonl | cut -c1-400 >> $O/summary.txt
grep -E '"(cuda_graph_capture|mempool|mempool_use|make_graphed_callables|torch_compile_reduce_overhead)"' $O/probe-cuarena.jsonl | cut -c1-300 >> $O/summary.txt
echo "probe ok: $(grep -c '"ok": true' $O/probe-cuarena.jsonl) of $(wc -l < $O/probe-cuarena.jsonl)" >> $O/summary.txt
tail -3 $O/probe-cuarena.err >> $O/summary.txt
python_checks
rust_tests test-gpu_capture test-ffi
