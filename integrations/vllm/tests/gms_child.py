"""One engine's side of the loader tests (test_loader.py), as its own
process: a lease is a process's, and a reader must map the writer's
addresses in a fresh address space.

``python gms_child.py ROLE [CHECKPOINT]`` prints one JSON line, then waits
for a line on stdin (so that the test holds two engines at once) unless
the role ends on its own:

- write CHECKPOINT: loads the checkpoint, publishes and commits it;
- read: maps the committed weights (no checkpoint given);
- die: copies weights into an allocation, then SIGKILLs itself before commit;
- poke: maps the committed weights and writes into a large one.
"""

import hashlib
import json
import os
import signal
import sys

import torch

from shadow_gms.client import Gms
from shadow_vllm import loader


class Tagged(torch.nn.Parameter):
    """A parameter class of its own with attributes, as vLLM's are."""


class Toy(torch.nn.Module):
    """A large weight (shared), a small one and a buffer (private copies)."""

    def __init__(self, device=None):
        super().__init__()
        self.proj = torch.nn.Linear(1024, 512, bias=False, device=device)
        self.norm = Tagged(torch.empty(512, device=device), requires_grad=False)
        self.norm.loader_hint = "kept"
        self.register_buffer("scale", torch.empty((), device=device))


def digest(t):
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def mapping_of(addr):
    """The permissions and path of the /proc/self/maps line holding addr."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[1], parts[5] if len(parts) > 5 else ""
    return None, None


def report(gms, model, **extra):
    out = {"lease": gms.lease, "pid": os.getpid()}
    out["tensors"] = {n: digest(t) for n, t in model.state_dict().items()}
    out["maps"] = {n: mapping_of(t.data_ptr())[0] for n, t in model.state_dict().items()}
    out["norm_kept"] = [type(model.norm).__name__, getattr(model.norm, "loader_hint", None)]
    out.update(extra)
    print(json.dumps(out), flush=True)


def main(role, checkpoint=None):
    gms = Gms(mode="rw_or_ro", client=f"test-{role}", device="host", timeout_s=20)
    if role == "write":
        model = Toy()
        model.load_state_dict(torch.load(checkpoint))
        gms.publish_module(model)
        loader.privatize_small(model)
        report(gms, model)
    elif role in ("read", "poke"):
        model = Toy(device="meta")
        gms.load_module(model)
        loader._no_meta_left(model)
        check = gms.verify_weights()
        copied = loader.privatize_small(model)
        if role == "poke":
            model.scale.fill_(2.0)  # a private copy: writable, this process's only
            print(json.dumps({"lease": gms.lease, "small_written": model.scale.item()}), flush=True)
            with torch.no_grad():
                model.proj.weight.add_(1.0)
            print(json.dumps({"survived": True}), flush=True)
            return
        report(gms, model, check=check, copied=list(copied))
    elif role == "die":
        ptr = gms.allocate(4 << 20)
        gms.tensor_at(ptr, torch.float32, (1 << 20,)).fill_(7.0)
        print(json.dumps({"lease": gms.lease, "allocated": ptr}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.readline()


if __name__ == "__main__":
    main(*sys.argv[1:])
