//! The HTML page: rendered on the server, styled inline, with a few lines
//! of script that re-fetch the body fragment so the figures move without a
//! full reload. Every text that comes from a file (names, errors) goes
//! through [`escape`].

use std::fmt::Write as _;

use durability::state::{AlarmsState, FanoutState, LogState, OperationsState};
use durability_platform::EpochMs;

use crate::view::{self, ObjectView};

/// What the page says about where it runs.
pub(crate) struct Context<'a> {
    /// The page's path with a trailing slash: links and fetches go below it.
    pub base: String,
    pub title: &'a str,
    pub now_ms: EpochMs,
    pub refresh_ms: u64,
    pub admin: bool,
    pub metrics: bool,
    pub read_only: bool,
    /// What `last-backup.json` of the data directory records.
    pub last_backup: Option<durability_host::backup::LastBackup>,
    /// How far the host's continuous archive is behind (`None`: no host,
    /// or no archive).
    pub archive_lag: Option<std::time::Duration>,
    /// The archive the dashboard was given, as its manifest tells.
    pub archive: Option<ArchiveView>,
}

/// An archive as the page and `GET /api/archive` show it.
pub(crate) struct ArchiveView {
    pub url: String,
    /// Its manifest, or why it could not be read.
    pub manifest: Result<durability_host::archive::ArchiveManifest, String>,
}

impl ArchiveView {
    /// The JSON of `GET /api/archive`.
    pub(crate) fn json(&self, now_ms: EpochMs) -> serde_json::Value {
        match &self.manifest {
            Ok(manifest) => serde_json::json!({
                "url": self.url,
                "earliest_ms": manifest.earliest_ms(),
                "through_ms": manifest.through_ms(),
                "shipping": manifest.shipping(),
                "lag_seconds": manifest.lag_ms(now_ms) as f64 / 1000.0,
                "lives": manifest.lives.len(),
                "gaps": manifest.gaps,
                "error": null,
            }),
            Err(error) => serde_json::json!({ "url": self.url, "error": error }),
        }
    }
}

/// Escapes text for HTML element content and quoted attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = r#"
:root { --fg:#1d232b; --muted:#5d6773; --line:#e3e7ec; --bg:#f6f8fa; --card:#fff;
  --accent:#2457d6; --warn:#b45309; --bad:#b42318; --ok:#127a43; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
  color:var(--fg); background:var(--bg); }
header { background:#111827; color:#f9fafb; padding:14px 28px; display:flex; align-items:baseline; gap:18px; }
header h1 { font-size:18px; margin:0; font-weight:600; }
header .meta { color:#9ca3af; font-size:12px; }
main { padding:20px 28px 40px; max-width:1400px; }
.tiles { display:grid; grid-template-columns:repeat(auto-fill,minmax(150px,1fr)); gap:12px; margin-bottom:22px; }
.tile { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 14px; }
.tile .n { font-size:24px; font-weight:600; font-variant-numeric:tabular-nums; }
.tile .l { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.tile.warn .n { color:var(--warn); } .tile.bad .n { color:var(--bad); }
.objects { display:grid; grid-template-columns:repeat(auto-fill,minmax(520px,1fr)); gap:16px; }
.object { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:14px 16px; }
.object h2 { font-size:15px; margin:0 0 2px; }
.object h2 .ns { color:var(--muted); font-weight:400; }
.object .sub { color:var(--muted); font-size:12px; margin-bottom:8px; }
.object .sub code { font-size:11px; }
h3 { font-size:12px; text-transform:uppercase; letter-spacing:.05em; color:var(--muted); margin:12px 0 4px; }
table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:3px 8px 3px 0; border-bottom:1px solid var(--line); vertical-align:top; }
th { font-weight:500; color:var(--muted); font-size:12px; }
td.num, th.num { text-align:right; }
.err { color:var(--bad); font-size:12px; word-break:break-word; }
.pill { display:inline-block; padding:0 7px; border-radius:10px; font-size:12px; background:#eef2ff; color:var(--accent); margin-right:4px; }
.pill.bad { background:#fef3f2; color:var(--bad); } .pill.ok { background:#ecfdf3; color:var(--ok); }
.pill.warn { background:#fffaeb; color:var(--warn); }
.empty { color:var(--muted); }
.backup { font-size:12px; color:var(--muted); margin:-10px 0 18px; }
footer { color:var(--muted); font-size:12px; padding:0 28px 24px; }
"#;

/// The whole page.
pub(crate) fn full(ctx: &Context<'_>, objects: &[ObjectView]) -> String {
    let title = escape(ctx.title);
    let mut notes = Vec::new();
    if ctx.read_only {
        notes.push("read-only view of a data directory".to_owned());
    }
    if ctx.admin {
        notes.push("admin API enabled (token required)".to_owned());
    }
    if ctx.metrics {
        notes.push(format!("Prometheus metrics at {}metrics", ctx.base));
    }
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{STYLE}</style></head>
<body><header><h1>{title}</h1><span class="meta">{notes}</span>
<span class="meta" id="updated"></span></header>
<main id="live" data-refresh-ms="{refresh}" data-base="{base}">{body}</main>
<footer>JSON: <a href="{base}api/objects">{base}api/objects</a> · refreshes every {refresh_s} s</footer>
<script>
(function () {{
  var live = document.getElementById('live');
  var base = live.dataset.base;
  var every = Number(live.dataset.refreshMs) || 2000;
  function refresh() {{
    fetch(base + 'fragment', {{ cache: 'no-store' }})
      .then(function (r) {{ if (!r.ok) throw new Error(r.status); return r.text(); }})
      .then(function (html) {{
        live.innerHTML = html;
        document.getElementById('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
      }})
      .catch(function (e) {{ document.getElementById('updated').textContent = 'refresh failed: ' + e.message; }})
      .finally(function () {{ setTimeout(refresh, every); }});
  }}
  setTimeout(refresh, every);
}})();
</script></body></html>"#,
        notes = escape(&notes.join(" · ")),
        refresh = ctx.refresh_ms,
        base = escape(&ctx.base),
        refresh_s = ctx.refresh_ms as f64 / 1_000.0,
        body = body(ctx, objects),
    )
}

/// The part that refreshes: totals, then one card per object.
pub(crate) fn body(ctx: &Context<'_>, objects: &[ObjectView]) -> String {
    let o = view::overview(objects);
    let mut html = String::from(r#"<section class="tiles">"#);
    let tile = |html: &mut String, n: String, label: &str, class: &str| {
        let _ = write!(
            html,
            r#"<div class="tile {class}"><div class="n">{n}</div><div class="l">{label}</div></div>"#
        );
    };
    tile(&mut html, o.objects.to_string(), "objects", "");
    tile(&mut html, o.backlog.to_string(), "fanout backlog", "");
    tile(
        &mut html,
        o.retrying.to_string(),
        "waiting for retry",
        if o.retrying > 0 { "warn" } else { "" },
    );
    tile(
        &mut html,
        o.parked.to_string(),
        "parked",
        if o.parked > 0 { "bad" } else { "" },
    );
    tile(
        &mut html,
        o.operations_pending.to_string(),
        "operations pending",
        "",
    );
    tile(
        &mut html,
        o.operations_failed.to_string(),
        "operations failed",
        if o.operations_failed > 0 { "bad" } else { "" },
    );
    tile(
        &mut html,
        o.alarms_pending.to_string(),
        "alarms pending",
        "",
    );
    tile(
        &mut html,
        o.max_consumer_lag.to_string(),
        "max consumer lag",
        "",
    );
    html.push_str("</section>");
    backup_line(&mut html, ctx);
    if objects.is_empty() {
        html.push_str(r#"<p class="empty">No objects in this data directory yet.</p>"#);
        return html;
    }
    html.push_str(r#"<section class="objects">"#);
    for object in objects {
        object_card(&mut html, ctx, object);
    }
    html.push_str("</section>");
    html
}

fn object_card(html: &mut String, ctx: &Context<'_>, object: &ObjectView) {
    let name = object.name.as_deref().unwrap_or("(unnamed)");
    let namespace = object.namespace.as_deref().unwrap_or("?");
    let alarm = object.alarm_ms.map_or_else(
        || "no alarm".to_owned(),
        |at| format!("alarm {}", relative(at, ctx.now_ms)),
    );
    let _ = write!(
        html,
        r#"<article class="object" data-object-id="{id}"><h2><span class="ns">{ns} /</span> {name}</h2>
<div class="sub"><code>{short}…</code> · {alarm} · {size}</div>"#,
        id = escape(&object.id),
        ns = escape(namespace),
        name = escape(name),
        short = escape(object.id.get(..12).unwrap_or(&object.id)),
        size = size(object.file_bytes),
    );
    if let Some(error) = &object.error {
        let _ = write!(html, r#"<p class="err">unreadable: {}</p>"#, escape(error));
    }
    let c = &object.capabilities;
    if let Some(fanout) = &c.fanout {
        fanout_section(html, ctx, fanout);
    }
    if let Some(ops) = &c.operations {
        operations_section(html, ctx, ops);
    }
    if let Some(alarms) = &c.alarms {
        alarms_section(html, ctx, alarms);
    }
    if let Some(log) = &c.log {
        log_section(html, log);
    }
    if c.fanout.is_none()
        && c.operations.is_none()
        && c.alarms.is_none()
        && c.log.is_none()
        && object.error.is_none()
    {
        html.push_str(r#"<p class="empty">no capability tables</p>"#);
    }
    html.push_str("</article>");
}

fn fanout_section(html: &mut String, ctx: &Context<'_>, fanout: &FanoutState) {
    let _ = write!(
        html,
        "<h3>fanout · {} messages in flight</h3>",
        fanout.messages
    );
    if fanout.targets.is_empty() {
        html.push_str(r#"<p class="empty">nothing owed</p>"#);
    } else {
        html.push_str(r#"<table><tr><th>target</th><th class="num">backlog</th><th class="num">retrying</th><th class="num">to DLQ</th><th class="num">parked</th><th>last error</th></tr>"#);
        for t in &fanout.targets {
            let _ = write!(
                html,
                r#"<tr><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="err">{}</td></tr>"#,
                escape(&t.target),
                t.backlog,
                t.retrying,
                t.dead_lettering,
                t.parked,
                escape(t.last_error.as_deref().unwrap_or("")),
            );
        }
        html.push_str("</table>");
    }
    if !fanout.parked.is_empty() {
        html.push_str(r#"<h3>parked dead letters (newest)</h3><table><tr><th>message</th><th>target</th><th class="num">attempts</th><th>reason</th><th>parked</th><th>last error</th></tr>"#);
        for p in &fanout.parked {
            let _ = write!(
                html,
                r#"<tr><td>{}</td><td>{}</td><td class="num">{}</td><td><span class="pill bad">{}</span></td><td>{}</td><td class="err">{}</td></tr>"#,
                escape(&p.message_id),
                escape(&p.target),
                p.attempts,
                escape(&p.reason),
                relative(p.parked_at, ctx.now_ms),
                escape(p.error.as_deref().unwrap_or("")),
            );
        }
        html.push_str("</table>");
    }
}

fn operations_section(html: &mut String, ctx: &Context<'_>, ops: &OperationsState) {
    html.push_str("<h3>operations</h3>");
    if ops.by_operation.is_empty() {
        html.push_str(r#"<p class="empty">none stored</p>"#);
        return;
    }
    html.push_str(r#"<table><tr><th>operation</th><th>status</th><th class="num">count</th></tr>"#);
    for entry in &ops.by_operation {
        let class = match entry.status.as_str() {
            "completed" => "ok",
            "failed" => "bad",
            _ => "warn",
        };
        let _ = write!(
            html,
            r#"<tr><td>{}</td><td><span class="pill {class}">{}</span></td><td class="num">{}</td></tr>"#,
            escape(&entry.operation),
            escape(&entry.status),
            entry.count,
        );
    }
    html.push_str("</table>");
    if !ops.failed.is_empty() {
        html.push_str(r#"<h3>failed operations (newest)</h3><table><tr><th>id</th><th>operation</th><th class="num">attempts</th><th>failed</th><th>error</th></tr>"#);
        for f in &ops.failed {
            let _ = write!(
                html,
                r#"<tr><td>{}</td><td>{}</td><td class="num">{}</td><td>{}</td><td class="err">{}</td></tr>"#,
                escape(&f.id),
                escape(&f.operation),
                f.attempts,
                f.failed_at
                    .map_or_else(String::new, |at| relative(at, ctx.now_ms)),
                escape(f.error.as_deref().unwrap_or("")),
            );
        }
        html.push_str("</table>");
    }
}

fn alarms_section(html: &mut String, ctx: &Context<'_>, alarms: &AlarmsState) {
    let _ = write!(
        html,
        "<h3>named alarms · {} pending · {} failed</h3>",
        alarms.pending, alarms.failed
    );
    if alarms.upcoming.is_empty() {
        return;
    }
    html.push_str(r#"<table><tr><th>alarm</th><th>scheduled</th><th>next attempt</th><th class="num">attempts</th><th>last error</th></tr>"#);
    for a in &alarms.upcoming {
        let _ = write!(
            html,
            r#"<tr><td>{}</td><td>{}</td><td>{}</td><td class="num">{}</td><td class="err">{}</td></tr>"#,
            escape(&a.name),
            relative(a.scheduled_at, ctx.now_ms),
            relative(a.next_attempt_at, ctx.now_ms),
            a.attempts,
            escape(a.last_error.as_deref().unwrap_or("")),
        );
    }
    html.push_str("</table>");
}

fn log_section(html: &mut String, log: &LogState) {
    let _ = write!(
        html,
        "<h3>log · offsets {}..{} · {} hot · {} cold segments</h3>",
        log.oldest_offset, log.next_offset, log.hot_records, log.cold_segments
    );
    if log.consumers.is_empty() {
        return;
    }
    html.push_str(
        r#"<table><tr><th>consumer</th><th class="num">offset</th><th class="num">lag</th></tr>"#,
    );
    for c in &log.consumers {
        let _ = write!(
            html,
            r#"<tr><td>{}</td><td class="num">{}</td><td class="num">{}</td></tr>"#,
            escape(&c.consumer),
            c.offset,
            c.lag
        );
    }
    html.push_str("</table>");
}

/// When the data directory was last backed up, and where to.
fn backup_line(html: &mut String, ctx: &Context<'_>) {
    match &ctx.last_backup {
        Some(last) => {
            let _ = write!(
                html,
                r#"<p class="backup">last backup {when}: {objects} objects, {bytes} in {seconds:.1} s, to <code>{dest}</code></p>"#,
                when = relative(last.finished_ms, ctx.now_ms),
                objects = last.objects,
                bytes = size(last.bytes),
                seconds = last.seconds,
                dest = escape(&last.dest),
            );
        }
        None => html.push_str(
            r#"<p class="backup empty">no backup recorded (durability backup DATA_DIR DEST)</p>"#,
        ),
    }
    match ctx.archive_lag {
        Some(lag) if lag.is_zero() => {
            html.push_str(r#"<p class="archive">archive: caught up</p>"#);
        }
        Some(lag) => {
            let _ = write!(
                html,
                r#"<p class="archive behind">archive: {:.1} s behind (the journal keeps what is not shipped)</p>"#,
                lag.as_secs_f64()
            );
        }
        None => {}
    }
    if let Some(archive) = &ctx.archive {
        archive_line(html, archive, ctx.now_ms);
    }
}

/// How far back the archive reaches and how far behind it is, as its
/// manifest tells (`durability serve --archive URL`).
fn archive_line(html: &mut String, archive: &ArchiveView, now_ms: EpochMs) {
    let url = escape(&archive.url);
    let manifest = match &archive.manifest {
        Ok(manifest) => manifest,
        Err(error) => {
            let _ = write!(
                html,
                r#"<p class="archive behind">archive <code>{url}</code>: cannot read its manifest: {}</p>"#,
                escape(error)
            );
            return;
        }
    };
    let (Some(earliest), Some(through)) = (manifest.earliest_ms(), manifest.through_ms()) else {
        let _ = write!(
            html,
            r#"<p class="archive behind">archive <code>{url}</code>: no base yet</p>"#
        );
        return;
    };
    if through < earliest {
        let _ = write!(
            html,
            r#"<p class="archive">archive <code>{url}</code>: first base taken; restorable from the next shipment</p>"#
        );
        return;
    }
    let lag_ms = manifest.lag_ms(now_ms);
    let state = if !manifest.shipping() {
        "no host ships to it".to_owned()
    } else if lag_ms <= 5_000 {
        "caught up".to_owned()
    } else {
        format!("{:.1} s behind", lag_ms as f64 / 1000.0)
    };
    let gaps = match manifest.gaps.len() {
        0 => String::new(),
        n => format!(", {n} gaps"),
    };
    let class = if manifest.shipping() && lag_ms > 5_000 {
        "archive behind"
    } else {
        "archive"
    };
    let _ = write!(
        html,
        r#"<p class="{class}">archive <code>{url}</code>: restores from {} to {}{gaps}; {state}</p>"#,
        relative(earliest, now_ms),
        relative(through, now_ms),
    );
}

/// `in 3.2 s` / `12 s ago` / `in 4 min`.
fn relative(at_ms: EpochMs, now_ms: EpochMs) -> String {
    let delta = at_ms.saturating_sub(now_ms);
    let secs = delta.unsigned_abs() as f64 / 1_000.0;
    let amount = if secs < 60.0 {
        format!("{secs:.1} s")
    } else if secs < 3_600.0 {
        format!("{:.0} min", secs / 60.0)
    } else if secs < 172_800.0 {
        format!("{:.1} h", secs / 3_600.0)
    } else {
        format!("{:.0} d", secs / 86_400.0)
    };
    if delta >= 0 {
        format!("in {amount}")
    } else {
        format!("{amount} ago")
    }
}

fn size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b >= KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_files_is_escaped() {
        assert_eq!(
            escape(r#"<script>alert("x")</script> & 'y'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
    }

    #[test]
    fn times_read_relative_to_now() {
        assert_eq!(relative(13_000, 10_000), "in 3.0 s");
        assert_eq!(relative(7_000, 10_000), "3.0 s ago");
        assert_eq!(relative(10_000 + 300_000, 10_000), "in 5 min");
    }
}
