"""Records a PyTorch memory snapshot of a short training run with PyTorch's native caching
allocator, for `cuarena replay` (issue 11):

    python3 examples/torch_snapshot_train.py /tmp/train_snapshot.pickle [--steps 200]
    python3 tools/torch_snapshot_to_csv.py /tmp/train_snapshot.pickle /tmp/train_snapshot.csv
    ./cuarena replay /tmp/train_snapshot.csv --format rmm-csv

It turns on torch.cuda.memory._record_memory_history(), trains a small transformer encoder on
random data of varying shapes (the same model as examples/torch_train.py), and dumps
torch.cuda.memory._snapshot() with torch.cuda.memory._dump_snapshot(). Prints one line with the
number of trace events."""
import argparse

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--max-entries", type=int, default=1_000_000)
args = p.parse_args()

import torch

dev = torch.device("cuda")
torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=4), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    seq = 16 + (step * 7) % 48  # varying shapes exercise many block sizes
    batch = 8 + (step * 5) % 56
    x = torch.randn(batch, seq, 256, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    loss = torch.nn.functional.cross_entropy(model(x).mean(dim=1), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._dump_snapshot(args.out)
torch.cuda.memory._record_memory_history(enabled=None)
events = sum(len(t) for t in snap["device_traces"])
print(f"{args.out}: {events} trace events over {len(snap['device_traces'])} device(s), {args.steps} steps")
