"""Which driver calls from another thread break a global-mode capture of a *blocking* stream
(or of the capturing thread's per-thread stream)? Twenty-third session's probe, run on the H200:
    python3 notes/experiments/s23_blocking_capture_probe.py
Each row: one capture begun on thread A, one operation made on thread B (in the relaxed capture
mode, as cuarena's calls are, or in the default global mode), then A ends the capture: the row
shows the operation's result and whether cuStreamEndCapture succeeded."""
import ctypes, threading

cu = ctypes.CDLL("libcuda.so.1")
def ck(name, r):
    if r != 0:
        raise RuntimeError(f"{name} -> {r}")
ck("cuInit", cu.cuInit(0))
dev = ctypes.c_int()
ck("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
ctx = ctypes.c_void_p()
ck("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
LEGACY, PTDS = ctypes.c_void_p(1), ctypes.c_void_p(2)
GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2

def cur():
    ck("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))

cur()
buf = ctypes.c_uint64()
ck("cuMemAlloc", cu.cuMemAlloc_v2(ctypes.byref(buf), 1 << 20))

def new_stream(flags):
    s = ctypes.c_void_p()
    ck("cuStreamCreate", cu.cuStreamCreate(ctypes.byref(s), flags))
    return s

def new_event():
    e = ctypes.c_void_p()
    ck("cuEventCreate", cu.cuEventCreate(ctypes.byref(e), 2))  # disable timing
    return e

side = new_stream(1)  # thread B's own non-blocking stream

def op_list():
    e = new_event()
    ck("cuEventRecord", cu.cuEventRecord(e, side))
    st = ctypes.c_int()
    sid = ctypes.c_ulonglong()
    p = ctypes.c_uint64()
    return [
        ("cuStreamIsCapturing(legacy)", lambda: cu.cuStreamIsCapturing(LEGACY, ctypes.byref(st))),
        ("cuStreamGetId(legacy)", lambda: cu.cuStreamGetId(LEGACY, ctypes.byref(sid))),
        ("cuEventRecord(legacy)", lambda: cu.cuEventRecord(e, LEGACY)),
        ("cuStreamWaitEvent(legacy)", lambda: cu.cuStreamWaitEvent(LEGACY, e, 0)),
        ("cuStreamIsCapturing(ptds of B)", lambda: cu.cuStreamIsCapturing(PTDS, ctypes.byref(st))),
        ("cuStreamGetId(ptds of B)", lambda: cu.cuStreamGetId(PTDS, ctypes.byref(sid))),
        ("cuEventRecord(ptds of B)", lambda: cu.cuEventRecord(e, PTDS)),
        ("cuStreamWaitEvent(ptds of B)", lambda: cu.cuStreamWaitEvent(PTDS, e, 0)),
        ("cuEventRecord(B's non-blocking)", lambda: cu.cuEventRecord(e, side)),
        ("cuEventQuery", lambda: cu.cuEventQuery(e)),
        ("cuEventSynchronize", lambda: cu.cuEventSynchronize(e)),
        ("cuStreamSynchronize(B's non-blocking)", lambda: cu.cuStreamSynchronize(side)),
        ("cuStreamSynchronize(ptds of B)", lambda: cu.cuStreamSynchronize(PTDS)),
        ("cuMemAlloc+cuMemFree", lambda: cu.cuMemAlloc_v2(ctypes.byref(p), 1 << 20) or cu.cuMemFree_v2(p)),
        ("cuMemsetD8Async(ptds of B)", lambda: cu.cuMemsetD8Async(buf, 1, 4096, PTDS)),
        ("cuCtxSynchronize", lambda: cu.cuCtxSynchronize()),
    ]

def run(captured_kind, b_mode, name, fn):
    res = {}
    go, done = threading.Event(), threading.Event()

    def a():
        cur()
        s = PTDS if captured_kind == "ptds of A" else new_stream(0 if captured_kind == "blocking" else 1)
        ck("begin", cu.cuStreamBeginCapture_v2(s, GLOBAL))
        ck("memset", cu.cuMemsetD8Async(buf, 7, 1 << 20, s))
        go.set()
        done.wait()
        g = ctypes.c_void_p()
        res["end"] = cu.cuStreamEndCapture(s, ctypes.byref(g))
        if res["end"] == 0:
            cu.cuGraphDestroy(g)
        if captured_kind != "ptds of A":
            cu.cuStreamDestroy_v2(s)

    def b():
        cur()
        m = ctypes.c_int(b_mode)
        cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
        go.wait()
        res["op"] = fn()
        m2 = ctypes.c_int(m.value)
        cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(m2))
        done.set()

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(); tb.start(); ta.join(); tb.join()
    cu.cuCtxSynchronize()
    return res

print(f"{'captured stream':12} {'B mode':8} {'operation on thread B':40} {'op rc':>6} {'end rc':>7}")
for kind in ["blocking", "ptds of A", "non-blocking"]:
    for bm, bname in [(RELAXED, "relaxed"), (GLOBAL, "global")]:
        for name, fn in op_list():
            r = run(kind, bm, name, fn)
            flag = "" if r["end"] == 0 else "   <- capture broken"
            print(f"{kind:12} {bname:8} {name:40} {r['op']:>6} {r['end']:>7}{flag}", flush=True)
