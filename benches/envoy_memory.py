#!/usr/bin/env python3
"""What the full chain costs Envoy in memory and VMs, side by side in one run: Envoy with no filter,
with the trivial wasm filter (what any wasm filter costs), the full gateway as shipped (two
sluice.wasm filters with one vm_id: one VM per worker), the same file with a vm_id per filter (the
same code, the sharing undone), and, with --before DIR REF, the full gateway of git revision REF
with the .wasm files of DIR (an earlier build, e.g. four different modules, four VMs per worker).

For each configuration: Envoy --concurrency 4 (loopback only) starts, serves WARM streamed chat
requests (so every worker has built its VMs' contexts), then idles a second; then its resident
set (VmRSS from /proc), Envoy's own `server.memory_allocated` and `server.memory_heap_size`, and
the active V8 VMs (`wasm.envoy.wasm.runtime.v8.active`) are read. Each configuration is measured
ROUNDS times, interleaved, and the median is printed.

Usage: benches/envoy_memory.py [--rounds N] [--before DIR REF]   (needs what benches/envoy_load.py needs)
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envoy_load as load  # noqa: E402  (ports, rendering: one implementation)
import envoy_streams as streams  # noqa: E402  (the bench's guard policy)

ROOT = load.ROOT
CONCURRENCY = 4
WARM = 40


def separate_vms(template):
    """The template with a vm_id of its own for each sluice filter (the code stays the same)."""
    count = iter(range(1, 100))
    return re.sub(r"vm_id: sluice\b", lambda _: f"vm_id: sluice_{next(count)}", template)


def admin_stats(admin):
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?format=json", timeout=5).read()
    stats = {s["name"]: s.get("value") for s in json.loads(text)["stats"] if "name" in s}
    return stats


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(template, wasm_dir, policies, mock_port, tmp):
    port, admin = load.free_port(), load.free_port()
    path = Path(tmp) / "envoy.yaml"
    path.write_text(load.render(template, dict(policies, **{
        "LISTEN_PORT": str(port), "ADMIN_PORT": str(admin), "UPSTREAM_PORT": str(mock_port),
        "UPSTREAM_PORT_V2": str(mock_port), "SHADOW_PORT": str(mock_port), "WASM_DIR": str(wasm_dir),
        "ACCESS_LOG": "/dev/null", "FLOOR_CONFIG": "", "LEDGER_PORT": "1"})))
    envoy = subprocess.Popen([load.ENVOY, "-c", str(path), "--concurrency", str(CONCURRENCY), "--log-level", "error",
                              "--base-id", str(os.getpid() % 10000 + 900)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        load.wait_port(port)
        load.wait_port(admin)
        body = json.dumps({"model": "llama-3-70b", "stream": True, "messages": [{"role": "user", "content": "Say hello."}]}).encode()
        for i in range(WARM):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={
                "content-type": "application/json", "x-mock-tokens": "8", "x-mock-ttft-ms": "0", "x-mock-itl-ms": "0",
                "x-sluice-tenant": "acme", "x-sluice-key": "search-prod", "x-request-id": f"mem-{i}"})
            urllib.request.urlopen(req, timeout=10).read()
        time.sleep(1.0)
        stats = admin_stats(admin)
        return {
            "rss": rss_mib(envoy.pid),
            "allocated": (stats.get("server.memory_allocated") or 0) / 2**20,
            "heap": (stats.get("server.memory_heap_size") or 0) / 2**20,
            "vms": stats.get("wasm.envoy.wasm.runtime.v8.active"),
        }
    finally:
        envoy.terminate()
        envoy.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", nargs=2, metavar=("DIR", "REF"), help="earlier .wasm files and the git revision of their templates")
    args = ap.parse_args()
    full = (ROOT / "envoy/templates/full-gateway.yaml").read_text()
    configs = [
        ("no filter", (ROOT / "envoy/bench/none.yaml").read_text(), load.WASM_DIR),
        ("trivial wasm filter", (ROOT / "envoy/bench/floor.yaml").read_text(), load.WASM_DIR),
        ("full chain as shipped (one vm_id)", full, load.WASM_DIR),
        ("full chain, a vm_id per filter", separate_vms(full), load.WASM_DIR),
    ]
    if args.before:
        old = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before[1]}:envoy/templates/full-gateway.yaml"],
                             capture_output=True, text=True, check=True).stdout
        configs.append((f"full chain before ({args.before[1]}: four .wasm)", old, Path(args.before[0])))
    policies = {
        "PLUGIN_CONFIG": load.yaml_string_body((ROOT / "policies/llm-metrics.demo.json").read_text()),
        "BUDGET_CONFIG": load.yaml_string_body((ROOT / "policies/tenant-budget.bench.json").read_text()),
        "ROUTER_CONFIG": load.yaml_string_body(load.router_policy(0.0)),
        "LATENCY_CONFIG": load.yaml_string_body(json.dumps(streams.guard_policy())),
    }
    results = {name: [] for name, _, _ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        mock_port = load.free_port()
        mock = subprocess.Popen([str(load.MOCK), "--listen", f"127.0.0.1:{mock_port}"], stdout=subprocess.DEVNULL)
        try:
            load.wait_port(mock_port)
            for _ in range(args.rounds):
                for name, template, wasm_dir in configs:
                    results[name].append(measure(template, wasm_dir, policies, mock_port, tmp))
        finally:
            mock.terminate()
            mock.wait()
    print(f"\n| configuration | RSS MiB | memory_allocated MiB | heap MiB | V8 VMs |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        med = {k: load.median([r[k] for r in rows]) for k in ("rss", "allocated", "heap", "vms")}
        vms = "—" if med["vms"] is None else f"{med['vms']:.0f}"
        print(f"| {name} | {med['rss']:.0f} | {med['allocated']:.0f} | {med['heap']:.0f} | {vms} |")
    print(f"\nEnvoy --concurrency {CONCURRENCY}, after {WARM} streamed requests and 1 s idle; median of {args.rounds} round(s), interleaved.")


if __name__ == "__main__":
    main()
