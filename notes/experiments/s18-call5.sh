#!/usr/bin/env bash
# Session 18, call 5: after helper-17's mend (a cap of 0 limits cacheInfo): the Python package's
# tests with the GPU required, test-ffi, and cacheInfo through real PyTorch at fraction 0
# (cuDNN's benchmark under autocast must not fail).
source "$(dirname "$0")/gpu-checks.sh"
python_checks
rust_tests test-ffi
PYTHONPATH=$PWD/python timeout 120 python3 -c '
import torch, cuarena, cuarena.torch
cuarena.torch.use()
conv = torch.nn.Conv2d(3, 16, 3, padding=1).cuda(); x = torch.randn(8, 3, 64, 64, device="cuda")
torch.backends.cudnn.benchmark = True
with torch.autocast("cuda", dtype=torch.float16): conv(x)
torch.cuda.set_per_process_memory_fraction(0.0)
print("fraction", torch.cuda.get_per_process_memory_fraction())
conv2 = torch.nn.Conv2d(3, 16, 5, padding=2).cuda() if False else None
try:
    with torch.autocast("cuda", dtype=torch.float16): y = torch.nn.functional.conv2d(x.half(), conv.weight.half(), padding=1)
    print("benchmarked conv at fraction 0: ran", tuple(y.shape))
except torch.OutOfMemoryError as e:
    print("benchmarked conv at fraction 0: OutOfMemoryError", str(e)[:160])
torch.cuda.set_per_process_memory_fraction(1.0)
print("fraction", torch.cuda.get_per_process_memory_fraction())
' >> $O/summary.txt 2>&1; echo "cacheInfo rc=$?" >> $O/summary.txt
