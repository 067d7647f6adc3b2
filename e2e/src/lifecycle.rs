//! Envoy's own life cycle, for `e2e/tests/lifecycle_envoy.rs`: the shipped gateways turned into
//! configurations Envoy updates while it runs — the listener served by LDS from a watched file, a
//! wasm filter's configuration served by ECDS from another — written by atomic rename as a control
//! plane on the filesystem would; and Envoy processes started with hot restart on
//! (`--restart-epoch`, `--base-id`), which [`crate::Envoy`] turns off.
//!
//! The configurations are the shipped templates rendered with every placeholder given (ports,
//! access log and `.wasm` directory included), then moved around as YAML documents, so what Envoy
//! runs is the shipped chain and only its delivery changes.

use crate::access_log::AccessLog;
use crate::envoy::{free_port, render_config, tail};
use crate::gateway::shipped;
use crate::http;
use crate::prometheus::Metrics;
use crate::tools::Tools;
use anyhow::{anyhow, bail, Context, Result};
use serde_yaml::{Mapping, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The wasm HTTP filter's type, the one ECDS must be told to accept.
pub const WASM_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const EXTENSION_TYPE: &str = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";

/// A directory the test owns: removed on drop unless the test panics or `SLUICE_E2E_KEEP` is set.
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    pub fn new(what: &str) -> Result<Scratch> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!("sluice-lifecycle-{what}-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Scratch { dir })
    }
    pub fn path(&self) -> &Path {
        &self.dir
    }
    pub fn join(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("SLUICE_E2E_KEEP").is_some() {
            eprintln!("lifecycle files kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The ports and files a rendered gateway uses, chosen by the test (the rendered YAML names them).
#[derive(Debug, Clone)]
pub struct Site {
    pub admin_port: u16,
    pub listen_port: u16,
    pub access_log: PathBuf,
}

impl Site {
    /// Free loopback ports and an access log in `scratch`.
    pub fn new(scratch: &Scratch) -> Result<Site> {
        Ok(Site { admin_port: free_port()?, listen_port: free_port()?, access_log: scratch.join("access.log") })
    }
}

/// Renders the shipped template at `template` (a path from the repository root) with `vars` plus
/// the site's ports and access log and the default `.wasm` directory, as a YAML document.
pub fn render_shipped(template: &str, site: &Site, vars: &[(&str, &str)]) -> Result<Value> {
    let path = shipped(template);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let (admin, listen, log, wasm) =
        (site.admin_port.to_string(), site.listen_port.to_string(), site.access_log.display().to_string(), crate::tools::wasm_dir().display().to_string());
    let mut all: Vec<(&str, &str)> = vec![("ADMIN_PORT", &admin), ("LISTEN_PORT", &listen), ("ACCESS_LOG", &log), ("WASM_DIR", &wasm)];
    all.extend_from_slice(vars);
    let rendered = render_config(&text, &all)?;
    serde_yaml::from_str(&rendered).with_context(|| format!("{template} rendered is not YAML"))
}

fn at<'a>(v: &'a mut Value, path: &[&str]) -> Result<&'a mut Value> {
    let mut cur = v;
    for key in path {
        cur = match key.parse::<usize>() {
            Ok(i) => cur.get_mut(i),
            Err(_) => cur.get_mut(*key),
        }
        .ok_or_else(|| anyhow!("no {key} in the configuration (path {path:?})"))?;
    }
    Ok(cur)
}

/// The HTTP filters of a listener (its first filter chain's connection manager).
pub fn http_filters(listener: &mut Value) -> Result<&mut Vec<Value>> {
    at(listener, &["filter_chains", "0", "filters", "0", "typed_config", "http_filters"])?
        .as_sequence_mut()
        .ok_or_else(|| anyhow!("http_filters is not a list"))
}

/// The first static listener of a bootstrap.
pub fn static_listener(bootstrap: &mut Value) -> Result<&mut Value> {
    at(bootstrap, &["static_resources", "listeners", "0"])
}

/// The index of the wasm filter whose plugin is `name` (`sluice_tenant_budget`, …).
pub fn wasm_filter_index(filters: &[Value], name: &str) -> Result<usize> {
    let named = |f: &Value| f.get("typed_config").and_then(|t| t.get("config")).and_then(|c| c.get("name")).and_then(Value::as_str) == Some(name);
    if let Some(i) = filters.iter().position(named) {
        return Ok(i);
    }
    // A policy that shares a sluice.wasm filter with others: the filter whose sections include it.
    let section = name.strip_prefix("sluice_").unwrap_or(name);
    filters
        .iter()
        .position(|f| f.get("typed_config").and_then(|t| sections(t).ok()).is_some_and(|s| s.iter().any(|(k, _)| k == section)))
        .ok_or_else(|| anyhow!("no wasm filter {name} in the chain"))
}

/// Sets the plugin configuration (the `StringValue`) of wasm filter `name` in `filters` to the
/// policy `json`: as its section when the filter runs sluice.wasm ([`configuration_with`]).
pub fn set_plugin_config(filters: &mut [Value], name: &str, json: &str) -> Result<()> {
    let i = wasm_filter_index(filters, name)?;
    let filter = filters.get_mut(i).ok_or_else(|| anyhow!("no filter {i}"))?;
    let typed = filter.get("typed_config").ok_or_else(|| anyhow!("filter {name} has no typed_config"))?;
    let configuration = configuration_with(typed, name, json)?;
    let value = at(filter, &["typed_config", "config", "configuration", "value"])?;
    *value = Value::String(configuration);
    Ok(())
}

/// The members of a sluice.wasm filter's configuration, each value as written — JSON, or a
/// template placeholder a test fills later (empty for another `.wasm`).
fn sections(typed_config: &Value) -> Result<Vec<(String, String)>> {
    let config = typed_config.get("config").ok_or_else(|| anyhow!("a wasm typed_config without config"))?;
    if !runs_sluice_wasm(config) {
        return Ok(Vec::new());
    }
    let text = ["configuration", "value"].iter().try_fold(config, |v, k| v.get(*k)).and_then(Value::as_str).unwrap_or("{}");
    split_members(text).ok_or_else(|| anyhow!("a sluice.wasm configuration that is not an object of sections: {text}"))
}

/// Whether a wasm filter's `config` loads sluice.wasm (whose configuration is made of sections).
fn runs_sluice_wasm(config: &Value) -> bool {
    let filename = ["vm_config", "code", "local", "filename"].iter().try_fold(config, |v, k| v.get(*k)).and_then(Value::as_str).unwrap_or_default();
    filename == "sluice.wasm" || filename.ends_with("/sluice.wasm")
}

/// `{"a": X, "b": Y}` → `[("a", "X"), ("b", "Y")]`, the values as written: split at the
/// object's own commas (outside strings and nested brackets), so `{{NAME}}` counts as a value.
fn split_members(text: &str) -> Option<Vec<(String, String)>> {
    let inner = text.trim().strip_prefix('{')?.strip_suffix('}')?;
    let (mut members, mut depth, mut in_string, mut escaped, mut start) = (Vec::new(), 0i32, false, false, 0usize);
    let mut push = |part: &str| -> Option<()> {
        let (key, value) = part.split_once(':')?;
        let key = key.trim().strip_prefix('"')?.strip_suffix('"')?.to_string();
        members.push((key, value.trim().to_string()));
        Some(())
    };
    for (i, c) in inner.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            '{' | '[' if !in_string => depth += 1,
            '}' | ']' if !in_string => depth -= 1,
            ',' if !in_string && depth == 0 => {
                push(inner.get(start..i)?)?;
                start = i + 1;
            }
            _ => {}
        }
    }
    let last = inner.get(start..)?;
    if !last.trim().is_empty() {
        push(last)?;
    }
    Some(members)
}

/// The configuration text of a wasm filter's `typed_config` with the policy `json` of `name`
/// (`sluice_tenant_budget`): the policy itself for a single-policy `.wasm`; for sluice.wasm, its
/// sections with that one (`tenant_budget`) replaced by `json` as written (which may be broken on
/// purpose), the others kept.
pub fn configuration_with(typed_config: &Value, name: &str, json: &str) -> Result<String> {
    let config = typed_config.get("config").ok_or_else(|| anyhow!("a wasm typed_config without config"))?;
    if !runs_sluice_wasm(config) {
        return Ok(json.to_string());
    }
    let section = name.strip_prefix("sluice_").ok_or_else(|| anyhow!("{name}: which sluice.wasm section?"))?;
    let members: Vec<String> =
        sections(typed_config)?.into_iter().map(|(k, v)| if k == section { format!("\"{k}\": {json}") } else { format!("\"{k}\": {v}") }).collect();
    if !members.iter().any(|m| m.starts_with(&format!("\"{section}\""))) {
        bail!("the sluice.wasm filter has no {section} section");
    }
    Ok(format!("{{{}}}", members.join(", ")))
}

/// A wasm filter entry for the test filter `sluice_e2e_trap.wasm` under `failure_policy`, in a VM
/// of its own (its code differs from the plugins', so it never shares theirs whatever the `vm_id`).
pub fn trap_filter(failure_policy: &str) -> Result<Value> {
    let wasm = crate::tools::wasm_dir().join("sluice_e2e_trap.wasm");
    if !wasm.is_file() {
        bail!("{} not found: run `cargo xtask build`", wasm.display());
    }
    let yaml = format!(
        r#"
name: envoy.filters.http.wasm
typed_config:
  "@type": {WASM_TYPE}
  config:
    name: sluice_e2e_trap
    root_id: sluice_e2e_trap
    failure_policy: {failure_policy}
    vm_config:
      vm_id: trap
      runtime: envoy.wasm.runtime.v8
      code: {{ local: {{ filename: "{}" }} }}
"#,
        wasm.display()
    );
    Ok(serde_yaml::from_str(&yaml)?)
}

/// A file-based xDS source: `path` inside a watched directory, replaced by atomic rename.
pub struct XdsFile {
    path: PathBuf,
    version: u32,
}

impl XdsFile {
    pub fn new(dir: &Path, name: &str) -> Result<XdsFile> {
        let watched = dir.join(format!("{name}.d"));
        std::fs::create_dir_all(&watched)?;
        Ok(XdsFile { path: watched.join(format!("{name}.yaml")), version: 0 })
    }

    /// The `ConfigSource` that reads this file, watching its directory for moves.
    pub fn config_source(&self) -> Value {
        let dir = self.path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut source = Mapping::new();
        source.insert("path".into(), self.path.display().to_string().into());
        let mut watched = Mapping::new();
        watched.insert("path".into(), dir.display().to_string().into());
        source.insert("watched_directory".into(), Value::Mapping(watched));
        let mut cs = Mapping::new();
        cs.insert("resource_api_version".into(), "V3".into());
        cs.insert("path_config_source".into(), Value::Mapping(source));
        Value::Mapping(cs)
    }

    /// Writes a discovery response with `resources` (each given its `@type`) next to the file and
    /// renames it over the file: Envoy sees the new file whole or not at all.
    fn publish(&mut self, type_url: &str, resources: Vec<Value>) -> Result<()> {
        self.version += 1;
        let resources: Vec<Value> = resources
            .into_iter()
            .map(|mut r| {
                if let Value::Mapping(m) = &mut r {
                    m.insert("@type".into(), type_url.into());
                }
                r
            })
            .collect();
        let mut doc = Mapping::new();
        doc.insert("version_info".into(), self.version.to_string().into());
        doc.insert("resources".into(), Value::Sequence(resources));
        let tmp = self.path.with_extension(format!("tmp{}", self.version));
        std::fs::write(&tmp, serde_yaml::to_string(&Value::Mapping(doc))?)?;
        std::fs::rename(&tmp, &self.path).with_context(|| format!("renaming {} over {}", tmp.display(), self.path.display()))?;
        Ok(())
    }

    /// Publishes `listeners` (LDS).
    pub fn publish_listeners(&mut self, listeners: Vec<Value>) -> Result<()> {
        self.publish(LISTENER_TYPE, listeners)
    }

    /// Publishes one filter configuration named `name` (ECDS) whose `typed_config` is `typed_config`.
    pub fn publish_extension(&mut self, name: &str, typed_config: Value) -> Result<()> {
        let mut r = Mapping::new();
        r.insert("name".into(), name.into());
        r.insert("typed_config".into(), typed_config);
        self.publish(EXTENSION_TYPE, vec![Value::Mapping(r)])
    }
}

/// Gives the bootstrap a node id and cluster, which Envoy requires of any xDS subscription, the
/// filesystem ones included.
pub fn set_node(bootstrap: &mut Value, id: &str) {
    let mut node = Mapping::new();
    node.insert("id".into(), id.into());
    node.insert("cluster".into(), "sluice-lifecycle".into());
    if let Value::Mapping(m) = bootstrap {
        m.insert("node".into(), Value::Mapping(node));
    }
}

/// Moves the bootstrap's static listeners to LDS served from `lds`: returns them (publish them
/// with [`XdsFile::publish_listeners`] before Envoy starts).
pub fn listeners_to_lds(bootstrap: &mut Value, lds: &XdsFile) -> Result<Vec<Value>> {
    let listeners = at(bootstrap, &["static_resources", "listeners"])?;
    let taken = std::mem::take(listeners).as_sequence().cloned().ok_or_else(|| anyhow!("listeners is not a list"))?;
    if let Value::Mapping(sr) = at(bootstrap, &["static_resources"])? {
        sr.remove("listeners");
    }
    let mut dynamic = Mapping::new();
    dynamic.insert("lds_config".into(), lds.config_source());
    if let Value::Mapping(m) = bootstrap {
        m.insert("dynamic_resources".into(), Value::Mapping(dynamic));
    }
    Ok(taken)
}

/// Replaces wasm filter `name` in `filters` by a `config_discovery` entry reading `ecds` and
/// returns the filter's `typed_config` (publish it with [`XdsFile::publish_extension`]).
pub fn filter_to_ecds(filters: &mut [Value], name: &str, ecds: &XdsFile) -> Result<Value> {
    let i = wasm_filter_index(filters, name)?;
    let filter = filters.get_mut(i).ok_or_else(|| anyhow!("no filter {i}"))?;
    let typed = filter.get("typed_config").cloned().ok_or_else(|| anyhow!("filter {name} has no typed_config"))?;
    let mut discovery = Mapping::new();
    discovery.insert("config_source".into(), ecds.config_source());
    discovery.insert("type_urls".into(), Value::Sequence(vec![WASM_TYPE.into()]));
    let mut entry = Mapping::new();
    entry.insert("name".into(), name.into());
    entry.insert("config_discovery".into(), Value::Mapping(discovery));
    *filter = Value::Mapping(entry);
    Ok(typed)
}

/// Sets the policy `json` of `name` (`sluice_tenant_budget`) inside a wasm filter's
/// `typed_config` ([`configuration_with`]).
pub fn with_plugin_config(typed_config: &Value, name: &str, json: &str) -> Result<Value> {
    let configuration = configuration_with(typed_config, name, json)?;
    let mut t = typed_config.clone();
    *at(&mut t, &["config", "configuration", "value"])? = Value::String(configuration);
    Ok(t)
}

/// How to run one Envoy process.
#[derive(Debug, Clone)]
pub struct Launch {
    pub concurrency: u32,
    /// `Some((base id, epoch))`: hot restart on, with this shared-memory base id and restart epoch;
    /// `None`: `--disable-hot-restart`.
    pub hot_restart: Option<(u32, u32)>,
    /// Extra arguments (`--drain-time-s`, `--parent-shutdown-time-s`, …).
    pub args: Vec<String>,
}

impl Launch {
    pub fn plain(concurrency: u32) -> Launch {
        Launch { concurrency, hot_restart: None, args: Vec::new() }
    }
}

/// A base id no other test of this process uses, in a range far from [`crate::Envoy`]'s (which runs
/// with hot restart off, so its ids reserve nothing anyway).
pub fn hot_restart_base_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Above the ids `Envoy` hands out (below 10^8), and small enough that Envoy's shared-memory
    // name (ten per base id, one per epoch) stays within 32 bits.
    200_000_000 + (std::process::id() % 1_000_000) * 10 + NEXT.fetch_add(1, Ordering::Relaxed) % 10
}

/// An Envoy process on a config file the test wrote; killed on drop.
pub struct EnvoyProcess {
    child: Option<Child>,
    pub site: Site,
    stderr: PathBuf,
}

impl EnvoyProcess {
    /// Writes `config` to `<scratch>/<name>.yaml`, starts Envoy on it and waits (20 s) for its admin
    /// endpoint to say `LIVE`.
    pub fn start(scratch: &Scratch, name: &str, config: &Value, site: &Site, launch: &Launch) -> Result<EnvoyProcess> {
        let path = scratch.join(&format!("{name}.yaml"));
        std::fs::write(&path, serde_yaml::to_string(config)?)?;
        let mut p = EnvoyProcess::spawn(scratch, name, &path, site, launch)?;
        p.wait_live(Duration::from_secs(20))?;
        Ok(p)
    }

    /// Starts Envoy on the file at `path` without waiting.
    pub fn spawn(scratch: &Scratch, name: &str, path: &Path, site: &Site, launch: &Launch) -> Result<EnvoyProcess> {
        let tools = Tools::locate()?;
        let stderr = scratch.join(&format!("{name}.stderr"));
        let mut cmd = Command::new(&tools.envoy);
        cmd.arg("-c").arg(path).args(["--concurrency", &launch.concurrency.to_string(), "--log-level", "warn", "--file-flush-interval-msec", "100"]);
        match launch.hot_restart {
            Some((base, epoch)) => cmd.args(["--base-id", &base.to_string(), "--restart-epoch", &epoch.to_string()]),
            None => cmd.arg("--disable-hot-restart"),
        };
        cmd.args(&launch.args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(std::fs::File::create(&stderr)?);
        let child = cmd.spawn().with_context(|| format!("starting {}", tools.envoy.display()))?;
        Ok(EnvoyProcess { child: Some(child), site: site.clone(), stderr })
    }

    /// Waits for admin `/ready` to answer `LIVE`.
    pub fn wait_live(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(r) = http::get(self.admin_addr(), "/ready") {
                if r.status == 200 && r.text().trim() == "LIVE" {
                    return Ok(());
                }
            }
            if let Some(status) = self.exited() {
                bail!("Envoy exited during startup ({status}); stderr:\n{}", self.stderr_tail(40));
            }
            if Instant::now() >= deadline {
                bail!("Envoy not LIVE after {timeout:?}; stderr:\n{}", self.stderr_tail(40));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its exit status once it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits up to `timeout` for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn stderr_tail(&self, n: usize) -> String {
        tail(&self.stderr, n)
    }
    /// Everything Envoy wrote to stderr.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.site.admin_port))
    }
    pub fn listen_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.site.listen_port))
    }
    pub fn access_log(&self) -> AccessLog {
        AccessLog::new(&self.site.access_log)
    }
    /// `GET` on the admin endpoint; non-200 is an error.
    pub fn admin_get(&self, path: &str) -> Result<String> {
        let r = http::get(self.admin_addr(), path)?;
        if r.status != 200 {
            bail!("admin {path}: status {}: {}", r.status, r.text());
        }
        Ok(r.text())
    }
    /// `/stats/prometheus`, parsed.
    pub fn metrics(&self) -> Result<Metrics> {
        Metrics::parse(&self.admin_get("/stats/prometheus")?)
    }
    /// One counter or gauge of admin `/stats` by its Envoy name (`listener_manager.lds.update_success`),
    /// `None` when Envoy has no such stat.
    pub fn stat(&self, name: &str) -> Result<Option<u64>> {
        let text = self.admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))?;
        Ok(text.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(": ")).and_then(|v| v.trim().parse().ok())))
    }
    /// Waits until stat `name` reaches at least `at_least`.
    pub fn wait_stat(&self, name: &str, at_least: u64, timeout: Duration) -> Result<u64> {
        crate::wait_until(timeout, name, || Ok(self.stat(name)?.filter(|v| *v >= at_least)))
    }
    /// SIGKILL, and wait for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::split_members;

    #[test]
    fn sections_split_at_the_objects_own_commas_placeholders_included() {
        let text = r#"{"model_router": {"a": [1, {"b": "x,}"}]}, "tenant_budget": {{BUDGET_CONFIG}}, "llm_metrics": {"s": "q\"uote"}}"#;
        let members = split_members(text).unwrap();
        assert_eq!(
            members,
            [
                ("model_router".to_string(), r#"{"a": [1, {"b": "x,}"}]}"#.to_string()),
                ("tenant_budget".to_string(), "{{BUDGET_CONFIG}}".to_string()),
                ("llm_metrics".to_string(), r#"{"s": "q\"uote"}"#.to_string()),
            ]
        );
        assert_eq!(split_members("not an object"), None);
    }
}
