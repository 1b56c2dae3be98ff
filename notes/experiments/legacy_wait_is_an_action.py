"""Does cuStreamWaitEvent on the legacy stream, on an event that completed long ago, act as a
legacy-stream *action* for CUDA's implicit synchronisation? The CUDA stream-sync-behaviour page
says an action "such as a kernel launch or cudaStreamWaitEvent()" in the legacy stream first
waits on all blocking streams, and then all blocking streams wait on it.

K1 spins 2 ms on blocking stream A; then (mode) something on the legacy stream; then K2 on
blocking stream B records its start time. K2 ordered after K1 iff K2's start >= K1's end.
Modes: none (expected concurrent), record (cuEventRecord on legacy: known to order),
wait_done (cuStreamWaitEvent(legacy, event completed long ago): the question).
Blocking streams: user streams made without the non-blocking flag, and per-thread default
streams of two host threads."""
import threading, sys
import cupy as cp

spin = cp.RawKernel(r'''
extern "C" __global__ void spin(unsigned long long ns, unsigned long long* out) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  t = t0;
  while (t - t0 < ns) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
  out[0] = t0; out[1] = t;
}''', 'spin')

legacy = cp.cuda.Stream.null
done = cp.cuda.Event(disable_timing=True)
done.record(legacy)
done.synchronize()

def legacy_step(mode):
    if mode == 'wait_done':
        legacy.wait_event(done)
    elif mode == 'record':
        e = cp.cuda.Event(disable_timing=True)
        e.record(legacy)

def trial_streams(mode, a, b):
    o1 = cp.zeros(2, cp.uint64); o2 = cp.zeros(2, cp.uint64)
    cp.cuda.Device().synchronize()
    spin((1,), (1,), (cp.uint64(2_000_000), o1), stream=a)
    legacy_step(mode)
    spin((1,), (1,), (cp.uint64(1000), o2), stream=b)
    cp.cuda.Device().synchronize()
    return int(o2.get()[0]) >= int(o1.get()[1])

def trial_ptds(mode):
    o1 = cp.zeros(2, cp.uint64); o2 = cp.zeros(2, cp.uint64)
    cp.cuda.Device().synchronize()
    go = threading.Event(); launched = threading.Event()
    def t1():
        spin((1,), (1,), (cp.uint64(2_000_000), o1), stream=cp.cuda.Stream.ptds)
        launched.set()
    def t2():
        launched.wait()
        legacy_step(mode)
        spin((1,), (1,), (cp.uint64(1000), o2), stream=cp.cuda.Stream.ptds)
    th = [threading.Thread(target=t1), threading.Thread(target=t2)]
    [t.start() for t in th]; [t.join() for t in th]
    cp.cuda.Device().synchronize()
    return int(o2.get()[0]) >= int(o1.get()[1])

a = cp.cuda.Stream(non_blocking=False); b = cp.cuda.Stream(non_blocking=False)
na = cp.cuda.Stream(non_blocking=True); nb = cp.cuda.Stream(non_blocking=True)
N = 20
for mode in ('none', 'record', 'wait_done'):
    ordered = sum(trial_streams(mode, a, b) for _ in range(N))
    ordered_nb = sum(trial_streams(mode, na, nb) for _ in range(N))
    ordered_ptds = sum(trial_ptds(mode) for _ in range(N))
    print(f"{mode:10} blocking user streams ordered {ordered}/{N}; per-thread streams {ordered_ptds}/{N}; non-blocking (control) {ordered_nb}/{N}")
