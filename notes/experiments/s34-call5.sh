#!/usr/bin/env bash
# Session 34, call 5: the real clients on the final code, the steps of tools/gpu-demos.sh that
# the calls before did not run: CuPy (against its pool, on a non-blocking stream, frees during a
# capture), out of memory under PyTorch and CuPy, the OOM hook's spilling layer,
# torch.cuda.graph through the plug-in, and the C programs. Stops starting steps after 150 s.
source "$(dirname "$0")/gpu-checks.sh"
nvidia-smi --query-gpu=name --format=csv,noheader > $O/summary.txt
st() { [ $SECONDS -lt 150 ] || { echo "$1 not run (time)" >> $O/summary.txt; return; }
       local n=$1; shift; timeout 60 "$@" > $O/$n.log 2>&1; echo "$n rc=$? $(tail -1 $O/$n.log | cut -c1-300)" >> $O/summary.txt; }
st cupy python3 examples/cupy_check.py --both
st cupy-stream python3 examples/cupy_stream_check.py
st cupy-capture python3 examples/cupy_capture_free.py
st torch-graph python3 examples/torch_graph.py
st oom python3 examples/oom_check.py
st oom-spill python3 examples/oom_spill.py
cuda_inc=$(dirname "$(command -v nvcc)")/../include
if cc -O2 -I include -I "$cuda_inc" examples/c/threads.c -L gpu-bundle -lcuarena -lcuda -lpthread -o /tmp/threads 2>$O/c-build.log; then
  st c env LD_LIBRARY_PATH=gpu-bundle /tmp/threads
fi
if cc -O2 -I include -I "$cuda_inc" examples/c/exit_race.c -L gpu-bundle -lcuarena -lcuda -lpthread -o /tmp/exit_race 2>>$O/c-build.log; then
  for i in 1 2 3; do st exit-race-$i env LD_LIBRARY_PATH=gpu-bundle /tmp/exit_race; done
fi
grep -E "corrupt|mismatch|FAIL|OOM:" $O/*.log | cut -c1-300 | head -20 >> $O/summary.txt
cat $O/summary.txt
