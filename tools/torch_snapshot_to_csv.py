#!/usr/bin/env python3
"""Converts a PyTorch memory snapshot to RMM's logging-adaptor CSV, for `cuarena replay --format rmm-csv`.

    python3 tools/torch_snapshot_to_csv.py SNAPSHOT.pickle OUT.csv [--device N]

SNAPSHOT.pickle is what torch.cuda.memory._dump_snapshot(path) writes (the pickle of
torch.cuda.memory._snapshot(), taken after torch.cuda.memory._record_memory_history()). Its
`device_traces` holds, per device, a list of events: dicts with `action`, `addr`, `size`, `stream`
and (torch >= 2.1) `time_us`. `alloc` becomes `allocate`; `free_requested` (the program's free)
becomes `free` (`free_completed`, the caching allocator's later release, is used only if the
trace has no `free_requested` at all); segment and other events are skipped. The snapshot names
no threads: every event is thread 0. Without `time_us`, the event's index is the time (order
kept). Stream 0 is the legacy stream. Needs only Python's pickle (no torch).
"""
import argparse
import pickle
import sys


def convert(snapshot, device=None):
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list):
        raise ValueError("not a PyTorch memory snapshot: no `device_traces` list "
                         "(record with torch.cuda.memory._record_memory_history() first)")
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    if not 0 <= device < len(traces):
        raise ValueError(f"device {device}: the snapshot has traces for {len(traces)} device(s)")
    events = traces[device]
    actions = {e.get("action") for e in events}
    free_action = "free_requested" if "free_requested" in actions else "free_completed"
    rows, skipped = [], 0
    for i, e in enumerate(events):
        a = e.get("action")
        if a == "alloc":
            act = "allocate"
        elif a == free_action:
            act = "free"
        else:
            skipped += 1
            continue
        t = e.get("time_us")
        secs = (t if t is not None else i) / 1e6
        rows.append(f"0,{secs:.6f},{act},{int(e['addr']):#x},{int(e['size'])},{int(e.get('stream', 0)):#x}")
    return device, rows, skipped


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshot")
    p.add_argument("out")
    p.add_argument("--device", type=int, default=None, help="device index (default: the one with most events)")
    args = p.parse_args()
    try:
        with open(args.snapshot, "rb") as f:
            snap = pickle.load(f)
        device, rows, skipped = convert(snap, args.device)
    except (OSError, pickle.UnpicklingError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.snapshot}: {e}", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n")
        for r in rows:
            f.write(r + "\n")
    print(f"device {device}: {len(rows)} events written, {skipped} skipped (segment and other events)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
