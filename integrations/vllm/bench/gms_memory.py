"""What sharing the weights through gmsd saves a vLLM pair on the CPU, and
what it costs in tokens/s (docs/vllm.md, "Weights through gmsd").

For each arm, two vLLM engines (vLLM's ``LLM`` in its own process group:
the engine's process, EngineCore, the worker) start one after the other on
the same model, each decodes the same prompt greedily and reports its
tokens/s, and both stay up while the memory of each engine's processes is
summed from /proc/PID/smaps_rollup (PSS, private, RSS), with gmsd's. Arms:

- ``auto``: vLLM's own loader (each engine reads the checkpoint);
- ``gms0``: ``--load-format gms`` with SHADOW_VLLM_REPACK=0 (the default);
- ``gms1``: ``--load-format gms`` with SHADOW_VLLM_REPACK=1.

    python integrations/vllm/bench/gms_memory.py --model target/vllm-model \
        [--arms auto,gms0,gms1] [--tokens 128] [--runs 3] [--out FILE.json]

The figures of docs/vllm.md use a model of 312 MiB, where the weights
stand out of each engine's gigabytes (the tests' model has 7 MB):

    target/vllm-venv/bin/python -m shadow_vllm.tiny_model \
        target/vllm-model-312m --hidden 1024 --layers 8

Needs gmsd and libgms.so (GMSD, GMS_LIB, else target/release). Runs at
most two vLLM engines at once, and ends every process it started.
"""

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[3]
# An engine's start and decode, at most (minutes beside busy engines).
ENGINE_LIMIT_S = 900
PROMPT = "The quick brown fox jumps over the lazy dog near the quiet riverbank."


def engine(args):
    """One engine: load, decode ``runs`` times, print a JSON line, hold."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, enforce_eager=True,
              max_model_len=512, seed=0)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([PROMPT], sp, use_tqdm=False)  # warm-up
    rates, tokens = [], None
    for _ in range(args.runs):
        t = time.perf_counter()
        out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
        rates.append(len(out.token_ids) / (time.perf_counter() - t))
        if tokens is not None and list(out.token_ids) != tokens:
            raise SystemExit("greedy output changed between two runs of one engine")
        tokens = list(out.token_ids)
    with open(args.result + ".tmp", "w") as f:
        json.dump({"tok_s": statistics.median(rates), "rates": rates, "tokens": tokens, "start_s": start_s}, f)
    os.rename(args.result + ".tmp", args.result)
    sys.stdin.readline()


def rollup(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    out[parts[0][:-1]] = int(parts[1]) * 1024
    except OSError:
        return None
    return out


def group(pgid):
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def memory(pids):
    tot = {"pss": 0, "private": 0, "rss": 0, "processes": 0}
    for pid in pids:
        r = rollup(pid)
        if r is None:
            continue
        tot["pss"] += r.get("Pss", 0)
        tot["private"] += r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)
        tot["rss"] += r.get("Rss", 0)
        tot["processes"] += 1
    return tot


def built(name, var):
    return os.environ.get(var) or str(REPO / "target" / "release" / name)


def start_engine(model, fmt, tokens, runs, env, log_path):
    """Starts an engine (stdout and stderr to log_path) and waits for its
    figures (in log_path + ".json")."""
    result = log_path + ".json"
    if os.path.exists(result):
        os.unlink(result)
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, __file__, "engine", "--model", model, "--load-format", fmt,
                              "--tokens", str(tokens), "--runs", str(runs), "--result", result],
                             stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                             text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + ENGINE_LIMIT_S
    while p.poll() is None and time.monotonic() < deadline:
        if os.path.exists(result):
            with open(result) as f:
                return p, json.load(f)
        time.sleep(0.1)
    with open(log_path) as f:
        tail = f.read()[-3000:]
    if p.poll() is None:
        stop(p)
        raise RuntimeError(f"engine ({fmt}) did not decode within {ENGINE_LIMIT_S} s; {log_path}:\n{tail}")
    raise RuntimeError(f"engine ({fmt}) exited {p.returncode} before decoding; {log_path}:\n{tail}")


def settled(pgids, limit_s=60, step_s=0.25):
    """Waits until the engines' memory stops moving: two readings of their
    summed RSS, ``step_s`` apart, within 1 MiB of each other (an engine
    that wrote its figures may still be freeing its warm-up's buffers).
    Returns False if it still moved after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    last = None
    while time.monotonic() < deadline:
        now = sum(memory(group(g))["rss"] for g in pgids)
        if last is not None and abs(now - last) < (1 << 20):
            return True
        last = now
        time.sleep(step_s)
    return False


def wait_for_socket(path, proc, limit_s=30):
    """Waits until gmsd's socket exists (it is listening then)."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gmsd did not come up at {path} (exit {proc.poll()})")
        time.sleep(0.02)


def stop(p):
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def arm(name, args):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    fmt, gmsd, tmp = "auto", None, None
    if name.startswith("gms"):
        fmt = "gms"
        tmp = tempfile.TemporaryDirectory(prefix="gms-memory-")
        sock_dir = os.path.join(tmp.name, "gms")
        gmsd = subprocess.Popen([built("gmsd", "GMSD"), "serve", "--device", "host", "--socket-dir", sock_dir,
                                 "--log-level", "warn"], stdout=subprocess.DEVNULL)
        env.update(GMS_SOCKET_DIR=sock_dir, GMS_LIB=built("libgms.so", "GMS_LIB"),
                   SHADOW_VLLM_REPACK=name[3:])
    engines = []
    try:
        if gmsd is not None:
            wait_for_socket(os.path.join(sock_dir, "gms-host.sock"), gmsd)
        for i in range(2):
            log = os.path.join(args.logs, f"{name}-{i}.log")
            engines.append(start_engine(args.model, fmt, args.tokens, args.runs, env, log))
        if not settled([p.pid for p, _ in engines]):
            print(f"{name}: the engines' memory still moved after 60 s; measured as it is", file=sys.stderr)
        result = {"arm": name, "engines": []}
        for p, report in engines:
            result["engines"].append(dict(report, memory=memory(group(p.pid))))
        if gmsd is not None:
            result["gmsd"] = memory([gmsd.pid])
        return result
    finally:
        for p, _ in engines:
            stop(p)
        if gmsd is not None:
            gmsd.send_signal(signal.SIGTERM)
            gmsd.wait(timeout=30)
            tmp.cleanup()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", nargs="?", default="bench", choices=["bench", "engine"])
    ap.add_argument("--model", default=str(REPO / "target" / "vllm-model"))
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--arms", default="auto,gms0,gms1")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--result", help="(engine) where its figures go")
    ap.add_argument("--logs", default=tempfile.gettempdir(), help="where each engine's stderr goes")
    args = ap.parse_args()
    if args.role == "engine":
        return engine(args)
    results = []
    for a in args.arms.split(","):
        results.append(arm(a, args))
        print(json.dumps({k: v for k, v in results[-1].items()}), flush=True)
    mib = 1 << 20
    print(f"{'arm':6} {'engine':>6} {'tok/s':>7} {'PSS MiB':>8} {'private':>8} {'RSS':>8}  same tokens")
    first = results[0]["engines"][0]["tokens"]
    for r in results:
        for i, e in enumerate(r["engines"]):
            m = e["memory"]
            print(f"{r['arm']:6} {i:>6} {e['tok_s']:7.1f} {m['pss'] / mib:8.0f} {m['private'] / mib:8.0f} "
                  f"{m['rss'] / mib:8.0f}  {e['tokens'] == first}")
        if "gmsd" in r:
            g = r["gmsd"]
            print(f"{r['arm']:6} {'gmsd':>6} {'':7} {g['pss'] / mib:8.0f} {g['private'] / mib:8.0f} {g['rss'] / mib:8.0f}")
        pair = sum(e["memory"]["pss"] for e in r["engines"]) + r.get("gmsd", {}).get("pss", 0)
        print(f"{r['arm']:6} {'pair':>6} {'':7} {pair / mib:8.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
