"""One engine's side of the loader tests (test_loader.py), as its own
process: a lease is a process's, and a reader must map the writer's
addresses in a fresh address space.

``python gms_child.py ROLE [CHECKPOINT] [--device host|N]`` prints one JSON
line, then waits for a line on stdin (so that the test holds two engines at
once) unless the role ends on its own. Writer and reader run the loader's
GMS part (``loader.load_through_gms``) on the host backend (default) or on
CUDA device N, where the GPU tests (tests/gpu/run.py) run it:

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
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def mapping_of(addr):
    """The permissions and path of the /proc/self/maps line holding addr."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[1], parts[5] if len(parts) > 5 else ""
    return None, None


def report(gms, model, facts, **extra):
    out = {"lease": gms.lease, "pid": os.getpid()}
    state = model.state_dict()
    out["tensors"] = {n: digest(t) for n, t in state.items()}
    out["maps"] = {n: mapping_of(t.data_ptr())[0] for n, t in state.items()}
    # Where each tensor is, and which are the committed copy itself.
    committed = {n: t.data_ptr() for n, t in gms.tensors().items()}
    out["ptrs"] = {n: t.data_ptr() for n, t in state.items()}
    out["shared"] = sorted(n for n, t in state.items() if committed.get(n) == t.data_ptr())
    out["devices"] = sorted({t.device.type for t in state.values()})
    out["norm_kept"] = [type(model.norm).__name__, getattr(model.norm, "loader_hint", None)]
    with torch.no_grad():
        x = torch.linspace(-1, 1, 1024, device=model.norm.device)
        out["output"] = digest(model.proj(x) * model.norm * model.scale)
    out["check"] = facts.get("checked")
    out["copied"] = list(facts["private"])
    out.update(extra)
    print(json.dumps(out), flush=True)


def main(role, *args):
    args = list(args)
    where = "host"
    if "--device" in args:
        i = args.index("--device")
        where = args[i + 1]
        del args[i:i + 2]
    checkpoint = args[0] if args else None
    target = torch.device("cpu") if where == "host" else torch.device("cuda", int(where))
    if target.type == "cuda":
        torch.cuda.set_device(target)
    gms = Gms(mode="rw_or_ro", client=f"test-{role}", device=loader.gms_device(target), timeout_s=20)
    if role in ("write", "read", "poke"):
        def load(m):
            m.load_state_dict(torch.load(checkpoint))

        model, facts = loader.load_through_gms(gms, Toy, load, target)
        if role == "poke":
            model.scale.fill_(2.0)  # a private copy: writable, this process's only
            print(json.dumps({"lease": gms.lease, "small_written": model.scale.item()}), flush=True)
            with torch.no_grad():
                model.proj.weight.add_(1.0)
            print(json.dumps({"survived": True}), flush=True)
            return
        report(gms, model, facts)
    elif role == "die":
        ptr = gms.allocate(4 << 20)
        gms.tensor_at(ptr, torch.float32, (1 << 20,)).fill_(7.0)
        print(json.dumps({"lease": gms.lease, "allocated": ptr}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.readline()


if __name__ == "__main__":
    main(*sys.argv[1:])
