//! Reports: percentiles, context buckets, the summary of a hand-built verdict set, the HTML page
//! (well-formed XML, every section, untrusted names escaped) and the comparison of two scenarios.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use sluice_sim::report::{
    compare, context_bucket, percentile, render_compare_html, render_html, sorted, summarize, ReportInput, Source, Summary, MAX_LISTED_DIFFERENCES,
};
use sluice_sim::verdict::{Decision, Sample, Stamps, Transition, Verdict};

fn verdict(line: u64, arrival_ms: f64, tenant: Option<&str>, version: Option<&str>, decision: Decision) -> Verdict {
    Verdict {
        line,
        arrival_ms,
        tenant: tenant.map(str::to_string),
        key: None,
        user: None,
        api: "chat_completions".into(),
        model: Some("llama".into()),
        prompt_tokens: 0,
        stream: false,
        decision,
        status: if decision == Decision::Refused { 429 } else { 200 },
        code: None,
        refused_by: None,
        outcome: if decision == Decision::Refused { "refused".into() } else { "completed".into() },
        version: version.map(str::to_string),
        route_reason: None,
        shadow_version: None,
        ttft_ms: None,
        tpot_ms: None,
        duration_ms: 0.0,
        input_tokens: 0,
        output_tokens: 0,
        cost_usd: None,
        ctx: None,
        turn: None,
        quality: None,
        upstream_concurrency: None,
        upstream: None,
        stamps: Stamps::default(),
    }
}

/// Five requests whose every figure is worked out by hand in `summary_of_a_known_set`.
fn known_set() -> Vec<Verdict> {
    let mut v1 = verdict(1, 0.0, Some("acme"), Some("v1"), Decision::Admitted);
    (v1.stream, v1.ttft_ms, v1.tpot_ms, v1.duration_ms) = (true, Some(100.0), Some(10.0), 1100.0);
    (v1.prompt_tokens, v1.input_tokens, v1.output_tokens, v1.cost_usd, v1.turn) = (1000, 1000, 11, Some(0.01), Some("first".into()));

    let mut v2 = verdict(2, 1000.0, Some("acme"), Some("v1"), Decision::Admitted);
    (v2.stream, v2.ttft_ms, v2.tpot_ms, v2.duration_ms) = (true, Some(300.0), Some(30.0), 2300.0);
    (v2.prompt_tokens, v2.input_tokens, v2.output_tokens, v2.cost_usd, v2.turn) = (1025, 1025, 21, Some(0.02), Some("follow_up".into()));
    v2.outcome = "client_disconnect".into();

    let mut v3 = verdict(3, 2000.0, Some("globex"), Some("v2"), Decision::Clamped);
    (v3.duration_ms, v3.prompt_tokens, v3.input_tokens, v3.output_tokens, v3.cost_usd) = (500.0, 500, 500, 100, Some(0.03));
    (v3.turn, v3.shadow_version) = (Some("first".into()), Some("qwen".into()));

    let mut v4 = verdict(4, 3000.0, None, None, Decision::Refused);
    (v4.code, v4.refused_by) = (Some("key:x:minute:total_tokens".into()), Some("tenant-budget".into()));

    let mut v5 = verdict(5, 4000.0, Some("globex"), Some("v2"), Decision::Refused);
    (v5.code, v5.refused_by, v5.status) = (Some("shed_in_flight".into()), Some("latency-guard".into()), 503);
    vec![v1, v2, v3, v4, v5]
}

fn input<'a>(verdicts: &'a [Verdict], samples: &'a [Sample], transitions: &'a [Transition]) -> ReportInput<'a> {
    ReportInput { title: "test report", source: Source::Simulated, verdicts, samples, transitions }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn percentiles_are_nearest_rank() {
    let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(percentile(&hundred, 50.0), Some(50.0));
    assert_eq!(percentile(&hundred, 99.0), Some(99.0));
    assert_eq!(percentile(&hundred, 100.0), Some(100.0));
    assert_eq!(percentile(&hundred, 0.5), Some(1.0));
    let five = [15.0, 20.0, 35.0, 40.0, 50.0];
    assert_eq!(percentile(&five, 5.0), Some(15.0));
    assert_eq!(percentile(&five, 25.0), Some(20.0), "rank ⌈1.25⌉ = 2: rounded up, not to the nearest");
    assert_eq!(percentile(&hundred, 90.2), Some(91.0));
    assert_eq!(percentile(&five, 30.0), Some(20.0));
    assert_eq!(percentile(&five, 40.0), Some(20.0));
    assert_eq!(percentile(&five, 50.0), Some(35.0));
    assert_eq!(percentile(&five, 99.0), Some(50.0));
    assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    assert_eq!(percentile(&[], 50.0), None);
    assert_eq!(percentile(&five, 0.0), None);
    // sorted() orders and drops what is not a number.
    assert_eq!(sorted([3.0, f64::NAN, 1.0, 2.0, f64::INFINITY]), [1.0, 2.0, 3.0]);
}

#[test]
fn context_bucket_edges_are_inclusive() {
    let cases = [
        (0, "≤1K"),
        (1024, "≤1K"),
        (1025, "≤2K"),
        (2048, "≤2K"),
        (2049, "≤4K"),
        (4096, "≤4K"),
        (8192, "≤8K"),
        (8193, "≤16K"),
        (16384, "≤16K"),
        (16385, ">16K"),
        (u64::MAX, ">16K"),
    ];
    for (tokens, want) in cases {
        assert_eq!(context_bucket(tokens), want, "{tokens} tokens");
    }
}

#[test]
fn summary_of_a_known_set() {
    let verdicts = known_set();
    let s = summarize(&input(&verdicts, &[], &[]));
    assert_eq!(s.requests, 5);
    assert_eq!((s.decisions.admitted, s.decisions.clamped, s.decisions.refused), (2, 1, 2));
    // Sent upstream: 1, 2, 3; completed: 1 and 3.
    assert!(close(s.availability.unwrap(), 2.0 / 3.0));
    assert!(close(s.spend_usd, 0.06));
    assert_eq!((s.input_tokens, s.output_tokens), (2525, 132));
    assert_eq!(s.unrouted, 1);
    assert_eq!((s.first_arrival_ms, s.last_arrival_ms), (Some(0.0), Some(4000.0)));
    assert_eq!(s.refusals_by_code.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(), [("key:x:minute:total_tokens", 1), ("shed_in_flight", 1)]);
    assert_eq!(s.refusals_by_plugin.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(), [("latency-guard", 1), ("tenant-budget", 1)]);

    assert_eq!(s.versions.iter().map(|v| v.version.as_str()).collect::<Vec<_>>(), ["v1", "v2"]);
    let v1 = &s.versions[0];
    assert_eq!((v1.requests, v1.admitted, v1.completed, v1.availability), (2, 2, 1, Some(0.5)));
    assert_eq!((v1.ttft.samples, v1.ttft.p50_ms, v1.ttft.p99_ms), (2, Some(100.0), Some(300.0)));
    assert_eq!((v1.tpot.p50_ms, v1.tpot.p99_ms), (Some(10.0), Some(30.0)));
    // (11 − 1) / 1.0 s and (21 − 1) / 2.0 s: both 10 tokens/s.
    assert_eq!(v1.decode_tokens_per_s_p50, Some(10.0));
    assert_eq!((v1.input_tokens, v1.output_tokens), (2025, 32));
    assert!(close(v1.cost_usd, 0.03));
    assert!(close(v1.usd_per_mtok.unwrap(), 0.03 / 2057.0 * 1e6));
    let v2 = &s.versions[1];
    assert_eq!((v2.requests, v2.admitted, v2.completed, v2.availability), (2, 1, 1, Some(1.0)));
    assert_eq!((v2.ttft.samples, v2.ttft.p50_ms, v2.decode_tokens_per_s_p50), (0, None, None));

    let ctx: Vec<(&str, u64)> = s.context.iter().map(|c| (c.bucket.as_str(), c.requests)).collect();
    assert_eq!(ctx, [("≤1K", 4), ("≤2K", 1), ("≤4K", 0), ("≤8K", 0), ("≤16K", 0), (">16K", 0)]);
    let k1 = &s.context[0].versions;
    assert_eq!(k1.iter().map(|b| (b.version.as_str(), b.requests, b.ttft.p50_ms)).collect::<Vec<_>>(), [("v1", 1, Some(100.0)), ("v2", 2, None)]);
    let k2 = &s.context[1].versions;
    assert_eq!(k2.iter().map(|b| (b.version.as_str(), b.ttft.p50_ms, b.ttft.p99_ms)).collect::<Vec<_>>(), [("v1", Some(300.0), Some(300.0))]);

    let tenants: Vec<(&str, u64, u64, u64)> = s.tenants.iter().map(|t| (t.tenant.as_str(), t.requests, t.refused, t.tokens)).collect();
    assert_eq!(tenants, [("acme", 2, 0, 2057), ("globex", 2, 1, 600), ("anonymous", 1, 1, 0)]);
    assert!(close(s.tenants[1].spend_usd, 0.03));
    assert!(close(s.tenants[1].usd_per_mtok.unwrap(), 50.0));
    assert_eq!(s.tenants[2].usd_per_mtok, None);

    assert_eq!((s.turns.first_requests, s.turns.first_ttft.samples, s.turns.first_ttft.p50_ms), (2, 1, Some(100.0)));
    assert_eq!((s.turns.follow_up_requests, s.turns.follow_up_ttft.p99_ms), (1, Some(300.0)));

    assert_eq!(s.shadows.len(), 1);
    assert_eq!((s.shadows[0].version.as_str(), s.shadows[0].shadowed), ("qwen", 1));
    assert_eq!(s.shadows[0].by_primary.get("v2"), Some(&1));

    // summary.json reads back (floats to within serde_json's parsing, which may be 1 ulp off).
    let json = serde_json::to_string(&s).unwrap();
    let back: Summary = serde_json::from_str(&json).unwrap();
    assert_eq!(
        (back.requests, back.decisions, back.refusals_by_code.clone(), back.turns.clone()),
        (s.requests, s.decisions.clone(), s.refusals_by_code.clone(), s.turns.clone())
    );
    assert_eq!(
        back.versions.iter().map(|v| (&v.version, v.ttft.clone(), v.usd_per_mtok.map(|x| x.round()))).collect::<Vec<_>>(),
        s.versions.iter().map(|v| (&v.version, v.ttft.clone(), v.usd_per_mtok.map(|x| x.round()))).collect::<Vec<_>>()
    );
    assert!(json.contains(r#""source":"simulated""#), "{json}");
}

const HEADINGS: [&str; 10] = [
    "Headline",
    "Time to first token",
    "Decode speed against upstream concurrency",
    "Spend per tenant",
    "Refusals over time",
    "Breaker state per version",
    "Traffic split",
    "First turn and follow-up",
    "Shadow traffic",
    "Output quality",
];

fn parse(html: &str) -> roxmltree::Document<'_> {
    let options = roxmltree::ParsingOptions { allow_dtd: true, ..roxmltree::ParsingOptions::default() };
    roxmltree::Document::parse_with_options(html, options).unwrap_or_else(|e| panic!("not well-formed: {e}"))
}

fn texts_of(doc: &roxmltree::Document, tag: &str) -> Vec<String> {
    doc.descendants()
        .filter(|n| n.tag_name().name() == tag)
        .map(|n| n.descendants().filter(|d| d.is_text()).filter_map(|d| d.text()).collect::<String>())
        .collect()
}

fn count(doc: &roxmltree::Document, tag: &str) -> usize {
    doc.descendants().filter(|n| n.tag_name().name() == tag).count()
}

#[test]
fn html_is_well_formed_has_every_section_and_escapes_names() {
    const EVIL: &str = r#"<script>&"x""#;
    let mut verdicts = known_set();
    for v in &mut verdicts {
        if v.tenant.as_deref() == Some("globex") {
            v.tenant = Some(EVIL.into());
        }
    }
    verdicts[4].code = Some("<b>code</b>".into());
    let samples: Vec<Sample> = (0..5)
        .map(|i| Sample {
            t_ms: f64::from(i) * 1000.0,
            breakers: vec![("v1".into(), if i == 2 { "open".into() } else { "closed".into() }), ("v2".into(), "closed".into())],
            in_flight: vec![("v1".into(), 1)],
            budgets_remaining: vec![("key:x:minute:total_tokens".into(), 1000 - i64::from(i) * 100)],
        })
        .collect();
    let transitions = vec![
        Transition { t_ms: 2000.0, version: "v1".into(), from: "closed".into(), to: "open".into() },
        Transition { t_ms: 3000.0, version: "v1".into(), from: "open".into(), to: "half_open".into() },
    ];
    let inp = input(&verdicts, &samples, &transitions);
    let html = render_html(&inp, &summarize(&inp));

    let doc = parse(&html);
    assert_eq!(doc.root_element().tag_name().name(), "html");
    assert_eq!(texts_of(&doc, "h2"), HEADINGS);
    // Offline and inert: no script, nothing fetched.
    assert_eq!(count(&doc, "script"), 0);
    assert!(doc.descendants().all(|n| n.attribute("src").is_none() && n.attribute("href").is_none()));
    assert_eq!(html.matches("http://").count(), html.matches(r#"xmlns="http://"#).count(), "only namespaces name a URL");

    // The untrusted names appear only escaped, and read back as themselves.
    assert!(!html.contains(EVIL));
    assert!(!html.contains("<b>code</b>"));
    assert!(html.contains("&lt;script&gt;&amp;&quot;x&quot;"));
    assert!(texts_of(&doc, "td").iter().any(|t| t == EVIL), "the tenant's row");
    assert!(texts_of(&doc, "li").iter().any(|t| t == EVIL), "the tenant's legend entry");
    assert!(texts_of(&doc, "td").iter().any(|t| t == "<b>code</b>"));

    // Charts: the TTFT bars, the breaker bands (v1 closed, open, closed; v2 closed), the transitions.
    assert!(count(&doc, "svg") >= 7, "{}", count(&doc, "svg"));
    let band_titles = texts_of(&doc, "title");
    assert_eq!(band_titles.iter().filter(|t| t.as_str() == "v1: open").count(), 1);
    assert_eq!(band_titles.iter().filter(|t| t.as_str() == "v1: closed").count(), 2);
    assert_eq!(band_titles.iter().filter(|t| t.as_str() == "v2: closed").count(), 1);
    assert!(texts_of(&doc, "td").iter().any(|t| t == "half_open"));
    // No request has a concurrency here.
    assert!(html.contains("No concurrency recorded"));
    assert_eq!(count(&doc, "circle"), 0);
}

#[test]
fn html_scatter_has_a_point_per_stream_with_a_concurrency() {
    let mut verdicts = known_set();
    verdicts[0].upstream_concurrency = Some(3);
    verdicts[1].upstream_concurrency = Some(8);
    let inp = input(&verdicts, &[], &[]);
    let html = render_html(&inp, &summarize(&inp));
    let doc = parse(&html);
    assert_eq!(count(&doc, "circle"), 2);
    assert!(!html.contains("No concurrency recorded"));
    assert!(html.contains("No samples: breaker state is sampled only in a simulation."));
}

#[test]
fn html_of_nothing_says_so_in_every_section() {
    let inp = ReportInput { title: "empty", source: Source::Observed, verdicts: &[], samples: &[], transitions: &[] };
    let html = render_html(&inp, &summarize(&inp));
    let doc = parse(&html);
    assert_eq!(texts_of(&doc, "h2"), HEADINGS);
    assert_eq!(count(&doc, "svg"), 0);
    let empties = doc.descendants().filter(|n| n.attribute("class") == Some("empty")).count();
    assert!(empties >= 9, "{empties}");
    for sentence in
        ["No request was refused.", "No request was shadowed.", "No request has a turn label.", "No request has a model version, so there is no traffic split."]
    {
        assert!(html.contains(sentence), "{sentence}");
    }
}

#[test]
fn many_tenants_are_bounded_to_twelve_series_and_other() {
    let verdicts: Vec<Verdict> = (0..40u32)
        .map(|i| {
            let mut v = verdict(u64::from(i) + 1, f64::from(i) * 10.0, Some(&format!("t{i:02}")), Some("v1"), Decision::Admitted);
            v.cost_usd = Some(f64::from(i + 1));
            v.input_tokens = 10;
            v
        })
        .collect();
    let inp = input(&verdicts, &[], &[]);
    let html = render_html(&inp, &summarize(&inp));
    let doc = parse(&html);
    let spend_chart = doc.descendants().find(|n| n.tag_name().name() == "svg" && n.attribute("aria-label") == Some("Cumulative spend per tenant")).unwrap();
    let paths: Vec<String> = spend_chart
        .descendants()
        .filter(|n| n.tag_name().name() == "path")
        .map(|p| p.descendants().filter(|d| d.is_text()).filter_map(|d| d.text()).collect())
        .collect();
    assert_eq!(paths.len(), 13);
    // The twelve biggest spenders (t39 … t28), then the rest.
    assert_eq!(paths[0], "t39");
    assert_eq!(paths[11], "t28");
    assert_eq!(paths[12], "other");
    assert!(texts_of(&doc, "td").iter().any(|t| t == "other (28 tenants)"));
}

#[test]
fn compare_finds_exactly_the_differing_lines() {
    let a = known_set();
    let mut b = known_set();
    b[1].decision = Decision::Refused; // line 2
    b[1].code = Some("key:acme:day:requests".into());
    b[2].shadow_version = None; // line 3
    b[3].version = Some("v1".into()); // line 4
    b[0].ttft_ms = Some(1.0); // line 1: not a compared field
    b.remove(4); // line 5 only in a
    let mut extra = verdict(9, 9000.0, None, None, Decision::Admitted);
    extra.version = Some("v1".into());
    b.push(extra); // line 9 only in b
    b.reverse(); // pairing is by line, not by position

    let cmp = compare(&a, &b);
    assert_eq!((cmp.a_requests, cmp.b_requests, cmp.paired, cmp.agree), (5, 5, 4, 1));
    assert_eq!(cmp.differences.iter().map(|d| d.line).collect::<Vec<_>>(), [2, 3, 4]);
    assert_eq!((cmp.only_in_a.as_slice(), cmp.only_in_b.as_slice()), (&[5u64][..], &[9u64][..]));
    let d2 = &cmp.differences[0];
    assert_eq!((d2.a.decision, d2.b.decision, d2.b.code.as_deref()), (Decision::Admitted, Decision::Refused, Some("key:acme:day:requests")));
    assert_eq!((d2.tenant.as_deref(), d2.arrival_ms), (Some("acme"), 1000.0));
    assert_eq!((cmp.differences[1].a.shadow_version.as_deref(), cmp.differences[1].b.shadow_version.as_deref()), (Some("qwen"), None));
    assert_eq!((cmp.differences[2].a.version.as_deref(), cmp.differences[2].b.version.as_deref()), (None, Some("v1")));
    let changes: Vec<(Decision, Decision, u64)> = cmp.decision_changes.iter().map(|c| (c.a, c.b, c.requests)).collect();
    assert_eq!(
        changes,
        [
            (Decision::Admitted, Decision::Admitted, 1),
            (Decision::Admitted, Decision::Refused, 1),
            (Decision::Clamped, Decision::Clamped, 1),
            (Decision::Refused, Decision::Refused, 1)
        ]
    );
    assert_eq!(compare(&a, &a).differences.len(), 0);
    assert_eq!(compare(&a, &a).agree, 5);

    let (sa, sb) = (summarize(&input(&a, &[], &[])), summarize(&input(&b, &[], &[])));
    let html = render_compare_html("a vs b", "baseline <x>", "canary", &sa, &sb, &cmp);
    let doc = parse(&html);
    assert!(!html.contains("baseline <x>"));
    let headings = texts_of(&doc, "h2");
    assert_eq!(headings, ["Headline", "Per model version", "Agreement", "Requests that differ"]);
    let table = doc.descendants().rfind(|n| n.tag_name().name() == "table").unwrap();
    let rows: Vec<String> = table
        .descendants()
        .filter(|n| n.tag_name().name() == "tr")
        .skip(1)
        .map(|r| r.first_element_child().unwrap().text().unwrap_or("").to_string())
        .collect();
    assert_eq!(rows, ["2", "3", "4"]);
}

#[test]
fn compare_page_lists_the_first_thousand() {
    let a: Vec<Verdict> = (1..=1200u64).map(|i| verdict(i, i as f64, None, Some("v1"), Decision::Admitted)).collect();
    let b: Vec<Verdict> = (1..=1200u64).map(|i| verdict(i, i as f64, None, Some("v2"), Decision::Admitted)).collect();
    let cmp = compare(&a, &b);
    assert_eq!(cmp.differences.len(), 1200);
    let (sa, sb) = (summarize(&input(&a, &[], &[])), summarize(&input(&b, &[], &[])));
    let html = render_compare_html("big", "a", "b", &sa, &sb, &cmp);
    let doc = parse(&html);
    let table = doc.descendants().rfind(|n| n.tag_name().name() == "table").unwrap();
    assert_eq!(table.descendants().filter(|n| n.tag_name().name() == "tr").count() - 1, MAX_LISTED_DIFFERENCES);
    assert!(html.contains("1,200 requests differ; the first 1,000 by trace line are listed."));
}
