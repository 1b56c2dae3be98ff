"""Session 34: where cuarena's driver calls go in examples/torch_train.py's eager loop. Runs the
same model, data and steps as torch_train.py with the cuarena shim, and prints every counter of
cuarena.stats() that changed between the end of step 10 (warm-up) and the end, per step."""
import json, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import torch
import cuarena
import cuarena.torch

cuarena.torch.use()
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.use_deterministic_algorithms(True, warn_only=True)
dev = torch.device("cuda")
layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=4), torch.nn.Linear(256, 10)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator(device="cpu").manual_seed(1)
steps = int(os.environ.get("STEPS", "300"))
snap = None
for step in range(steps):
    seq = 16 + (step * 7) % 48
    batch = 8 + (step * 5) % 24
    x = torch.randn(batch, seq, 256, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    loss = torch.nn.functional.cross_entropy(model(x).mean(dim=1), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    loss.item()
    if step == 9:
        snap = cuarena.stats()
end = cuarena.stats()
n = steps - 10
print(json.dumps({"per_step_after_10": {k: round((end[k] - snap[k]) / n, 2) for k in end if end[k] != snap[k]},
                  "end": end}))
