//! The gateway: one plugin VM with its root context, started like Envoy starts it, driven by a
//! virtual clock. Tests open streams on it, move time forward, answer callouts and read back what
//! the plugin recorded (metrics, logs, shared data).

use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _, Result};
use wasmtime::{Config, Engine, Instance, Linker, Module, Store, TypedFunc, WasmParams, WasmResults};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{Deterministic, WasiCtxBuilder};

use crate::abi::{property_path, LogLevel, MetricType};
use crate::guest::GuestExports;
use crate::headers::Headers;
use crate::hostcalls;
use crate::hostcalls::callouts::{GrpcCall, HttpCall, HttpReply, Timeout};
use crate::hostcalls::clock::{VirtualClock, DEFAULT_EPOCH_NS};
use crate::hostcalls::metrics::{GaugeChange, Value};
use crate::hostcalls::properties::Properties;
use crate::hostcalls::queues::Queues;
use crate::hostcalls::shared_data::SharedData;
use crate::state::{lock, Deferred, HostState, LogLine, PluginInfo, Shared, ROOT_CONTEXT};
use crate::stream::Stream;
use std::collections::VecDeque;

/// Instructions one callback may run before the host declares the plugin hung.
const FUEL_PER_CALLBACK: u64 = 5_000_000_000;
/// Queue notifications one callback may cause, transitively.
const MAX_DEFERRED: usize = 10_000;

/// A compiled plugin. Compiling is the slow part; one `Plugin` starts any number of gateways and
/// can be shared across threads.
#[derive(Clone)]
pub struct Plugin {
    engine: Engine,
    module: Module,
}

impl Plugin {
    /// Compiles the `.wasm` file at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).with_context(|| {
            format!(
                "cannot read plugin {}: build the wasm plugins first (`cargo xtask build`, or \
                 `cargo build --release --target wasm32-wasip1 -p <plugin>`)",
                path.display()
            )
        })?;
        Self::from_bytes(&bytes).with_context(|| format!("plugin {}", path.display()))
    }

    /// Compiles a module given as bytes (binary or text format).
    pub fn from_bytes(wasm: &[u8]) -> Result<Self> {
        let engine = engine()?;
        let module = Module::new(&engine, wasm)?;
        Ok(Self { engine, module })
    }

    pub(crate) fn module(&self) -> &Module {
        &self.module
    }
}

pub(crate) fn engine() -> Result<Engine> {
    let mut config = Config::new();
    config.consume_fuel(true);
    // `perf` can name the plugins' functions (a /tmp/perf-<pid>.map file) when asked.
    if std::env::var_os("SLUICE_HOST_PERFMAP").is_some() {
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    // Compiling the four plugins takes seconds; wasmtime's on-disk cache (keyed by the module's
    // bytes, the compiler and its settings) makes every later start of an unchanged plugin cheap.
    let mut cache = wasmtime::CacheConfig::new();
    cache.with_directory(crate::workspace_target_dir().join("wasmtime-cache"));
    match wasmtime::Cache::new(cache) {
        Ok(cache) => {
            config.cache(Some(cache));
        }
        Err(error) => eprintln!("sluice-host: compiling without wasmtime's cache: {error:#}"),
    }
    Ok(Engine::new(&config)?)
}

/// A linker with WASI preview 1 and every proxy-wasm hostcall this host implements.
pub(crate) fn linker(engine: &Engine) -> Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |state: &mut HostState| &mut state.wasi)?;
    hostcalls::add_to_linker(&mut linker)?;
    Ok(linker)
}

/// How the plugin is configured, as in Envoy's `envoy.extensions.wasm.v3.PluginConfig`.
#[derive(Clone, Debug)]
pub struct PluginSpec {
    name: String,
    root_id: String,
    vm_id: String,
    configuration: Vec<u8>,
    vm_configuration: Vec<u8>,
    log_level: LogLevel,
    keep_logs_from: LogLevel,
    echo_logs: bool,
    watch_gauges: Option<String>,
    start_ns: u64,
    properties: Vec<(Vec<u8>, Vec<u8>)>,
}

impl PluginSpec {
    /// A plugin with this configuration (the buffer `proxy_on_configure` reads).
    pub fn new(configuration: impl Into<Vec<u8>>) -> Self {
        Self {
            name: "sluice".to_owned(),
            root_id: String::new(),
            vm_id: "sluice_vm".to_owned(),
            configuration: configuration.into(),
            vm_configuration: Vec::new(),
            log_level: LogLevel::Trace,
            keep_logs_from: LogLevel::Trace,
            echo_logs: true,
            watch_gauges: None,
            start_ns: DEFAULT_EPOCH_NS,
            properties: Vec::new(),
        }
    }

    /// The `plugin_name` property (default `sluice`).
    pub fn name(mut self, name: &str) -> Self {
        name.clone_into(&mut self.name);
        self
    }

    /// The `plugin_root_id` property (default empty).
    pub fn root_id(mut self, root_id: &str) -> Self {
        root_id.clone_into(&mut self.root_id);
        self
    }

    /// The VM id (default `sluice_vm`), used by `proxy_resolve_shared_queue`.
    pub fn vm_id(mut self, vm_id: &str) -> Self {
        vm_id.clone_into(&mut self.vm_id);
        self
    }

    /// The buffer `proxy_on_vm_start` reads.
    pub fn vm_configuration(mut self, vm_configuration: impl Into<Vec<u8>>) -> Self {
        self.vm_configuration = vm_configuration.into();
        self
    }

    /// What `proxy_get_log_level` answers (default `Trace`; every line is kept anyway).
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.log_level = level;
        self
    }

    pub(crate) fn start_ns(&self) -> u64 {
        self.start_ns
    }

    pub(crate) fn plugin_name(&self) -> &str {
        &self.name
    }

    /// Keeps (and prints) only log lines at `level` or above; the rest are dropped as they come
    /// (default: keep everything). Long runs use it so that the log does not grow with traffic.
    pub fn keep_logs_from(mut self, level: LogLevel) -> Self {
        self.keep_logs_from = level;
        self
    }

    /// Keeps every change of value of the gauges whose names start with `prefix`, with its time
    /// ([`Gateway::gauge_changes`]): a plugin's state changes as values, not log text.
    pub fn watch_gauges(mut self, prefix: &str) -> Self {
        self.watch_gauges = Some(prefix.to_owned());
        self
    }

    /// Whether kept log lines are also printed to stderr (default: yes).
    pub fn echo_logs(mut self, echo: bool) -> Self {
        self.echo_logs = echo;
        self
    }

    /// Starts the virtual clock at `t` instead of 2026-01-01T00:00:00Z.
    pub fn start_time(mut self, t: SystemTime) -> Self {
        let since_epoch = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        self.start_ns = u64::try_from(since_epoch.as_nanos()).unwrap_or(u64::MAX);
        self
    }

    /// A property every context sees (e.g. `["node", "id"]`), unless a stream overrides it.
    pub fn property(mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Self {
        self.properties.push((property_path(path), value.into()));
        self
    }
}

/// The VM and what it takes to call into it.
pub(crate) struct Runtime {
    pub store: Store<HostState>,
    instance: Instance,
    /// Why the VM died, once it has.
    crashed: Option<String>,
    /// The exports called so far, with the work their calls did (the profile that
    /// `Gateway::profile` reports).
    exports: Vec<Export>,
}

/// An export, looked up and typed on its first call: by name on every callback, the lookup and
/// the type check were about a tenth of the host's time.
struct Export {
    name: &'static str,
    /// A `TypedFunc<P, R>` (one signature per name, in practice).
    func: Box<dyn Any + Send + Sync>,
    profile: CallProfile,
}

impl Export {
    fn is<P: 'static, R: 'static>(&self, name: &str) -> bool {
        // Names are literals: the same pointer, usually, before comparing the bytes.
        (std::ptr::eq(self.name, name) || self.name == name) && self.func.is::<TypedFunc<P, R>>()
    }
}

/// What the calls of one export cost the guest: calls, wasm fuel (≈ instructions executed) and
/// hostcalls made. Fuel is deterministic, so a profile compares builds without timing noise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallProfile {
    pub calls: u64,
    pub fuel: u64,
    pub hostcalls: u64,
}

impl Runtime {
    /// Calls the export `name` for `context_id`, then delivers the work the call left behind.
    pub fn call<P: WasmParams + 'static, R: WasmResults + 'static>(&mut self, context_id: u32, name: &'static str, params: P) -> Result<R> {
        let result = self.call_one(context_id, name, params)?;
        self.run_deferred()?;
        Ok(result)
    }

    fn call_one<P: WasmParams + 'static, R: WasmResults + 'static>(&mut self, context_id: u32, name: &'static str, params: P) -> Result<R> {
        if let Some(why) = &self.crashed {
            bail!("the plugin VM crashed earlier and takes no more calls; it crashed with: {why}");
        }
        let Runtime { store, instance, exports, .. } = self;
        let at = match exports.iter().position(|export| export.is::<P, R>(name)) {
            Some(at) => at,
            None => {
                let func = instance.get_typed_func::<P, R>(&mut *store, name).map_err(anyhow::Error::from).with_context(|| format!("plugin export {name}"))?;
                exports.push(Export { name, func: Box::new(func), profile: CallProfile::default() });
                exports.len() - 1
            }
        };
        let export = exports.get_mut(at).context("a cached export")?;
        let func = export.func.downcast_ref::<TypedFunc<P, R>>().context("a cached export of another type")?;
        store.data_mut().effective_context = context_id;
        store.set_fuel(FUEL_PER_CALLBACK)?;
        let hostcalls_before = store.data().hostcalls;
        let result = func.call(&mut *store, params);
        let fuel = FUEL_PER_CALLBACK.saturating_sub(store.get_fuel().unwrap_or(0));
        let entry = &mut export.profile;
        entry.calls += 1;
        entry.fuel += fuel;
        entry.hostcalls += store.data().hostcalls - hostcalls_before;
        match result {
            Ok(result) => Ok(result),
            Err(error) => {
                let error = anyhow::Error::from(error);
                let report = self.crash_report(name, context_id, &error);
                self.crashed = Some(report.clone());
                Err(error.context(report))
            }
        }
    }

    /// Runs the deferred work that concerns this VM; a chain delivers the rest to its owners.
    fn run_deferred(&mut self) -> Result<()> {
        let vm = self.store.data().vm;
        for _ in 0..MAX_DEFERRED {
            let work = {
                let mut deferred = lock(&self.store.data().deferred);
                let mine = deferred.iter().position(|Deferred::QueueReady { vm: owner, .. }| *owner == vm);
                mine.and_then(|at| deferred.remove(at))
            };
            let Some(work) = work else {
                return Ok(());
            };
            match work {
                Deferred::QueueReady { context_id, queue_id, .. } => {
                    self.call_one::<(u32, u32), ()>(context_id, "proxy_on_queue_ready", (context_id, queue_id))?;
                }
            }
        }
        bail!("queue notifications keep causing more (over {MAX_DEFERRED})")
    }

    fn crash_report(&self, export: &str, context_id: u32, error: &anyhow::Error) -> String {
        let state = self.store.data();
        let mut report = format!("plugin trapped in {export} (context {context_id}): {error:#}");
        let stderr = state.stderr.contents();
        if !stderr.is_empty() {
            report.push_str(&format!("\nplugin stderr:\n{}", String::from_utf8_lossy(&stderr)));
        }
        let serious: Vec<_> = state.logs.iter().filter(|l| l.level >= LogLevel::Error).collect();
        if !serious.is_empty() {
            report.push_str("\nplugin error logs:");
            for line in serious.iter().rev().take(5).rev() {
                report.push_str(&format!("\n  [{}] {}", line.level, line.message));
            }
        }
        report
    }

    pub fn state(&self) -> &HostState {
        self.store.data()
    }

    pub fn state_mut(&mut self) -> &mut HostState {
        self.store.data_mut()
    }
}

/// One plugin VM behind a virtual clock, started and configured.
///
/// All methods take `&self`, so streams ([`Gateway::stream`]) can be held and interleaved while
/// the clock moves. A trap in the plugin makes every later call fail, like a crashed VM in Envoy.
pub struct Gateway {
    runtime: RefCell<Runtime>,
}

impl Gateway {
    /// Compiles the plugin at `wasm` and starts it with `configuration`.
    ///
    /// Fails, with the plugin's error logs, if `proxy_on_vm_start` or `proxy_on_configure`
    /// returns false.
    pub fn load(wasm: impl AsRef<Path>, configuration: &str) -> Result<Self> {
        Self::start(&Plugin::load(wasm)?, PluginSpec::new(configuration))
    }

    /// Like [`Gateway::load`], for a module given as bytes.
    pub fn from_bytes(wasm: &[u8], configuration: &str) -> Result<Self> {
        Self::start(&Plugin::from_bytes(wasm)?, PluginSpec::new(configuration))
    }

    /// Instantiates `plugin` and runs its start-up: `_initialize`, the root context,
    /// `proxy_on_vm_start`, `proxy_on_configure`.
    pub fn start(plugin: &Plugin, spec: PluginSpec) -> Result<Self> {
        let state = host_state(spec, None);
        Self::start_with(plugin, state)
    }

    /// Starts a VM whose state was prepared by the caller (a chain shares parts of it).
    pub(crate) fn start_with(plugin: &Plugin, state: HostState) -> Result<Self> {
        let mut linker = linker(&plugin.engine)?;
        linker.define_unknown_imports_as_traps(&plugin.module)?;
        let mut store = Store::new(&plugin.engine, state);
        store.set_fuel(FUEL_PER_CALLBACK)?;
        store.call_hook(|mut store, hook| {
            if matches!(hook, wasmtime::CallHook::CallingHost) {
                store.data_mut().hostcalls += 1;
            }
            Ok(())
        });
        let instance = linker.instantiate(&mut store, &plugin.module)?;
        if instance.get_func(&mut store, "proxy_abi_version_0_2_1").is_none() {
            bail!("the module does not export proxy_abi_version_0_2_1: not a proxy-wasm 0.2.1 plugin");
        }
        let guest = GuestExports::of(&instance, &mut store);
        store.data_mut().guest = guest;
        let mut runtime = Runtime { store, instance, crashed: None, exports: Vec::new() };
        let init = ["_initialize", "_start"].into_iter().find(|name| runtime.instance.get_func(&mut runtime.store, name).is_some());
        if let Some(init) = init {
            runtime.call::<(), ()>(ROOT_CONTEXT, init, ())?;
        }
        runtime.call::<(u32, u32), ()>(ROOT_CONTEXT, "proxy_on_context_create", (ROOT_CONTEXT, 0))?;
        let vm_config_len = len_u32(runtime.state().plugin.vm_configuration.len());
        let started: u32 = runtime.call(ROOT_CONTEXT, "proxy_on_vm_start", (ROOT_CONTEXT, vm_config_len))?;
        if started == 0 {
            bail!("proxy_on_vm_start returned false{}", error_logs(runtime.state()));
        }
        let config_len = len_u32(runtime.state().plugin.configuration.len());
        let configured: u32 = runtime.call(ROOT_CONTEXT, "proxy_on_configure", (ROOT_CONTEXT, config_len))?;
        if configured == 0 {
            bail!("the plugin rejected its configuration (proxy_on_configure returned false){}", error_logs(runtime.state()));
        }
        Ok(Self { runtime: RefCell::new(runtime) })
    }

    /// Calls, fuel and hostcalls per export since the VM started (start-up included).
    pub fn profile(&self) -> Vec<(String, CallProfile)> {
        let mut profile: BTreeMap<&str, CallProfile> = BTreeMap::new();
        for export in self.runtime.borrow().exports.iter().filter(|e| e.profile.calls > 0) {
            let p = profile.entry(export.name).or_default();
            p.calls += export.profile.calls;
            p.fuel += export.profile.fuel;
            p.hostcalls += export.profile.hostcalls;
        }
        profile.into_iter().map(|(name, p)| (name.to_owned(), p)).collect()
    }

    /// Forgets the profile so far (e.g. after warm-up).
    pub fn reset_profile(&self) {
        for export in &mut self.runtime().exports {
            export.profile = CallProfile::default();
        }
    }

    pub(crate) fn runtime(&self) -> std::cell::RefMut<'_, Runtime> {
        self.runtime.borrow_mut()
    }

    fn state<T>(&self, read: impl FnOnce(&HostState) -> T) -> T {
        read(self.runtime.borrow().state())
    }

    /// A new HTTP stream. Its context is created in the plugin at its first event.
    pub fn stream(&self) -> Stream<'_> {
        let id = self.runtime().state_mut().new_stream();
        Stream::new(self, id)
    }

    /// Whether a trap has killed the VM.
    pub fn crashed(&self) -> Option<String> {
        self.runtime.borrow().crashed.clone()
    }

    // ---- time ----

    /// Virtual time, in nanoseconds since the Unix epoch.
    pub fn now_ns(&self) -> u64 {
        self.state(|s| s.clock.now_ns())
    }

    /// Virtual time.
    pub fn now(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_nanos(self.now_ns())
    }

    /// Moves the clock forward by `by`. Every tick and callout timeout due on the way fires at its
    /// exact time, in time order.
    pub fn advance(&self, by: Duration) -> Result<()> {
        let target = self.now_ns().saturating_add(u64::try_from(by.as_nanos()).unwrap_or(u64::MAX));
        while let Some((at, event)) = self.next_event().filter(|(at, _)| *at <= target) {
            self.fire_event(at, event)?;
        }
        self.state(|s| s.clock.set_ns(target));
        Ok(())
    }

    /// The next tick or callout timeout this VM is waiting for: its time and which.
    pub(crate) fn next_event(&self) -> Option<(u64, Option<Timeout>)> {
        self.state(|state| {
            let tick = state.timer.due_ns().map(|at| (at, None));
            let timeout = state.callouts.next_deadline().map(|(at, t)| (at, Some(t)));
            [tick, timeout].into_iter().flatten().min()
        })
    }

    /// Moves the clock to `at` and delivers `event` (a tick when `None`).
    pub(crate) fn fire_event(&self, at: u64, event: Option<Timeout>) -> Result<()> {
        self.state(|s| s.clock.set_ns(at));
        match event {
            None => self.fire_tick(at),
            Some(Timeout::Http(token)) => self.fail_http_call(token),
            Some(Timeout::Grpc(token)) => self.grpc_close(token, 4, "deadline exceeded"),
        }
    }

    fn fire_tick(&self, at: u64) -> Result<()> {
        let mut runtime = self.runtime();
        runtime.state_mut().timer.fire(at);
        runtime.call::<u32, ()>(ROOT_CONTEXT, "proxy_on_tick", ROOT_CONTEXT)
    }

    /// The tick period the plugin set, if any.
    pub fn tick_period(&self) -> Option<Duration> {
        self.state(|s| s.timer.period_ns.map(Duration::from_nanos))
    }

    /// Ticks delivered so far.
    pub fn ticks(&self) -> u64 {
        self.state(|s| s.timer.fired)
    }

    // ---- what the plugin recorded ----

    /// Everything the plugin logged, in order.
    pub fn logs(&self) -> Vec<LogLine> {
        self.state(|s| s.logs.clone())
    }

    /// Log messages at `level` or above.
    pub fn logs_at_least(&self, level: LogLevel) -> Vec<String> {
        self.state(|s| s.logs.iter().filter(|l| l.level >= level).map(|l| l.message.clone()).collect())
    }

    /// The value of counter `name`, if defined.
    pub fn counter(&self, name: &str) -> Option<u64> {
        self.state(|s| match s.metrics.find(MetricType::Counter, name) {
            Some(Value::Counter(v)) => Some(*v),
            _ => None,
        })
    }

    /// The value of gauge `name`, if defined.
    pub fn gauge(&self, name: &str) -> Option<i64> {
        self.state(|s| match s.metrics.find(MetricType::Gauge, name) {
            Some(Value::Gauge(v)) => Some(*v),
            _ => None,
        })
    }

    /// The changes of the gauges watched with [`PluginSpec::watch_gauges`], in order.
    pub fn gauge_changes(&self) -> Vec<GaugeChange> {
        self.state(|s| s.metrics.gauge_changes().to_vec())
    }

    /// Every sample recorded in histogram `name`, in order, if defined.
    pub fn histogram(&self, name: &str) -> Option<Vec<u64>> {
        self.state(|s| match s.metrics.find(MetricType::Histogram, name) {
            Some(Value::Histogram(v)) => Some(v.clone()),
            _ => None,
        })
    }

    /// Every metric name the plugin defined, in definition order.
    pub fn metric_names(&self) -> Vec<String> {
        self.state(|s| s.metrics.names())
    }

    /// How many times the plugin called `proxy_done`.
    pub fn done_calls(&self) -> u32 {
        self.state(|s| s.done_calls)
    }

    /// Size of the plugin's linear memory (its exported `memory`) in bytes, or `None` when it
    /// exports none. Wasm memory only grows, so this is the high-water mark of the plugin's heap:
    /// compare it before and after a workload to check the plugin's memory stays bounded.
    pub fn memory_bytes(&self) -> Option<usize> {
        let mut runtime = self.runtime();
        let Runtime { store, instance, .. } = &mut *runtime;
        instance.get_memory(&mut *store, "memory").map(|memory| memory.data_size(&*store))
    }

    /// Starts another VM of `plugin` in this gateway's process, with `spec`'s configuration: it
    /// shares this one's clock, shared data and shared queues, as the VM Envoy starts for a filter
    /// configuration delivered through ECDS does, while this VM goes on serving the streams it
    /// has. `spec`'s start time is ignored (the clock is this process's).
    pub fn start_beside(&self, plugin: &Plugin, spec: PluginSpec) -> Result<Gateway> {
        let process = self.state(|s| Process {
            clock: s.clock.clone(),
            shared_data: s.shared_data.clone(),
            queues: s.queues.clone(),
            deferred: s.deferred.clone(),
            next_vm: s.vm.saturating_add(1),
        });
        Self::start_with(plugin, host_state(spec, Some(&process)))
    }

    /// The configuration this VM's plugin was configured with.
    pub fn configuration(&self) -> Vec<u8> {
        self.state(|s| s.plugin.configuration.clone())
    }

    // ---- shared state ----

    /// The shared-data value under `key`.
    pub fn shared_data(&self, key: &str) -> Option<Vec<u8>> {
        self.state(|s| lock(&s.shared_data).get(key).map(|(v, _)| v.to_vec()))
    }

    /// Every shared-data key, in order.
    pub fn shared_data_keys(&self) -> Vec<String> {
        self.state(|s| lock(&s.shared_data).keys())
    }

    /// Writes shared data as another worker would (the CAS changes).
    pub fn set_shared_data(&self, key: &str, value: impl Into<Vec<u8>>) {
        // A write with CAS 0 always succeeds.
        let _ = lock(&self.runtime().state().shared_data).set(key, Some(value.into()), 0);
    }

    /// A property every context sees (filter state or an attribute the test controls).
    pub fn set_property(&self, path: &[&str], value: impl Into<Vec<u8>>) {
        self.runtime().state_mut().properties.set(property_path(path), value.into());
    }

    /// What the plugin set on its root context under `path` (or what the test set for everyone).
    pub fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.state(|s| crate::hostcalls::properties::lookup(s, None, &property_path(path)))
    }

    /// Enqueues `item` on the queue `name` as another worker would, and notifies its owner.
    pub fn enqueue(&self, name: &str, item: impl Into<Vec<u8>>) -> Result<()> {
        let mut runtime = self.runtime();
        let (id, owner) = {
            let mut queues = lock(&runtime.state().queues);
            let id = queues.find(name).with_context(|| format!("no shared queue named {name:?}"))?;
            let (_vm, owner) = queues.enqueue(id, item.into()).map_err(|s| anyhow::anyhow!("enqueue: {s:?}"))?;
            (id, owner)
        };
        runtime.call::<(u32, u32), ()>(owner, "proxy_on_queue_ready", (owner, id))
    }

    /// Tells `context_id` that queue `queue_id` has items (a chain delivers other VMs' enqueues).
    pub(crate) fn queue_ready(&self, context_id: u32, queue_id: u32) -> Result<()> {
        let mut runtime = self.runtime();
        if !runtime.state().context_exists(context_id) {
            return Ok(());
        }
        runtime.call::<(u32, u32), ()>(context_id, "proxy_on_queue_ready", (context_id, queue_id))
    }

    /// The items waiting in queue `name`, oldest first.
    pub fn queue_items(&self, name: &str) -> Option<Vec<Vec<u8>>> {
        self.state(|s| lock(&s.queues).items(name))
    }

    // ---- callouts ----

    /// HTTP callouts waiting for a reply, oldest first.
    pub fn http_calls(&self) -> Vec<HttpCall> {
        self.state(|s| s.callouts.http.values().cloned().collect())
    }

    /// Delivers `reply` to callout `token` (`proxy_on_http_call_response`).
    pub fn respond_http_call(&self, token: u32, reply: HttpReply) -> Result<()> {
        self.finish_http_call(token, Some(reply))
    }

    /// Fails callout `token` as a reset or timeout does: the plugin is called with no headers,
    /// body or trailers.
    pub fn fail_http_call(&self, token: u32) -> Result<()> {
        self.finish_http_call(token, None)
    }

    fn finish_http_call(&self, token: u32, reply: Option<HttpReply>) -> Result<()> {
        let mut runtime = self.runtime();
        let call = runtime.state_mut().callouts.http.remove(&token).with_context(|| format!("no HTTP callout with token {token} is pending"))?;
        let context = call.context_id;
        if !runtime.state().context_exists(context) {
            return Ok(()); // the stream that asked is gone
        }
        let sizes = reply.as_ref().map_or((0, 0, 0), |r| (len_u32(r.headers.len()), len_u32(r.body.len()), len_u32(r.trailers.len())));
        runtime.state_mut().callback.http_reply = reply;
        let result = runtime.call::<(u32, u32, u32, u32, u32), ()>(context, "proxy_on_http_call_response", (context, token, sizes.0, sizes.1, sizes.2));
        runtime.state_mut().callback.http_reply = None;
        result
    }

    /// gRPC calls and streams still open, oldest first.
    pub fn grpc_calls(&self) -> Vec<GrpcCall> {
        self.state(|s| s.callouts.grpc.values().cloned().collect())
    }

    /// Answers unary call `token` successfully with `message`.
    pub fn grpc_reply(&self, token: u32, message: impl Into<Vec<u8>>) -> Result<()> {
        let message = message.into();
        self.grpc_deliver(token, true, |state| {
            state.callback.grpc_message = Some(message.clone());
            ("proxy_on_grpc_receive", len_u32(message.len()))
        })
    }

    /// Sends `message` to the plugin on stream `token`.
    pub fn grpc_stream_message(&self, token: u32, message: impl Into<Vec<u8>>) -> Result<()> {
        let message = message.into();
        self.grpc_deliver(token, false, |state| {
            state.callback.grpc_message = Some(message.clone());
            ("proxy_on_grpc_receive", len_u32(message.len()))
        })
    }

    /// Delivers initial metadata on stream `token`.
    pub fn grpc_initial_metadata(&self, token: u32, metadata: Headers) -> Result<()> {
        self.grpc_deliver(token, false, |state| {
            let n = len_u32(metadata.len());
            state.callback.grpc_metadata = Some(metadata.clone());
            ("proxy_on_grpc_receive_initial_metadata", n)
        })
    }

    /// Delivers trailing metadata on stream `token`.
    pub fn grpc_trailing_metadata(&self, token: u32, metadata: Headers) -> Result<()> {
        self.grpc_deliver(token, false, |state| {
            let n = len_u32(metadata.len());
            state.callback.grpc_metadata = Some(metadata.clone());
            ("proxy_on_grpc_receive_trailing_metadata", n)
        })
    }

    /// Ends call or stream `token` with gRPC `status` (0 is OK) and `message`
    /// (`proxy_on_grpc_close`; the plugin reads both with `proxy_get_status`).
    pub fn grpc_close(&self, token: u32, status: u32, message: &str) -> Result<()> {
        self.grpc_deliver(token, true, |state| {
            state.callback.grpc_status = Some((status, message.to_owned()));
            ("proxy_on_grpc_close", status)
        })
    }

    /// Runs one gRPC callback for `token`; `last` removes the call first.
    fn grpc_deliver(&self, token: u32, last: bool, prepare: impl FnOnce(&mut HostState) -> (&'static str, u32)) -> Result<()> {
        let mut runtime = self.runtime();
        let state = runtime.state_mut();
        let context = match (last, state.callouts.grpc.get(&token)) {
            (_, None) => bail!("no gRPC call or stream with token {token} is open"),
            (true, Some(_)) => state.callouts.grpc.remove(&token).map_or(0, |c| c.context_id),
            (false, Some(call)) => call.context_id,
        };
        if !state.context_exists(context) {
            return Ok(());
        }
        let (export, arg) = prepare(state);
        let result = runtime.call::<(u32, u32, u32), ()>(context, export, (context, token, arg));
        runtime.state_mut().callback = Default::default();
        result
    }
}

/// The host state a gateway starts with: WASI with captured output, the virtual clock behind
/// its clocks and deterministic randomness (so hash maps in the plugin iterate the same way on
/// every run).
pub(crate) fn host_state(spec: PluginSpec, process: Option<&Process>) -> HostState {
    let clock = process.map_or_else(|| VirtualClock::starting_at(spec.start_ns), |p| p.clock.clone());
    let stderr = MemoryOutputPipe::new(1 << 20);
    let stdout = MemoryOutputPipe::new(1 << 20);
    let seed: Vec<u8> = (0..=255).collect();
    let wasi = WasiCtxBuilder::new()
        .stdout(stdout)
        .stderr(stderr.clone())
        .wall_clock(clock.clone())
        .monotonic_clock(clock.clone())
        .secure_random(Deterministic::new(seed.clone()))
        .insecure_random(Deterministic::new(seed))
        .insecure_random_seed(0)
        .build_p1();
    let info = PluginInfo {
        name: spec.name,
        root_id: spec.root_id,
        vm_id: spec.vm_id,
        configuration: spec.configuration,
        vm_configuration: spec.vm_configuration,
        log_level: spec.log_level,
    };
    let mut state = HostState::new(wasi, stderr, clock, info);
    state.keep_logs_from = spec.keep_logs_from;
    state.echo_logs = spec.echo_logs;
    if let Some(prefix) = &spec.watch_gauges {
        state.metrics.watch_gauges(prefix);
    }
    if let Some(process) = process {
        state.vm = process.next_vm;
        state.shared_data = process.shared_data.clone();
        state.queues = process.queues.clone();
        state.deferred = process.deferred.clone();
    }
    for (path, value) in spec.properties {
        state.properties.set(path, value);
    }
    state
}

fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

fn error_logs(state: &HostState) -> String {
    let lines: Vec<_> = state.logs.iter().filter(|l| l.level >= LogLevel::Warn).map(|l| format!("\n  [{}] {}", l.level, l.message)).collect();
    if lines.is_empty() {
        String::new()
    } else {
        format!("; plugin logs:{}", lines.concat())
    }
}

/// What the VMs of one Envoy process share: the clock, shared data, shared queues and the work
/// queue notifications leave for whichever VM owns the queue.
pub(crate) struct Process {
    pub clock: VirtualClock,
    pub shared_data: Shared<SharedData>,
    pub queues: Shared<Queues>,
    pub deferred: Shared<VecDeque<Deferred>>,
    /// The index the next VM started in this process gets.
    pub next_vm: u32,
}

impl Process {
    pub fn new(start_ns: u64) -> Self {
        Self { clock: VirtualClock::starting_at(start_ns), shared_data: Shared::default(), queues: Shared::default(), deferred: Shared::default(), next_vm: 0 }
    }
}

/// A fresh, empty property store for one stream (shared by a chain's filters).
pub(crate) fn stream_properties() -> Shared<Properties> {
    Shared::default()
}

impl Gateway {
    /// A new stream whose filter state is `properties` (shared with the chain's other filters).
    pub(crate) fn stream_sharing(&self, properties: Shared<Properties>) -> u32 {
        let mut runtime = self.runtime();
        let id = runtime.state_mut().new_stream();
        if let Some(stream) = runtime.state_mut().streams.get_mut(&id) {
            stream.properties = properties;
        }
        id
    }

    /// Drops a finished stream's host-side record, so a long run does not keep every stream.
    pub(crate) fn forget_stream(&self, id: u32) {
        self.runtime().state_mut().streams.remove(&id);
    }

    /// The streams whose flow changed outside their own callbacks since the last call.
    pub(crate) fn take_touched(&self) -> Vec<u32> {
        std::mem::take(&mut self.runtime().state_mut().touched)
    }
}
