#!/usr/bin/env python3
"""What one proxy-wasm hostcall of each kind costs Envoy (V8), measured with the floor filter.

The floor filter (benches/floor-filter) sets one response header per request; configured
`kind=N` it also makes N hostcalls of one kind per request, where a plugin would make them. Each
configuration runs in one Envoy (`--concurrency 1`), 1-token streams from the mock at 16
connections, and Envoy's own CPU per request is read from /proc. The cost of one call is
(CPU per request with N calls − CPU per request of the floor) / N; the cost of being a wasm filter
at all (its callbacks' crossings into the VM) is floor − no filter. Rounds are interleaved and each
figure is the median over the rounds, so a slow drift of the machine touches every row alike.

These are the units sluice's plugins' per-request costs are made of: `cargo run --release -p
sluice-host --example profile` counts each plugin's callbacks and hostcalls per request.

Then, with no traffic: Envoy's CPU over 10 idle seconds (after a warm-up) with the floor filter
alone and with a root tick every 20 and every 100 ms that does nothing — what a timer costs a
worker, divided by the ticks it fired.

Usage: benches/envoy_hostcalls.py [--calls N] [--seconds S] [--rounds R] [--only kind,kind]
(needs what benches/envoy_load.py needs; `cargo xtask bench` provides it).
"""

import argparse
import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

import envoy_load as load

ROOT = load.ROOT
KINDS = ["get_header", "get_headers", "now", "get_property", "set_property", "counter", "histogram",
         "shared_get", "shared_set"]
WHAT = {
    "get_header": "one request header by name",
    "get_headers": "all request headers in one call",
    "now": "the current time",
    "get_property": "a stream property (request.path)",
    "set_property": "a filter-state write",
    "counter": "a counter increment",
    "histogram": "a histogram sample",
    "shared_get": "a shared-data read",
    "shared_set": "a shared-data write",
}


@contextlib.contextmanager
def warm_envoy(template, floor_config, mock_port, tmp):
    """One Envoy (`--concurrency 1`) with `template` rendered for the floor filter, warmed up
    (connections, VM, JIT); yields its pid and port, stops it afterwards."""
    port, admin = load.free_port(), load.free_port()
    path = Path(tmp) / "envoy.yaml"
    path.write_text(load.render(template, {
        "LISTEN_PORT": str(port), "ADMIN_PORT": str(admin), "UPSTREAM_PORT": str(mock_port),
        "WASM_DIR": str(load.WASM_DIR), "FLOOR_CONFIG": floor_config}))
    envoy = subprocess.Popen([load.ENVOY, "-c", str(path), "--concurrency", "1", "--log-level", "error",
                              "--base-id", str(os.getpid() % 10000 + 900)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        load.wait_port(port)
        load.wrk(port, 1, 1, 1, tmp)
        yield envoy.pid, port
    finally:
        envoy.terminate()
        envoy.wait()


def cpu_per_request(template, floor_config, mock_port, seconds, tmp):
    with warm_envoy(template, floor_config, mock_port, tmp) as (pid, port):
        before = load.cpu_seconds(pid)
        _, _, total = load.wrk(port, 1, 16, seconds, tmp)
        return (load.cpu_seconds(pid) - before) * 1e6 / max(total, 1)


IDLE_S = 10


def idle_cpu(template, floor_config, mock_port, tmp):
    """Envoy's CPU share of one core over IDLE_S seconds with no traffic, after a warm-up."""
    with warm_envoy(template, floor_config, mock_port, tmp) as (pid, _):
        time.sleep(1)
        before = load.cpu_seconds(pid)
        time.sleep(IDLE_S)
        return (load.cpu_seconds(pid) - before) / IDLE_S


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=32, help="hostcalls of the kind per request")
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated kinds (default: all)")
    args = ap.parse_args()
    kinds = [k for k in args.only.split(",") if k] or KINDS
    none = (ROOT / "envoy/bench/none.yaml").read_text()
    floor = (ROOT / "envoy/bench/floor.yaml").read_text()
    runs = [("no filter", none, ""), ("floor", floor, "")] + [(k, floor, f"{k}={args.calls}") for k in kinds]
    figures = {}
    idle = {}
    ticks = [("floor, no tick", ""), ("tick every 100 ms", "tick=100"), ("tick every 20 ms", "tick=20")]
    with tempfile.TemporaryDirectory() as tmp:
        mock_port = load.free_port()
        mock = subprocess.Popen([str(load.MOCK), "--listen", f"127.0.0.1:{mock_port}"], stdout=subprocess.DEVNULL)
        try:
            load.wait_port(mock_port)
            for _ in range(args.rounds):
                for name, template, config in runs:
                    figures.setdefault(name, []).append(cpu_per_request(template, config, mock_port, args.seconds, tmp))
                    time.sleep(0.2)
                for name, config in ticks:
                    idle.setdefault(name, []).append(idle_cpu(floor, config, mock_port, tmp))
        finally:
            mock.terminate()
            mock.wait()
    cpu = {name: load.median(values) for name, values in figures.items()}
    print(f"\n{'row':<14} {'Envoy CPU µs/req':>17} {'µs per call':>12}   what")
    print(f"{'no filter':<14} {cpu['no filter']:>17.1f} {'':>12}")
    print(f"{'floor':<14} {cpu['floor']:>17.1f} {cpu['floor'] - cpu['no filter']:>12.2f}   "
          "being a wasm filter: its callbacks per request, one header set")
    for kind in kinds:
        per_call = (cpu[kind] - cpu["floor"]) / args.calls
        print(f"{kind:<14} {cpu[kind]:>17.1f} {per_call:>12.3f}   {WHAT[kind]} (×{args.calls} per request)")
    print(f"\n{args.rounds} round(s) of {args.seconds} s, medians; Envoy --concurrency 1, 1-token streams, 16 connections.")
    base = load.median(idle["floor, no tick"])
    print(f"\n{'idle, no traffic':<20} {'% of a core':>12} {'µs per tick':>12}")
    for (name, config), per_s in zip(ticks, (1, 10, 50)):
        share = load.median(idle[name])
        per_tick = "" if not config else f"{(share - base) * 1e6 / per_s:.1f}"
        print(f"{name:<20} {share * 100:>11.2f} % {per_tick:>12}")
    print(f"({IDLE_S} idle s after a warm-up, medians of {args.rounds}; /proc counts CPU in 10 ms ticks: ± 0.1 % of a core)")


if __name__ == "__main__":
    main()
