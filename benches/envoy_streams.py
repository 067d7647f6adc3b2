#!/usr/bin/env python3
"""Real-time streams through Envoy: what model servers actually do. Each token is its own write, so
each SSE event reaches Envoy as its own read and every filter sees it as its own body callback.

N streams are held open at once (the mock: first token after 100 ms, then one event every 100 ms,
150 events; streams started evenly over the first second), and Envoy's own CPU time (user + system
from /proc) is read over a steady window in which every stream is flowing. Reported per
configuration and N: Envoy's CPU as a share of one core, the events the clients received in the
window, CPU µs per event, and the added µs per event against no filter. Every configuration runs in
this one invocation, one after the other, loopback only, bounded in time (≈ 20 s per row).

Configurations: Envoy with no filter; the trivial wasm filter (one response header); model-router +
tenant-budget + llm-metrics (the full gateway without latency-guard); the full chain; and the same
four policies natively (libsluice.so, envoy/templates/native-full-gateway.yaml; the router without
its shadow, as when these rows were first measured, so that runs compare) beside the wasm full chain
with the same router policy.

With --before DIR the sluice rows also run with the `.wasm` files of DIR (an earlier build), as
"<name> (before)".

With --native-before DIR the native row also runs with the libsluice.so of DIR.

With --injected-usage the clients do not ask for `include_usage`: tenant-budget turns it on
(`"include_usage": true` in its policy), and every event the mock sends then ends in
`"usage":null`, a member the budget cuts from each one before the client sees it (OpenAI's shape).

Usage: benches/envoy_streams.py [--streams 10,1000] [--before DIR] [--native-before DIR] [--injected-usage]
       (needs what benches/envoy_load.py needs)
"""

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envoy_load as load  # noqa: E402  (ports, rendering, /proc CPU: one implementation)

ROOT = load.ROOT
EVENTS = 150
ITL_MS = 100
# The window: from when the last stream has surely started (1 s stagger + first token) to before
# the first one ends (150 × 100 ms).
WINDOW = (3.0, 13.0)
# Seconds of back-to-back 64-token requests before the streams start.
WARM_UP_S = 3


def guard_policy():
    """The demo guard policy with its in-flight limit far above the bench's streams: the guard still
    counts every stream in and out, but sheds none (a shed stream would send no events)."""
    policy = json.loads((ROOT / "policies/latency-guard.demo.json").read_text())
    for version in policy["versions"]:
        if "in_flight" in version:
            version["in_flight"]["limit"] = 1_000_000
    return policy


def without_guard(template):
    """The full gateway's text without its latency-guard filter block."""
    lines = template.splitlines(keepends=True)
    out, skipping = [], False
    for i, line in enumerate(lines):
        if line.startswith("          - name: "):
            block = "".join(lines[i:i + 6])
            skipping = "sluice_latency_guard" in block
        elif not line.startswith("           ") and not line.startswith("          #"):
            skipping = False
        if not skipping:
            out.append(line)
    text = "".join(out)
    assert "sluice_latency_guard" not in text, "the guard's block was not removed"
    return text


# Whether the clients ask for the usage report themselves (--injected-usage: they do not).
CLIENT_ASKS_USAGE = True


async def one_stream(port, i, start_at, counts, clock):
    await asyncio.sleep(max(0.0, start_at - clock()))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = {"model": "llama-3-70b", "stream": True, "messages": [{"role": "user", "content": "Say hello."}]}
    if CLIENT_ASKS_USAGE:
        request["stream_options"] = {"include_usage": True}
    body = json.dumps(request)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"x-mock-tokens: {EVENTS}\r\nx-mock-ttft-ms: {ITL_MS}\r\nx-mock-itl-ms: {ITL_MS}\r\n"
            f"x-sluice-tenant: tenant-{i % 1000}\r\nx-sluice-key: search-prod\r\nx-request-id: stream-{i}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}")
    writer.write(head.encode())
    await writer.drain()
    carry = b""
    while True:
        piece = await reader.read(65536)
        if not piece:
            break
        data = carry + piece
        n = data.count(b"data: ")
        carry = data[-5:]
        n -= carry.count(b"data: ")
        t = clock()
        if WINDOW[0] <= t < WINDOW[1]:
            counts[0] += n
    writer.close()


async def drive(port, streams):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    clock = lambda: loop.time() - t0  # noqa: E731
    counts = [0]
    tasks = [asyncio.create_task(one_stream(port, i, i / streams, counts, clock)) for i in range(streams)]
    await asyncio.gather(*tasks)
    return counts[0]


def measure(envoy_pid, port, streams):
    result = {}

    def sample(at):
        time.sleep(max(0.0, at - (time.time() - started)))
        result[at] = load.cpu_seconds(envoy_pid)

    import threading
    started = time.time()
    samplers = [threading.Thread(target=sample, args=(t,)) for t in WINDOW]
    for s in samplers:
        s.start()
    events = asyncio.run(drive(port, streams))
    for s in samplers:
        s.join()
    cpu = result[WINDOW[1]] - result[WINDOW[0]]
    return cpu, events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="10,1000")
    ap.add_argument("--before", default="", help="directory of earlier .wasm files: sluice rows run with them too")
    ap.add_argument("--injected-usage", action="store_true",
                    help="clients do not ask for include_usage: tenant-budget turns it on and cuts usage:null from every event")
    ap.add_argument("--native-before", default="", help="directory of an earlier libsluice.so: the native row runs with it too")
    ap.add_argument("--only", default="", help="comma-separated exact names: run only those configurations "
                    "(plus 'no filter', the baseline)")
    args = ap.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    full = (ROOT / "envoy/templates/full-gateway.yaml").read_text()
    configs = [
        ("no filter", (ROOT / "envoy/bench/none.yaml").read_text()),
        ("trivial wasm filter", (ROOT / "envoy/bench/floor.yaml").read_text()),
        ("router + budget + metrics", without_guard(full)),
        ("full chain", full),
        # The wasm chain with the native chain's router policy (no shadow), then the native chain.
        ("full chain, no shadow", full),
        ("native full chain", (ROOT / "envoy/templates/native-full-gateway.yaml").read_text()),
    ]
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    if wanted:
        unknown = wanted - {name for name, _ in configs}
        if unknown:
            sys.exit(f"--only: no configuration named {', '.join(sorted(unknown))}")
        configs = [(name, t) for name, t in configs if name in wanted or name == "no filter"]
    if args.before:
        configs = [c for name, t in configs for c in [(name, t)] + ([(name + " (before)", t)] if "{{WASM_DIR}}/sluice" in t else [])]
    if args.native_before:
        configs = [c for name, t in configs for c in [(name, t)] + ([(name + " (before)", t)] if name.startswith("native") else [])]
    budget_policy = json.loads((ROOT / "policies/tenant-budget.bench.json").read_text())
    if args.injected_usage:
        global CLIENT_ASKS_USAGE
        CLIENT_ASKS_USAGE = False
        budget_policy["include_usage"] = True
    budget = load.yaml_string_body(json.dumps(budget_policy))
    policies = {
        "PLUGIN_CONFIG": load.yaml_string_body((ROOT / "policies/llm-metrics.demo.json").read_text()),
        "BUDGET_CONFIG": budget,
        "ROUTER_CONFIG": load.yaml_string_body(load.router_policy(0.0)),
        "LATENCY_CONFIG": load.yaml_string_body(json.dumps(guard_policy())),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        mock_port = load.free_port()
        mock = subprocess.Popen([str(load.MOCK), "--listen", f"127.0.0.1:{mock_port}", "--max-connections", "4096"],
                                stdout=subprocess.DEVNULL)
        try:
            load.wait_port(mock_port)
            for streams in counts:
                for name, template in configs:
                    port, admin = load.free_port(), load.free_port()
                    path = Path(tmp) / "envoy.yaml"
                    no_shadow = name.startswith("native") or "no shadow" in name
                    router = load.yaml_string_body(load.router_policy(None if no_shadow else 0.0))
                    path.write_text(load.render(template, dict(policies, ROUTER_CONFIG=router, **{
                        "LISTEN_PORT": str(port), "ADMIN_PORT": str(admin), "UPSTREAM_PORT": str(mock_port),
                        "UPSTREAM_PORT_V2": str(mock_port), "SHADOW_PORT": str(mock_port),
                        "WASM_DIR": args.before if name.endswith("(before)") and not name.startswith("native") else str(load.WASM_DIR),
                        "ACCESS_LOG": "/dev/null", "FLOOR_CONFIG": ""})))
                    envoy = subprocess.Popen([load.ENVOY, "-c", str(path), "--concurrency", "1", "--log-level", "error",
                                              "--base-id", str(os.getpid() % 10000 + 700)],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             env=dict(os.environ, ENVOY_DYNAMIC_MODULES_SEARCH_PATH=str(
                                                 args.native_before if name.startswith("native") and name.endswith("(before)")
                                                 else load.NATIVE_DIR)))
                    try:
                        load.wait_port(port)
                        # Warm-up, as a long-running gateway is: V8 compiles a module's hot functions
                        # again (optimised) once they have run often, on Envoy's threads; without
                        # this the low-concurrency rows would measure that one-time compilation.
                        load.wrk(port, 64, 4, WARM_UP_S, tmp)
                        cpu, events = measure(envoy.pid, port, streams)
                    finally:
                        envoy.terminate()
                        envoy.wait()
                    rows.append((streams, name, cpu, events))
                    print(f"{streams} streams, {name}: {cpu:.2f} s CPU, {events} events", file=sys.stderr)
        finally:
            mock.terminate()
            mock.wait()

    span = WINDOW[1] - WINDOW[0]
    print(f"\n| streams | configuration | Envoy CPU (% of a core) | events in {span:.0f} s | CPU µs per event | added µs per event |")
    print("|---|---|---|---|---|---|")
    base = {s: cpu / max(ev, 1) for s, n, cpu, ev in rows if n == "no filter"}
    for streams, name, cpu, events in rows:
        per_event = cpu * 1e6 / max(events, 1)
        added = per_event - base[streams] * 1e6
        print(f"| {streams} | {name} | {cpu / span * 100:.1f} % | {events} | {per_event:.1f} | {added:+.1f} |")
    print("\nEnvoy --concurrency 1; first token after 100 ms, one event every 100 ms, 150 events; CPU from /proc "
          f"between {WINDOW[0]:.0f} s and {WINDOW[1]:.0f} s after the first stream started.")


if __name__ == "__main__":
    main()
