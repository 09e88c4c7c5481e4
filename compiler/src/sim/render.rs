//! Pictures of a simulation: a terminal table and ASCII timeline, Chrome trace JSON (Perfetto,
//! chrome://tracing), and an SVG Gantt chart.

use super::{Event, EventKind, SimResult, StreamKind};
use schedc_ir::Program;
use std::fmt::Write as _;

/// The letter of an event kind in the ASCII timeline.
fn letter(k: EventKind) -> char {
    match k {
        EventKind::F => 'F',
        EventKind::B => 'B',
        EventKind::W => 'W',
        EventKind::BW => 'X',
        EventKind::Overlap => 'O',
        EventKind::A2a => 'a',
        EventKind::Comm => '~',
        EventKind::Mem => 'R',
        EventKind::Other => '+',
    }
}

/// Bytes as gigabytes (10^9) with two decimals, or `-` when the cost model has no memory
/// figures (every rank at zero).
fn gb(b: f64, known: bool) -> String {
    if known {
        format!("{:.2}", b / 1e9)
    } else {
        "-".into()
    }
}

/// Per-rank table and an ASCII timeline of the compute streams, `width` columns wide. Times
/// are in seconds of the cost model (the `unit` model's F = B = W = 1 s), memory in GB
/// (10^9 bytes).
pub fn text_report(r: &SimResult, width: usize) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "makespan {:.6} s  steady-state step {:.6} s",
        r.makespan, r.steady_step
    );
    let mem_known = r.ranks.iter().any(|x| x.peak_memory_bytes > 0.0);
    let _ = writeln!(
        o,
        "bubble: from_start {:.2}%, per_rank_span {:.2}%, steady_state {:.2}% (idle / (busy + idle)); from_start idle / busy {:.2}%",
        100.0 * r.bubble.from_start,
        100.0 * r.bubble.per_rank_span,
        100.0 * r.bubble.steady_state,
        100.0 * r.bubble_ratio_busy
    );
    if r.a2a.total > 0.0 {
        let _ = writeln!(
            o,
            "all-to-all: {:.6} s, {:.6} s exposed ({:.1}%, not under compute)",
            r.a2a.total,
            r.a2a.exposed,
            100.0 * r.a2a.exposed_fraction()
        );
    }
    let _ = writeln!(
        o,
        "\n{:>5} {:>12} {:>12} {:>12} {:>16} {:>15} {:>16}",
        "rank",
        "busy (s)",
        "idle (s)",
        "span (s)",
        "exposed_comm (s)",
        "exposed_a2a (s)",
        "peak_memory (GB)"
    );
    for x in &r.ranks {
        let _ = writeln!(
            o,
            "{:>5} {:>12.6} {:>12.6} {:>12.6} {:>16.6} {:>15.6} {:>16}",
            x.rank,
            x.busy,
            x.idle,
            x.span,
            x.exposed_comm,
            x.exposed_a2a,
            gb(x.peak_memory_bytes, mem_known)
        );
    }
    if !mem_known {
        let _ = writeln!(o, "(peak memory: the cost model has no [memory] figures)");
    }
    // Only a schedule that offloads, under a model with activation sizes, has host figures.
    if r.ranks.iter().any(|x| x.peak_host_bytes > 0.0) {
        let host: Vec<String> = r
            .ranks
            .iter()
            .map(|x| format!("{:.2}", x.peak_host_bytes / 1e9))
            .collect();
        let _ = writeln!(
            o,
            "peak host memory (GB, offloaded activations), per rank: {}",
            host.join(" ")
        );
    }
    if r.makespan <= 0.0 {
        return o;
    }
    let w = width.max(10);
    let scale = w as f64 / r.makespan;
    let _ = writeln!(
        o,
        "\ntimeline (compute streams; F forward, B input-grad, W weight-grad, X fused backward, O overlapped F&B, a all-to-all on the compute stream, . idle):"
    );
    let np = r.ranks.len();
    let mut rows = vec![vec!['.'; w]; np];
    for e in r.events.iter().filter(|e| e.stream == StreamKind::Compute) {
        let a = ((e.start * scale).round() as usize).min(w);
        let b = ((e.end * scale).round() as usize)
            .min(w)
            .max(a + usize::from(e.end > e.start));
        for c in rows[e.rank as usize].iter_mut().take(b.min(w)).skip(a) {
            *c = letter(e.kind);
        }
    }
    for (rk, row) in rows.iter().enumerate() {
        let _ = writeln!(o, "{:>5} |{}|", rk, row.iter().collect::<String>());
    }
    o
}

/// Chrome trace JSON: one process per rank, a thread per stream, events in microseconds,
/// flow arrows from each send to its receive.
pub fn chrome_trace(r: &SimResult, p: &Program) -> String {
    use serde_json::json;
    let us = 1e6;
    let mut ev = Vec::new();
    for x in &r.ranks {
        ev.push(json!({"ph": "M", "name": "process_name", "pid": x.rank, "args": {"name": format!("rank {}", x.rank)}}));
        ev.push(json!({"ph": "M", "name": "process_sort_index", "pid": x.rank, "args": {"sort_index": x.rank}}));
        for (tid, n) in [
            (0, "compute"),
            (1, "p2p"),
            (2, "ep all-to-all"),
            (3, "host copies (device to host)"),
            (4, "host copies (host to device)"),
        ] {
            // A rank without expert-parallel (host-copy) events has no such thread to name.
            let only = match tid {
                2 => Some(StreamKind::Ep),
                3 => Some(StreamKind::Host),
                4 => Some(StreamKind::HostToDevice),
                _ => None,
            };
            if only.is_some_and(|k| !r.events.iter().any(|e| e.rank == x.rank && e.stream == k)) {
                continue;
            }
            ev.push(json!({"ph": "M", "name": "thread_name", "pid": x.rank, "tid": tid, "args": {"name": n}}));
        }
    }
    let tid = |s: StreamKind| match s {
        StreamKind::Compute => 0,
        StreamKind::Comm => 1,
        StreamKind::Ep => 2,
        StreamKind::Host => 3,
        StreamKind::HostToDevice => 4,
    };
    for e in &r.events {
        ev.push(json!({
            "ph": "X", "name": e.name(p), "cat": format!("{:?}", e.kind),
            "pid": e.rank, "tid": tid(e.stream),
            "ts": e.start * us, "dur": (e.end - e.start) * us,
        }));
    }
    for (k, (a, b)) in r.flows.iter().enumerate() {
        let (ea, eb): (&Event, &Event) = (&r.events[*a], &r.events[*b]);
        ev.push(json!({"ph": "s", "id": k, "name": "p2p", "cat": "p2p", "pid": ea.rank, "tid": 1, "ts": ea.start * us}));
        ev.push(json!({"ph": "f", "bp": "e", "id": k, "name": "p2p", "cat": "p2p", "pid": eb.rank, "tid": 1, "ts": eb.end * us}));
    }
    serde_json::to_string(&json!({"traceEvents": ev, "displayTimeUnit": "ms"}))
        .expect("trace serializes")
}

/// Direction 1 of a bidirectional schedule, and every chunk after a rank's first of an
/// interleaved or V schedule, is drawn in a darker shade of the same hue.
fn colour_dir(k: EventKind, direction: u8) -> &'static str {
    if direction == 0 {
        return colour(k);
    }
    match k {
        EventKind::F => "#2c4a6e",
        EventKind::B => "#336b2c",
        EventKind::W => "#4f8f43",
        EventKind::BW => "#b4600f",
        other => colour(other),
    }
}

fn colour(k: EventKind) -> &'static str {
    match k {
        EventKind::F => "#4e79a7",
        EventKind::B => "#59a14f",
        EventKind::W => "#8cd17d",
        EventKind::BW => "#f28e2b",
        EventKind::Overlap => "#b07aa1",
        EventKind::A2a => "#e15759",
        EventKind::Comm => "#bab0ac",
        EventKind::Mem => "#edc948",
        EventKind::Other => "#79706e",
    }
}

fn label(k: EventKind) -> &'static str {
    match k {
        EventKind::F => "F (forward)",
        EventKind::B => "B (input gradient)",
        EventKind::W => "W (weight gradient)",
        EventKind::BW => "BW (full backward)",
        EventKind::Overlap => "F&B (overlapped pair)",
        EventKind::A2a => "dispatch / combine",
        EventKind::Comm => "send / receive",
        EventKind::Mem => "offload / reload / recompute",
        EventKind::Other => "other",
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG Gantt chart: a row per rank (its compute stream; below it, when the program has MoE
/// parts, a lane for its expert-parallel stream, so that an all-to-all under a gap of the
/// compute row is exposed and one under a box is hidden; then a thin lane for its messages),
/// colours by op kind, the micro-batch written in each box wide enough, a time axis and a
/// legend.
pub fn svg(r: &SimResult, p: &Program, title: &str) -> String {
    let np = r.ranks.len();
    let ep_h = if r.events.iter().any(|e| e.stream == StreamKind::Ep) {
        10.0
    } else {
        0.0
    };
    let (left, top, row_h, gap) = (70.0, 50.0, 26.0, 8.0);
    let lane_h = 6.0 + ep_h;
    let width = 1200.0;
    let plot_w = width - left - 20.0;
    let scale = if r.makespan > 0.0 {
        plot_w / r.makespan
    } else {
        0.0
    };
    let height = top + np as f64 * (row_h + lane_h + gap) + 80.0;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{left}" y="24" font-size="15" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let _ = writeln!(
        o,
        r##"<text x="{left}" y="40" font-size="11" fill="#555">makespan {:.4} s; bubble {:.1}% from_start, {:.1}% per_rank_span, {:.1}% steady_state{}</text>"##,
        r.makespan,
        100.0 * r.bubble.from_start,
        100.0 * r.bubble.per_rank_span,
        100.0 * r.bubble.steady_state,
        if r.a2a.total > 0.0 {
            format!(
                "; all-to-all {:.1}% exposed",
                100.0 * r.a2a.exposed_fraction()
            )
        } else {
            String::new()
        }
    );
    let row_y = |rank: u32| top + rank as f64 * (row_h + lane_h + gap);
    for x in &r.ranks {
        let y = row_y(x.rank);
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" font-size="12" text-anchor="end">rank {}</text>"#,
            left - 8.0,
            y + row_h * 0.68,
            x.rank
        );
        let _ = writeln!(
            o,
            r##"<rect x="{left}" y="{y}" width="{plot_w}" height="{row_h}" fill="#f4f4f4"/>"##
        );
    }
    // The chunk (0 for the rank's first stage) of each compute event, for the shading of V
    // and interleaved schedules.
    let multi_chunk = p.pipeline.directions() == 1 && p.pipeline.stages > p.pipeline.pp;
    let first_chunk: Vec<bool> = if multi_chunk {
        let mut seen = vec![false; p.pipeline.pp as usize];
        (0..p.pipeline.stages)
            .map(|s| {
                let r = p.pipeline.rank_of(s) as usize;
                !std::mem::replace(&mut seen[r], true)
            })
            .collect()
    } else {
        Vec::new()
    };
    let chunk_of = |e: &Event| -> u8 {
        if !multi_chunk || e.stream != StreamKind::Compute {
            return 0;
        }
        let mut stage = None;
        if let Some(ins) = p
            .ranks
            .get(e.rank as usize)
            .and_then(|r| r.get(e.pos as usize))
        {
            ins.for_each_compute(|c| {
                if stage.is_none() {
                    stage = Some(c.stage)
                }
            });
        }
        // Chunks are numbered by stage order on the rank.
        match stage {
            Some(s) => u8::from(!first_chunk.get(s as usize).copied().unwrap_or(true)),
            None => 0,
        }
    };
    let mut used = Vec::new();
    let mut shaded = false;
    for e in &r.events {
        let w = ((e.end - e.start) * scale).max(0.0);
        if w <= 0.0 {
            continue;
        }
        if !used.contains(&e.kind) {
            used.push(e.kind);
        }
        let x = left + e.start * scale;
        let (y, h) = match e.stream {
            StreamKind::Compute => (row_y(e.rank), row_h),
            StreamKind::Ep => (row_y(e.rank) + row_h + 1.0, ep_h - 1.0),
            StreamKind::Comm => (row_y(e.rank) + row_h + ep_h + 1.0, 5.0),
            // Drawn in the communication band, above the messages.
            // offloads on top, reloads under them (two streams: PCIe is full duplex).
            StreamKind::Host => (row_y(e.rank) + row_h + ep_h + 1.0, 1.25),
            StreamKind::HostToDevice => (row_y(e.rank) + row_h + ep_h + 2.25, 1.25),
        };
        let _ = writeln!(
            o,
            r#"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{}" stroke="white" stroke-width="0.6"><title>{} [{:.4}, {:.4}]</title></rect>"#,
            colour_dir(e.kind, {
                let d = e.direction.max(chunk_of(e));
                shaded |= multi_chunk && d == 1;
                d
            }),
            esc(&e.name(p)),
            e.start,
            e.end
        );
        if e.stream == StreamKind::Compute && w >= 14.0 {
            let text = match (e.mb, e.mb2) {
                (Some(a), Some(b)) => format!("{a} | {b}"),
                (Some(a), None) => a.to_string(),
                _ => String::new(),
            };
            if !text.is_empty() {
                let _ = writeln!(
                    o,
                    r#"<text x="{:.2}" y="{:.2}" font-size="10" fill="white" text-anchor="middle">{}</text>"#,
                    x + w / 2.0,
                    y + h * 0.66,
                    text
                );
            }
        }
    }
    // Time axis.
    let axis_y = top + np as f64 * (row_h + lane_h + gap) + 4.0;
    let _ = writeln!(
        o,
        r##"<line x1="{left}" y1="{axis_y}" x2="{}" y2="{axis_y}" stroke="#333"/>"##,
        left + plot_w
    );
    // Ticks at 1, 2 or 5 times a power of ten, about ten of them.
    let raw = (r.makespan / 10.0).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let ticks = (r.makespan / step).floor() as usize;
    for k in 0..=ticks {
        let t = step * k as f64;
        let x = left + t * scale;
        let _ = writeln!(
            o,
            r##"<line x1="{x:.2}" y1="{axis_y}" x2="{x:.2}" y2="{}" stroke="#333"/><text x="{x:.2}" y="{}" font-size="10" text-anchor="middle">{}</text>"##,
            axis_y + 4.0,
            axis_y + 16.0,
            fmt_t(t)
        );
    }
    let _ = writeln!(
        o,
        r##"<text x="{}" y="{}" font-size="10" text-anchor="end" fill="#333">time (s)</text>"##,
        left + plot_w,
        axis_y + 28.0
    );
    // Legend.
    let mut lx = left;
    let ly = axis_y + 34.0;
    if shaded {
        let _ = writeln!(
            o,
            r##"<text x="{left}" y="{}" font-size="11" fill="#555">darker shade: a rank's second and later chunks (virtual stages)</text>"##,
            ly + 18.0
        );
    }
    if r.events.iter().any(|e| e.direction == 1) {
        let _ = writeln!(
            o,
            r##"<text x="{left}" y="{}" font-size="11" fill="#555">darker shade: direction 1 (micro-batches entering at the last rank); an F&amp;B box reads "forward mb | backward mb"</text>"##,
            ly + 18.0
        );
    }
    for k in used {
        let _ = writeln!(
            o,
            r#"<rect x="{lx}" y="{}" width="14" height="12" fill="{}"/><text x="{}" y="{}" font-size="11">{}</text>"#,
            ly - 10.0,
            colour(k),
            lx + 18.0,
            ly,
            esc(label(k))
        );
        lx += 30.0 + 7.0 * label(k).len() as f64;
    }
    o.push_str("</svg>\n");
    o
}

fn fmt_t(t: f64) -> String {
    if t == 0.0 {
        "0".into()
    } else if t >= 100.0 || (t - t.round()).abs() < 1e-9 {
        format!("{t:.0}")
    } else if t >= 1.0 {
        format!("{t:.1}")
    } else {
        format!("{t:.3}")
    }
}
