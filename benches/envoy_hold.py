#!/usr/bin/env python3
"""What latency-guard's hold adds to the first token a client sees.

A version with a TTFT deadline has its response headers held by the guard until llm-metrics marks
the first content token (docs/latency-guard.md); headers and the first chunk then leave together.
This bench measures the client's time to the first content token (from sending the request to
reading the mock's first token, `tok0`) through three paths at once, requests interleaved one by
one so a drift of the machine touches all alike:

  - the mock directly;
  - Envoy with json_to_metadata + model-router + llm-metrics (envoy/templates/router-gateway.yaml);
  - the same with latency-guard in front, holding (envoy/templates/latency-gateway.yaml, the demo
    guard policy: a TTFT deadline on both versions).

It prints the median and 90th percentile of each and the hold's cost: guard row minus router row.
One connection per request, loopback only, bounded in count.

Usage: benches/envoy_hold.py [--requests N] [--ttft-ms MS]   (needs what benches/envoy_load.py needs)
"""

import argparse
import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import envoy_load as load

ROOT = load.ROOT


def first_token_ms(port, ttft_ms, request_id):
    body = json.dumps({"model": "llama-3-70b", "stream": True, "messages": [{"role": "user", "content": "Say hello."}]})
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"x-mock-tokens: 4\r\nx-mock-ttft-ms: {ttft_ms}\r\nx-mock-itl-ms: 5\r\nx-sluice-tenant: acme\r\n"
            f"x-request-id: {request_id}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n{body}")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        start = time.perf_counter()
        s.sendall(head.encode())
        seen = b""
        while b"tok0" not in seen:
            piece = s.recv(65536)
            if not piece:
                raise RuntimeError(f"the stream on port {port} ended before its first token: {seen[:300]!r}")
            seen = seen[-16:] + piece
        elapsed = (time.perf_counter() - start) * 1000
        while s.recv(65536):
            pass
    return elapsed


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--ttft-ms", type=int, default=20, help="the mock's time to first token")
    args = ap.parse_args()
    vars_ = {
        "PLUGIN_CONFIG": load.yaml_string_body((ROOT / "policies/llm-metrics.demo.json").read_text()),
        "ROUTER_CONFIG": load.yaml_string_body(load.router_policy(0.0)),
        "LATENCY_CONFIG": load.yaml_string_body((ROOT / "policies/latency-guard.demo.json").read_text()),
        "WASM_DIR": str(load.WASM_DIR), "ACCESS_LOG": "/dev/null",
    }
    paths = {"mock directly": None, "router + metrics": "router-gateway.yaml", "guard (holding) + router + metrics": "latency-gateway.yaml"}
    envoys = []
    times = {name: [] for name in paths}
    with tempfile.TemporaryDirectory() as tmp:
        mock_port = load.free_port()
        mock = subprocess.Popen([str(load.MOCK), "--listen", f"127.0.0.1:{mock_port}"], stdout=subprocess.DEVNULL)
        try:
            load.wait_port(mock_port)
            ports = {}
            for i, (name, template) in enumerate(paths.items()):
                if template is None:
                    ports[name] = mock_port
                    continue
                port, admin = load.free_port(), load.free_port()
                config = Path(tmp) / f"envoy{i}.yaml"
                config.write_text(load.render((ROOT / "envoy/templates" / template).read_text(), dict(vars_, **{
                    "LISTEN_PORT": str(port), "ADMIN_PORT": str(admin), "UPSTREAM_PORT": str(mock_port),
                    "UPSTREAM_PORT_V2": str(mock_port), "SHADOW_PORT": str(mock_port)})))
                envoys.append(subprocess.Popen([load.ENVOY, "-c", str(config), "--concurrency", "1", "--log-level", "error",
                                                "--base-id", str(os.getpid() % 10000 + 1100 + i)],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                load.wait_port(port)
                ports[name] = port
            for name, port in ports.items():  # warm-up: connections, VMs, JIT
                for i in range(20):
                    first_token_ms(port, args.ttft_ms, f"warm-{i}")
            for i in range(args.requests):
                for name, port in ports.items():
                    times[name].append(first_token_ms(port, args.ttft_ms, f"hold-{i}"))
        finally:
            for envoy in envoys:
                envoy.terminate()
                envoy.wait()
            mock.terminate()
            mock.wait()
    print(f"\n| path | client's first token, median ms | p90 ms |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {quantile(values, 0.5):.2f} | {quantile(values, 0.9):.2f} |")
    held, plain = times["guard (holding) + router + metrics"], times["router + metrics"]
    print(f"\nthe hold (guard row − router row): median {quantile(held, 0.5) - quantile(plain, 0.5):+.2f} ms, "
          f"p90 {quantile(held, 0.9) - quantile(plain, 0.9):+.2f} ms")
    print(f"{args.requests} requests per path, interleaved; mock TTFT {args.ttft_ms} ms; Envoy --concurrency 1.")


if __name__ == "__main__":
    main()
