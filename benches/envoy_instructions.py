#!/usr/bin/env python3
"""Envoy's instructions per request, deterministically: one gateway configuration of
benches/envoy_load.py (the same templates, policies and request), Envoy `--concurrency 1` under
`valgrind --tool=callgrind`, N requests (1-token streams, one keep-alive connection, each request
after the last one's answer), then again with M requests; the difference divided by M − N is what
one request costs Envoy's whole process (every thread, user space), start-up and shutdown cancelled
out. Callgrind also counts the calls Envoy took of the dynamic-module metric callbacks, per request.

This machine's shared CPU moves wall-clock figures by tens of µs; an instruction count does not move.
Under valgrind Envoy runs some 50 times slower: what happens on a timer (the native module's metric
flush every 100 ms) happens once per a few requests here, where at full speed it covers hundreds —
the figures say what a slow stream of requests costs.

`--floor` measures the table of docs/native.md's "The floor under the goal": the references the
native goal names (the Lua filter, the no-op ext_proc), the floor of a dynamic-module filter
(libsluice.so's `floor`: none of sluice's work, only the calls a sluice request makes of Envoy,
each on its own and together) and the native chain, with each row's addition over "no filter" and
its ratio to the no-op ext_proc's (about 25 minutes at `--requests 10,60`).

Usage: benches/envoy_instructions.py [--config "native full chain"[,…] | --floor] [--requests 100,600]
       [--native-dir DIR]   (an earlier build of libsluice.so, for a before/after pair)
       [--template FILE]    (another template for the configuration, e.g. an earlier revision's)
       [--tokens N --itl-ms MS] [--keep DIR]
Needs what benches/envoy_load.py needs (`cargo xtask bench` builds it) and valgrind.
"""

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envoy_load as load  # noqa: E402  (the same configurations, policies and request)

# The dynamic-module metric callbacks whose calls are counted: a stream's, and a configuration's
# (the main thread's: settlements, shadows, the native module's metric flush).
# The Envoy binary itself: the venv's `envoy` is the package's Python launcher, which valgrind would
# measure instead (the binary is its child).
ENVOY_BINARY = next((p for p in sorted((load.ROOT / ".tools/venv/lib").glob("python3*/site-packages/envoy/_bin/envoy"))), None)

METRIC_CALLBACKS = re.compile(r"envoy_dynamic_module_callback_http_filter_(config_)?"
                              r"(increment_counter|record_histogram_value|set_gauge|increment_gauge|decrement_gauge)\b")


# The floor of a dynamic-module filter (envoy/bench/native-floor.yaml, native/src/floor.rs), by
# row name (no commas: `--config` takes a list): how many `floor` instances, and the calls each
# makes per request (none: it only is).
FLOORS = {
    "native floor": (1, ""),
    "native floor ×3": (3, ""),
    "native floor + hold": (1, "hold"),
    "native floor + chunks": (1, "chunks"),
    "native floor + 4 states": (1, "states=4"),
    "native floor + 6 histograms": (1, "histograms=6"),
    "native floor + 6 unlabelled histograms": (1, "bare_histograms=6"),
    "native floor + sluice's calls": (1, "hold,chunks,histograms=6,states=4"),
}
FLOOR_TEMPLATE = load.ROOT / "envoy/bench/native-floor.yaml"


def floor_filters(instances, calls):
    """The `floor` filter entries of a FLOORS row, for the template's FLOOR_FILTERS block."""
    entry = ("- name: envoy.filters.http.dynamic_modules\n"
             "  typed_config:\n"
             "    \"@type\": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter\n"
             "    dynamic_module_config: { name: sluice, do_not_close: true }\n"
             "    filter_name: floor\n"
             f"    filter_config: {{ \"@type\": type.googleapis.com/google.protobuf.StringValue, value: \"{calls}\" }}\n")
    return entry * instances


def slowed(policy):
    """A latency-guard policy with every `*_ms` time 100 times longer, up to the hour the policy
    allows. Under valgrind Envoy runs some 50 times slower: the first request (the module's first
    calls) outlasted the demo's 2 s TTFT deadline and was answered 504, which at full speed no
    request is. The guard's work per request is the same (its deadlines are armed either way)."""
    def scale(v):
        if isinstance(v, dict):
            return {k: min(x * 100, 3_600_000) if k.endswith("_ms") and isinstance(x, int) else scale(x) for k, x in v.items()}
        if isinstance(v, list):
            return [scale(x) for x in v]
        return v
    return json.dumps(scale(json.loads(policy)))


def request_body():
    script = load.WRK_SCRIPT
    return re.search(r"wrk.body = '(.*)'", script).group(1)


def send(port, count, tokens, itl_ms):
    body = request_body()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for n in range(1, count + 1):
        headers = {"content-type": "application/json", "x-mock-tokens": str(tokens), "x-mock-ttft-ms": "0", "x-mock-itl-ms": str(itl_ms),
                   "x-sluice-key": "search-prod", "x-sluice-tenant": f"tenant-{n % 1000}",
                   "x-request-id": f"{n:08x}-0000-4000-8000-{n:012x}"}
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        answer = conn.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"request {n}: status {answer.status}")
    conn.close()


def run(name, config, requests, native_dir, tmp, tokens=1, itl_ms=0, extra=None):
    """Total instructions of Envoy serving `requests` requests, and its metric callback calls."""
    mock_port = load.free_port()
    mock = subprocess.Popen([str(load.MOCK), "--listen", f"127.0.0.1:{mock_port}"], stdout=subprocess.DEVNULL)
    # The no-op external processor, for its row (its own instructions are not Envoy's: not counted).
    extproc_port = load.free_port()
    extproc = None
    if "ext_proc" in name:
        if not load.EXTPROC.exists():
            raise RuntimeError(f"{load.EXTPROC} is not built (`cargo xtask bench` builds it)")
        extproc = subprocess.Popen([str(load.EXTPROC), f"127.0.0.1:{extproc_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        load.wait_port(mock_port)
        if extproc:
            load.wait_port(extproc_port)
        port, admin = load.free_port(), load.free_port()
        path = Path(tmp) / "envoy.yaml"
        path.write_text(load.render(load.template_of(name, config.read_text()), {
            "LISTEN_PORT": str(port), "ADMIN_PORT": str(admin), "UPSTREAM_PORT": str(mock_port),
            "WASM_DIR": str(load.WASM_DIR), "ACCESS_LOG": "/dev/null",
            "PLUGIN_CONFIG": load.yaml_string_body((load.ROOT / "policies/llm-metrics.demo.json").read_text()),
            "BUDGET_CONFIG": load.yaml_string_body((load.ROOT / "policies/tenant-budget.bench.json").read_text()),
            "ROUTER_CONFIG": load.yaml_string_body(load.router_policy(None if name.startswith("native") else 0.0)),
            "LATENCY_CONFIG": load.yaml_string_body(slowed((load.ROOT / "policies/latency-guard.demo.json").read_text())),
            "UPSTREAM_PORT_V2": str(mock_port), "SHADOW_PORT": str(mock_port), "FLOOR_CONFIG": "",
            "LEDGER_PORT": "1", "EXTPROC_PORT": str(extproc_port), **(extra or {})}))
        out = Path(tmp) / f"callgrind.{requests}"
        envoy = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--trace-children=no",
             str(ENVOY_BINARY or load.ENVOY), "-c", str(path), "--concurrency", "1", "--log-level", "error", "--base-id", str(os.getpid() % 10000 + 700)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, ENVOY_DYNAMIC_MODULES_SEARCH_PATH=str(native_dir)))
        try:
            load.wait_port(port, timeout=300)
            send(port, requests, tokens, itl_ms)
        finally:
            envoy.terminate()
            envoy.wait(timeout=300)
        annotated = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(out)],
                                   capture_output=True, text=True, check=True).stdout
        total = int(re.search(r"([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", annotated).group(1).replace(",", ""))
        calls = metric_calls(out)
        # What the configuration-level metric calls cost inclusively (the native module's flush
        # on the main thread): their share depends on the request rate, the rest does not.
        inclusive = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
                                   capture_output=True, text=True, check=True).stdout
        config_calls = sum(int(m.group(1).replace(",", "")) for m in re.finditer(r"^\s*([\d,]+) \([^)]*\)\s+\S*envoy_dynamic_module_callback_http_filter_config_"
                                                                               r"(?:increment_counter|record_histogram_value|set_gauge|increment_gauge|decrement_gauge)\b", inclusive, re.M))
        return total, calls, config_calls
    finally:
        for process in (mock, extproc):
            if process:
                process.terminate()
                process.wait()


def metric_calls(out):
    """Calls of each metric callback, from the callgrind file's call records (`cfn=` then `calls=`)."""
    names, calls, current = {}, {}, None
    for line in out.read_text(errors="replace").splitlines():
        # A function's name is given once, at its first `fn=` or `cfn=`, then only its number.
        m = re.match(r"(c?)fn=\((\d+)\)(?: (.*))?", line)
        if m:
            if m.group(3):
                names[m.group(2)] = m.group(3)
            current = names.get(m.group(2)) if m.group(1) else None
            continue
        m = re.match(r"calls=(\d+)", line)
        if m and current:
            found = METRIC_CALLBACKS.search(current)
            if found:
                key = ("config " if found.group(1) else "") + found.group(2)
                calls[key] = calls.get(key, 0) + int(m.group(1))
            current = None
    return calls


# `--floor`: the rows that say where the native goal's bound lies against what the ABI charges —
# the references the goal names, the floor's rows, and the native chain itself.
FLOOR_TABLE = ["no filter", "trivial wasm filter", "Lua TTFT stamp", "no-op ext_proc", "native gateway shell"] + list(FLOORS) + [
    "native llm-metrics", "native full chain"]


def measure(name, args, few, many):
    """One configuration's instructions per request (and its metric calls), printed as it ends."""
    config, extra = dict(load.CONFIGS).get(name), None
    if name in FLOORS:
        config, extra = FLOOR_TEMPLATE, {"FLOOR_FILTERS": floor_filters(*FLOORS[name])}
    if config is None:
        sys.exit(f"no configuration {name!r}; one of: {', '.join([n for n, _ in load.CONFIGS] + list(FLOORS))}")
    if args.template:
        config = Path(args.template)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        (low, low_calls, low_config), (high, high_calls, high_config) = (run(name, config, n, args.native_dir, tmp, args.tokens, args.itl_ms, extra) for n in (few, many))
        if args.keep:
            keep = Path(args.keep) / re.sub(r"[^a-z0-9]+", "-", name.lower()) if "," in args.config or args.floor else Path(args.keep)
            keep.mkdir(parents=True, exist_ok=True)
            for n in (few, many):
                shutil.copy(Path(tmp) / f"callgrind.{n}", keep / f"callgrind.{n}")
    span = many - few
    per_request = (high - low) / span
    print(f"{name} ({args.native_dir}, {args.tokens} tokens, {args.itl_ms} ms apart): {low:,} instructions with {few} requests, {high:,} with {many}: "
          f"{per_request:,.0f} per request ({time.time() - started:.0f} s); "
          f"of which configuration-level metric calls {(high_config - low_config) / span:,.0f}", flush=True)
    for key in sorted(set(low_calls) | set(high_calls)):
        print(f"  {key}: {(high_calls.get(key, 0) - low_calls.get(key, 0)) / span:.2f} calls per request")
    json.dump({"config": name, "per_request": per_request, "config_metric_calls_per_request": (high_config - low_config) / span,
               "calls_per_request": {k: (high_calls.get(k, 0) - low_calls.get(k, 0)) / span for k in set(low_calls) | set(high_calls)}},
              sys.stderr)
    sys.stderr.write("\n")
    return per_request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="native full chain", help="a configuration name of benches/envoy_load.py or a floor row "
                    "(FLOORS); several, comma-separated, give a table")
    ap.add_argument("--floor", action="store_true", help="the floor table: the goal's references, the floor's rows, the native chain")
    ap.add_argument("--requests", default="100,600")
    ap.add_argument("--native-dir", default=str(load.NATIVE_DIR))
    ap.add_argument("--tokens", type=int, default=1, help="content tokens a response streams")
    ap.add_argument("--itl-ms", type=int, default=0, help="ms between the mock's tokens: above 0, each token is its own write, "
                    "so each SSE event reaches the filters in a body callback of its own")
    ap.add_argument("--template", default="", help="render this Envoy template instead of the configuration's own "
                    "(e.g. an earlier revision's, for a before/after pair)")
    ap.add_argument("--keep", default="", help="a directory to copy the callgrind files to (for callgrind_annotate)")
    args = ap.parse_args()
    few, many = (int(n) for n in args.requests.split(","))
    names = FLOOR_TABLE if args.floor else [n.strip() for n in args.config.split(",")]
    figures = {name: measure(name, args, few, many) for name in names}
    if len(names) == 1:
        return
    base = figures.get("no filter")
    extproc = figures.get("no-op ext_proc")
    print(f"\n| configuration | instructions per request | added over no filter | × the no-op ext_proc's addition |\n|---|---:|---:|---:|")
    for name, value in figures.items():
        added = f"{value - base:+,.0f}" if base is not None and name != "no filter" else "—"
        ratio = f"{(value - base) / (extproc - base):.3f}" if base is not None and extproc is not None and name != "no filter" else "—"
        print(f"| {name} | {value:,.0f} | {added} | {ratio} |")


if __name__ == "__main__":
    main()
