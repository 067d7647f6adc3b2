#!/usr/bin/env python3
"""Side-by-side Envoy load bench: the same mock streaming endpoint behind Envoy with no filter, with
sluice llm-metrics, with a Lua filter that does the same TTFT stamping, with tenant-budget in front of
llm-metrics, with model-router (with and without shadowing) and with latency-guard in front of the
router; plus the mock alone.

Every configuration runs in this one invocation, one after the other on the same machine, so the
figures are comparable with each other (not with another machine's). Loopback only.

For each configuration and stream length (1 and 64 content tokens, no artificial delays) it runs wrk:
  - 1 connection, closed loop: mean latency per request → added µs per request versus no filter;
    the difference between the 64-token and 1-token runs, divided by 63, is the added µs per chunk;
  - 16 connections: requests/s, and the proxy's own CPU time per request (user + system, read
    from /proc around the run): the figure other load on the machine does not move. Added CPU per
    request and per chunk are derived from it the same way.

With --rounds N every configuration is measured N times, the rounds interleaved (all configurations
once, then again), and each figure is the median of its N values: slow drifts of the machine then
touch every row alike.

With --before DIR every configuration that loads sluice's plugins runs a second time with the `.wasm`
files of DIR (an earlier build), in the same rounds, as "<name> (before)": before and after from one run.
With --before-ref REF those rows render the templates of git revision REF (the earlier build's files).

Usage: benches/envoy_load.py [--seconds N] [--rounds N] [--only budget,fleet] [--before DIR]   (needs: target/release/sluice-mock-server, the .wasm,
libsluice.so (target/native),
Envoy from `cargo xtask setup`, wrk — `cargo xtask bench` provides all of them).
"""

import argparse
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVOY = os.environ.get("SLUICE_ENVOY", str(ROOT / ".tools/venv/bin/envoy"))
MOCK = ROOT / "target/release/sluice-mock-server"
# The plugins' .wasm files: `$SLUICE_WASM_DIR` (e.g. a copy that a rebuild cannot change mid-run),
# else where `cargo xtask build` puts them.
WASM_DIR = Path(os.environ.get("SLUICE_WASM_DIR", ROOT / "target/wasm32-wasip1/release"))

CONFIGS = [
    ("no filter", ROOT / "envoy/bench/none.yaml"),
    # Envoy's OpenTelemetry tracer alone (every request sampled, no custom tags, spans exported to a
    # loopback sink): what tracing costs before sluice writes or Envoy formats any attribute.
    ("no filter, traced 100 %", ROOT / "envoy/bench/none.yaml"),
    # Reference rows: what any wasm filter costs (one that sets one header), and the architecture
    # users would otherwise pick, a no-op external processor (Envoy's side of the gRPC round trips).
    ("trivial wasm filter", ROOT / "envoy/bench/floor.yaml"),
    ("4 trivial wasm filters", ROOT / "envoy/bench/floor4.yaml"),
    ("no-op ext_proc", ROOT / "envoy/bench/extproc.yaml"),
    ("sluice llm-metrics", ROOT / "envoy/templates/gateway.yaml"),
    # The same llm-metrics section run natively: libsluice.so, Envoy's dynamic-module filter
    # (docs/native.md), found in NATIVE_DIR.
    ("native llm-metrics", ROOT / "envoy/templates/native-gateway.yaml"),
    ("Lua TTFT stamp", ROOT / "envoy/bench/lua.yaml"),
    # tenant-budget (5 counters: org month $, team minute tokens, key minute tokens + day requests)
    # in front of llm-metrics, limits far above the load so every request is admitted.
    ("budget + llm-metrics", ROOT / "envoy/templates/budget-gateway.yaml"),
    # json_to_metadata + model-router (2 versions, 50/50) + llm-metrics; then the same with 10 % of
    # requests shadowed to a third cluster (the same mock).
    ("router + llm-metrics", ROOT / "envoy/templates/router-gateway.yaml"),
    ("router, shadow 10 %", ROOT / "envoy/templates/router-gateway.yaml"),
    # latency-guard (demo policy: breaker, deadlines and in-flight limit on v1, none of them
    # tripping) in front of the router + llm-metrics chain above, no shadow.
    ("guard + router + metrics", ROOT / "envoy/templates/latency-gateway.yaml"),
    # All four plugins: json_to_metadata, latency-guard, model-router (50/50), tenant-budget (the
    # bench policy), llm-metrics, Envoy's buffer filter.
    ("full chain", ROOT / "envoy/templates/full-gateway.yaml"),
    # The same four policies natively (libsluice.so, docs/native.md): json_to_metadata, latency-guard
    # in its own module filter instance, then model-router (50/50, without the shadow, as when this
    # row was first measured, so that runs compare), tenant-budget (the bench policy, local mode), llm-metrics in one instance;
    # no buffer filter (the native budget holds the headers while it reads the body).
    ("native full chain", ROOT / "envoy/templates/native-full-gateway.yaml"),
    # The native full gateway without its three sluice filters: its access log, decompressors,
    # routes and stats settings alone (what the chain's rows add that is not sluice's). Rendered
    # from the gateway's own template (WITHOUT_MODULE_FILTERS), so the two cannot drift apart.
    ("native gateway shell", ROOT / "envoy/templates/native-full-gateway.yaml"),
    # The same with tracing on (`cargo xtask render --otlp`): Envoy's OpenTelemetry tracer, every
    # request sampled, sluice's span attributes as custom tags, spans exported over OTLP/HTTP to a
    # sink on loopback that answers 200 and drops them.
    ("full chain, traced 100 %", ROOT / "envoy/templates/full-gateway.yaml"),
    # The fleet gateway (tenant-budget, buffer filter, llm-metrics) with the same budget policy:
    # counters in this process's shared data, then in Redis through one sluice-ledger instance
    # (one tokio thread) — the cost of a fleet-wide budget, side by side.
    ("fleet gw, local ledger", ROOT / "envoy/templates/fleet-gateway.yaml"),
    ("fleet gw, Redis ledger", ROOT / "envoy/templates/fleet-gateway.yaml"),
]
LEDGER = ROOT / "target/release/sluice-ledger"
# libsluice.so, the native module: `$SLUICE_NATIVE_DIR`, else where `cargo xtask build` puts it.
NATIVE_DIR = Path(os.environ.get("SLUICE_NATIVE_DIR", ROOT / "target/native"))
# Built by `cargo xtask bench` (its own workspace, benches/extproc-noop).
EXTPROC = ROOT / "target/extproc-noop/release/sluice-bench-extproc-noop"


def router_policy(shadow_fraction):
    """The demo router policy with an even split (so both routes carry load) and the given shadow share;
    without its shadow when shadow_fraction is None (the native rows, as first measured)."""
    policy = json.loads((ROOT / "policies/model-router.demo.json").read_text())
    model = policy["models"][0]
    model["model"] = "llama-3-70b*"
    for version in model["versions"]:
        version["weight"] = 50
    if shadow_fraction is None:
        del model["shadow"]
    else:
        model["shadow"]["fraction"] = shadow_fraction
        model["shadow"]["max_concurrent"] = 64
    return json.dumps(policy)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port}")


def yaml_string_body(text):
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


# Block placeholders a template may leave without a value (tracing, off unless given): as in
# sluice_envoy_render, a line that is only `{{NAME}}` takes the value's lines at its indentation.
OPTIONAL_BLOCKS = ("TRACING", "TRACING_CLUSTER")


# Rows whose template is another row's with its dynamic-module filters taken out.
WITHOUT_MODULE_FILTERS = {"native gateway shell"}


def template_of(name, text):
    """Row `name`'s template, from its file's `text`: every `envoy.filters.http.dynamic_modules`
    entry of its filter list removed for a row of WITHOUT_MODULE_FILTERS (an entry ends where a line
    as little indented as its `- name:` begins), `text` itself otherwise."""
    if name not in WITHOUT_MODULE_FILTERS:
        return text
    kept, entry_indent = [], None
    for line in text.splitlines(keepends=True):
        indent = len(line) - len(line.lstrip(" "))
        if entry_indent is not None:
            if not line.strip() or indent > entry_indent:
                continue
            entry_indent = None
        if line.strip() == "- name: envoy.filters.http.dynamic_modules":
            entry_indent = indent
            continue
        kept.append(line)
    return "".join(kept)


def render(template, vars_):
    lines = []
    for line in template.splitlines(keepends=True):
        m = re.fullmatch(r"( *)\{\{([A-Z0-9_]+)\}\}\s*", line)
        if m and (m.group(2) in vars_ or m.group(2) in OPTIONAL_BLOCKS):
            lines += [m.group(1) + l + "\n" for l in vars_.get(m.group(2), "").splitlines() if l.strip()]
        else:
            lines.append(line)
    template = "".join(lines)
    for k, v in vars_.items():
        template = template.replace("{{%s}}" % k, v)
    return template


def tracing_vars(gateway, collector_port):
    """The TRACING and TRACING_CLUSTER values of `gateway`, exporting to 127.0.0.1:collector_port, as
    `cargo xtask render --otlp` writes them (one implementation: the renderer's)."""
    out = subprocess.run(["cargo", "xtask", "render", gateway, "--otlp", f"127.0.0.1:{collector_port}", "--vars"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers["x-mock-tokens"] = "%d"
wrk.headers["x-mock-ttft-ms"] = "0"
wrk.headers["x-mock-itl-ms"] = "0"
wrk.headers["x-sluice-tenant"] = "acme"
wrk.headers["x-sluice-key"] = "search-prod"
wrk.headers["x-request-id"] = "bench"
request_count = 0
request = function()
  -- A distinct request id and tenant per request: shadow sampling and the split hash on them.
  request_count = request_count + 1
  -- A UUID, as Envoy's own ids are: Envoy traces only a request whose id can carry its decision.
  wrk.headers["x-request-id"] = string.format("%%08x-0000-4000-8000-%%012x", request_count, request_count)
  wrk.headers["x-sluice-tenant"] = "tenant-" .. (request_count %% 1000)
  return wrk.format()
end
wrk.body = '{"model":"llama-3-70b","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Say hello."}]}'
"""


class OtlpSink(http.server.BaseHTTPRequestHandler):
    """Takes an OTLP/HTTP export and drops it (the traced row measures Envoy's side only)."""
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU time of a process so far (from /proc; other processes do not count)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def wrk(port, tokens, connections, seconds, tmp):
    script = Path(tmp) / f"post{tokens}.lua"
    script.write_text(WRK_SCRIPT % tokens)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script),
         f"http://127.0.0.1:{port}/v1/chat/completions"],
        capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    m = re.search(r"Latency\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1.0, "ms": 1000.0, "s": 1e6}[m.group(2)]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk saw errors: {out}")
    percentiles = {}
    for q, value, unit in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M):
        percentiles[q] = float(value) * {"us": 1.0, "ms": 1000.0, "s": 1e6}[unit]
    wrk.percentiles = percentiles
    return rps, float(m.group(1)) * scale, total


def median(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def median_row(rows):
    """Each figure of a configuration's rows, the median over its rounds."""
    out = {}
    for tokens in (1, 64):
        out[tokens] = tuple(median([r[tokens][i] for r in rows]) for i in range(3))
    out["p50_p99"] = tuple(median([r["p50_p99"][i] for r in rows]) for i in range(2))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--before", default="", help="directory of earlier .wasm files: sluice rows run with them too")
    ap.add_argument("--before-ref", default="", help="git revision whose envoy templates the (before) rows render "
                    "(for a build whose files differ from today's, e.g. one .wasm per plugin)")
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the configurations "
                    "whose name contains one of them (plus 'no filter', the baseline)")
    args = ap.parse_args()
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    plugin_config = yaml_string_body((ROOT / "policies/llm-metrics.demo.json").read_text())
    budget_policy = json.loads((ROOT / "policies/tenant-budget.bench.json").read_text())
    budget_config = yaml_string_body(json.dumps(budget_policy))
    budget_policy["ledger"] = {"mode": "redis", "cluster": "sluice_ledger", "timeout_ms": 1000}
    redis_budget_config = yaml_string_body(json.dumps(budget_policy))
    extra_cpu = {}
    latency_config = yaml_string_body((ROOT / "policies/latency-guard.demo.json").read_text())
    rounds = {}
    with tempfile.TemporaryDirectory() as tmp:
        mock_port = free_port()
        mock = subprocess.Popen([str(MOCK), "--listen", f"127.0.0.1:{mock_port}"], stdout=subprocess.DEVNULL)
        # Redis (Debian's redis-server, no persistence) and one ledger instance on one thread.
        redis_port, ledger_port = free_port(), free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--dir", tmp,
                                  "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        ledger = subprocess.Popen([str(LEDGER), "--listen", f"127.0.0.1:{ledger_port}",
                                   "--redis", f"redis://127.0.0.1:{redis_port}/", "--threads", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OtlpSink)
        threading.Thread(target=sink.serve_forever, daemon=True).start()
        traced_vars = tracing_vars("full-gateway", sink.server_address[1])
        # The same tracer without sluice's custom tags (the block up to its tags' comment).
        marker = "  # Each is a value"
        if marker not in traced_vars["TRACING"]:
            raise RuntimeError("the tracing block no longer marks its custom tags: the tracer-only row cannot drop them")
        tracer_only = dict(traced_vars, TRACING=traced_vars["TRACING"].split(marker)[0])
        extproc_port = free_port()
        extproc = subprocess.Popen([str(EXTPROC), f"127.0.0.1:{extproc_port}"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL) if EXTPROC.exists() else None
        try:
            wait_port(mock_port)
            wait_port(redis_port)
            wait_port(ledger_port)
            if extproc:
                wait_port(extproc_port)
            runs = [("mock alone (no Envoy)", None)] + [
                (name, config) for name, config in CONFIGS
                if (not wanted or name == "no filter" or any(w in name for w in wanted))
                and (extproc or "ext_proc" not in name)]
            if args.before:
                runs = [r for name, config in runs for r in ([(name, config)] + (
                    [(name + " (before)", config)] if config and "WASM_DIR" in config.read_text() and "bench/" not in str(config) else []))]
            for name, config in [r for _ in range(args.rounds) for r in runs]:
                envoy = None
                port = mock_port
                if config is not None:
                    port, admin = free_port(), free_port()
                    path = Path(tmp) / "envoy.yaml"
                    text = config.read_text()
                    if name.endswith("(before)") and args.before_ref:
                        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before_ref}:{config.relative_to(ROOT)}"],
                                              capture_output=True, text=True, check=True).stdout
                    path.write_text(render(template_of(name, text), {
                        "LISTEN_PORT": str(port), "ADMIN_PORT": str(admin), "UPSTREAM_PORT": str(mock_port),
                        "WASM_DIR": args.before if name.endswith("(before)") else str(WASM_DIR),
                        "ACCESS_LOG": "/dev/null", "PLUGIN_CONFIG": plugin_config,
                        "BUDGET_CONFIG": redis_budget_config if "Redis" in name else budget_config,
                        "LEDGER_PORT": str(ledger_port), "EXTPROC_PORT": str(extproc_port),
                        "ROUTER_CONFIG": yaml_string_body(router_policy(
                            None if name.startswith("native") else 0.1 if "shadow" in name else 0.0)),
                        "LATENCY_CONFIG": latency_config,
                        "UPSTREAM_PORT_V2": str(mock_port), "SHADOW_PORT": str(mock_port), "FLOOR_CONFIG": "",
                        **(({} if "traced" not in name else tracer_only if name.startswith("no filter") else traced_vars))}))
                    envoy = subprocess.Popen([ENVOY, "-c", str(path), "--concurrency", "1", "--log-level", "error",
                                              "--base-id", str(os.getpid() % 10000 + 500)],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             env=dict(os.environ, ENVOY_DYNAMIC_MODULES_SEARCH_PATH=str(NATIVE_DIR)))
                    wait_port(port)
                try:
                    wrk(port, 1, 1, 1, tmp)  # warm-up: connections, VM, JIT
                    row = {}
                    for tokens in (1, 64):
                        _, lat, _ = wrk(port, tokens, 1, args.seconds, tmp)
                        if tokens == 1:
                            row["p50_p99"] = (wrk.percentiles.get("50"), wrk.percentiles.get("99"))
                        # CPU per request of the proxy (the mock's when there is no Envoy): unlike
                        # latency, it is not moved by whatever else the machine runs.
                        pid = envoy.pid if envoy else mock.pid
                        before = cpu_seconds(pid)
                        side = {"ledger": cpu_seconds(ledger.pid), "redis": cpu_seconds(redis.pid)}
                        rps, _, total = wrk(port, tokens, 16, args.seconds, tmp)
                        cpu_us = (cpu_seconds(pid) - before) * 1e6 / max(total, 1)
                        if tokens == 1 and "Redis" in name:
                            extra_cpu[name] = {k: (cpu_seconds(p) - side[k]) * 1e6 / max(total, 1)
                                               for k, p in (("ledger", ledger.pid), ("redis", redis.pid))}
                        row[tokens] = (lat, rps, cpu_us)
                    rounds.setdefault(name, []).append(row)
                finally:
                    if envoy:
                        envoy.terminate()
                        envoy.wait()
        finally:
            for process in (mock, ledger, redis, extproc):
                if process:
                    process.terminate()
                    process.wait()

    results = {name: median_row(rows) for name, rows in rounds.items()}
    base = results["no filter"]
    print()
    print(f"{'configuration':<24} {'1 tok: µs/req':>13} {'req/s':>7} {'CPU µs':>7} {'64 tok: µs/req':>14} {'req/s':>7} "
          f"{'CPU µs':>7} {'added CPU µs/req':>17} {'added CPU µs/chunk':>19}")
    for name, row in results.items():
        (l1, r1, c1), (l64, r64, c64) = row[1], row[64]
        if name.startswith("mock"):
            added_req = added_chunk = "—"
        else:
            added_req = f"{c1 - base[1][2]:.1f}"
            added_chunk = f"{((c64 - base[64][2]) - (c1 - base[1][2])) / 63:.2f}"
        print(f"{name:<24} {l1:>13.1f} {r1:>7.0f} {c1:>7.1f} {l64:>14.1f} {r64:>7.0f} {c64:>7.1f} {added_req:>17} {added_chunk:>19}")
    print(f"\n{'configuration':<24} {'1 tok p50 µs':>13} {'p99 µs':>9}   (1 connection, closed loop)")
    for name, row in results.items():
        p50, p99 = row.get("p50_p99", (None, None))
        fmt = lambda v: f"{v:.0f}" if v is not None else "—"
        print(f"{name:<24} {fmt(p50):>13} {fmt(p99):>9}")
    for name, cpu in extra_cpu.items():
        print(f"{name}: outside Envoy, per request at 16 connections: sluice-ledger {cpu['ledger']:.1f} µs CPU, "
              f"redis-server {cpu['redis']:.1f} µs CPU")
    print(f"\n{args.rounds} round(s), medians." if args.rounds > 1 else "")
    print("Envoy --concurrency 1; wrk 1 thread. µs/req: mean latency of 1 connection in a closed loop;"
          "\nreq/s and CPU µs (Envoy's own CPU time per request, from /proc) at 16 connections.")
    json.dump(results, sys.stderr)
    sys.stderr.write("\n")


if __name__ == "__main__":
    main()
