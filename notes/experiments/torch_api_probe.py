"""Which PyTorch APIs work with cuarena installed as its allocator (CUDAPluggableAllocator)?
Each probe runs in this one process after cuarena.torch.use(); prints one JSON line per probe:
{"probe": name, "ok": bool, "result" or "error": ...}. Run with --native for the same probes under
PyTorch's own allocator (the control)."""
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import torch

native = "--native" in sys.argv
if not native:
    import cuarena.torch
    inst = cuarena.torch.use()


def probe(name, fn):
    t = time.perf_counter()
    try:
        r = fn()
        out = {"probe": name, "ok": True, "result": repr(r)[:200]}
    except Exception as e:  # noqa: BLE001
        out = {"probe": name, "ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    out["secs"] = round(time.perf_counter() - t, 3)
    print(json.dumps(out), flush=True)


x = torch.randn(1024, 1024, device="cuda")
probe("memory_allocated", lambda: torch.cuda.memory_allocated())
probe("max_memory_allocated", lambda: torch.cuda.max_memory_allocated())
probe("memory_reserved", lambda: torch.cuda.memory_reserved())
probe("max_memory_reserved", lambda: torch.cuda.max_memory_reserved())
probe("memory_stats", lambda: len(torch.cuda.memory_stats()))
probe("reset_peak_memory_stats", lambda: torch.cuda.reset_peak_memory_stats())
probe("reset_accumulated_memory_stats", lambda: torch.cuda.reset_accumulated_memory_stats())
probe("memory_summary", lambda: len(torch.cuda.memory_summary()))
probe("memory_snapshot", lambda: len(torch.cuda.memory_snapshot()))
probe("mem_get_info", lambda: torch.cuda.mem_get_info())
probe("empty_cache", lambda: torch.cuda.empty_cache())
probe("set_per_process_memory_fraction", lambda: torch.cuda.set_per_process_memory_fraction(0.9))
probe("caching_allocator_alloc", lambda: torch.cuda.caching_allocator_delete(torch.cuda.caching_allocator_alloc(4096)))
probe("record_memory_history", lambda: torch.cuda.memory._record_memory_history(max_entries=10))


def conv(benchmark, deterministic=False):
    torch.backends.cudnn.benchmark = benchmark
    torch.backends.cudnn.deterministic = deterministic
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 7, stride=2, padding=3), torch.nn.ReLU(),
                            torch.nn.Conv2d(64, 128, 3, padding=1)).cuda()
    inp = torch.randn(16, 3, 224, 224, device="cuda", requires_grad=True)
    y = m(inp).float().sum()
    y.backward()
    torch.cuda.synchronize()
    return float(y)


probe("cudnn_conv", lambda: conv(False))
probe("cudnn_conv_benchmark", lambda: conv(True))
def conv_fp16():
    with torch.autocast("cuda", dtype=torch.float16):
        return conv(True)


probe("cudnn_conv_benchmark_fp16", conv_fp16)
torch.backends.cudnn.benchmark = False
probe("sdpa", lambda: float(torch.nn.functional.scaled_dot_product_attention(
    *[torch.randn(4, 8, 256, 64, device="cuda", dtype=torch.float16)] * 3).sum()))
probe("cuda_graph", lambda: (lambda g: (g, torch.cuda.synchronize()))(torch.cuda.CUDAGraph()))


def graph_capture():
    s = torch.cuda.Stream()
    a = torch.randn(1000, device="cuda")
    with torch.cuda.stream(s):
        for _ in range(3):
            b = a * 2
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        b = a * 2 + 1
    g.replay()
    torch.cuda.synchronize()
    return float(b.sum() - (a * 2 + 1).sum())


probe("cuda_graph_capture", graph_capture)
probe("mempool", lambda: torch.cuda.MemPool())


def mempool_use():
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = torch.randn(1 << 20, device="cuda")
    r = float(t.sum())
    del t
    del pool
    torch.cuda.synchronize()
    return r


probe("mempool_use", mempool_use)


def graphed_callables():
    lin = torch.nn.Linear(64, 64).cuda()
    g = torch.cuda.make_graphed_callables(lin, (torch.randn(8, 64, device="cuda", requires_grad=True),))
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    g(x).sum().backward()
    torch.cuda.synchronize()
    return float(lin.weight.grad.abs().sum())


probe("make_graphed_callables", graphed_callables)


def compiled(mode):
    f = torch.compile(lambda t: torch.nn.functional.gelu(t) * 2 + 1, mode=mode)
    t = torch.randn(4096, device="cuda")
    r = f(t)
    r = f(t)
    torch.cuda.synchronize()
    return float((r - (torch.nn.functional.gelu(t) * 2 + 1)).abs().max())


probe("torch_compile_default", lambda: compiled(None))
probe("torch_compile_reduce_overhead", lambda: compiled("reduce-overhead"))
probe("tensor_to_cuda1_if_any", lambda: torch.cuda.device_count())
