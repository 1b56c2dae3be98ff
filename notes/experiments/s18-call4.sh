#!/usr/bin/env bash
# Session 18, call 4: the record_stream refusal through PyTorch at shim level 0 (the hook set
# from Python on PyTorch's plug-in, std::runtime_error), with CUARENA_TORCH_SHIM naming a shim
# built without PyTorch's headers; then the same test at level 2 again.
set -u
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/out}; mkdir -p $O
export CUARENA_LIB=$PWD/gpu-bundle/libcuarena.so PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/cuarena-cache PYTHONPATH=$PWD/python
plain=$(python3 -c 'import cuarena.torch as t; print(t.shim_path())')
echo "plain shim $plain level $(python3 -c 'import ctypes,sys; print(ctypes.CDLL(sys.argv[1]).cuarena_torch_shim_level())' $plain)" >> $O/summary.txt
cd python/tests
T=test_cuarena.Frameworks.test_torch_record_stream_past_the_caps_raises_and_foreign_memory_is_skipped
CUARENA_TORCH_SHIM=$plain CUARENA_REQUIRE_GPU=1 python3 -m unittest -v $T > $O/level0.log 2>&1; echo "level 0 rc=$? $(tail -1 $O/level0.log)" >> $O/summary.txt
CUARENA_TORCH_SHIM=$plain python3 -W always -c '
import torch, cuarena.torch as ct
i = ct.use(); print("level-0 install", i)
t = torch.ones(8, device="cuda"); s = torch.cuda.Stream(); t.record_stream(s); del t; torch.cuda.synchronize(); print("level-0 record_stream ok")
' >> $O/summary.txt 2>&1
CUARENA_REQUIRE_GPU=1 python3 -m unittest -v $T > $O/level2.log 2>&1; echo "level 2 rc=$? $(tail -1 $O/level2.log)" >> $O/summary.txt
