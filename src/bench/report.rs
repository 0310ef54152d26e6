//! `kiln-bench`'s output: one [`Row`] per (model, backend, threads, batch, test), printed as
//! llama-bench's Markdown table, as CSV, or as JSON with every field and the raw samples.

use std::fmt::Write as _;

use serde::Serialize;

/// One row of the table.
#[derive(Serialize, Debug, Clone)]
pub struct Row {
    pub model: String,
    /// The file, or `synthetic:NAME seed=S`.
    pub model_path: String,
    pub size: String,
    pub size_bytes: usize,
    pub params: String,
    pub n_params: usize,
    #[serde(rename = "type")]
    pub weight_type: String,
    pub backend: String,
    pub threads: usize,
    pub test: String,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Sequences decoded together (tg tests); 1 for pp tests.
    pub batch: usize,
    /// Tokens per second (all sequences of the batch together): mean and sample standard
    /// deviation over the repetitions.
    pub tokens_per_s: f64,
    pub tokens_per_s_sd: f64,
    /// Median over repetitions of milliseconds per token (a step of a batch of B yields B).
    pub ms_per_token: f64,
    /// Bytes that must move per token for this test's dimensions.
    pub bytes_per_token: f64,
    /// Which model of bytes `bytes_per_token` comes from.
    pub bytes_source: String,
    /// Bandwidth the roofline is computed against, bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// What measured that bandwidth (or that it was given).
    pub bandwidth_source: String,
    /// (bytes per token / bandwidth) / measured time per token, in percent.
    pub roofline_pct: f64,
    /// Wall time of each repetition, nanoseconds.
    pub samples_ns: Vec<u64>,
    /// Tokens per second of each repetition.
    pub samples_ts: Vec<f64>,
}

/// The roofline fraction in percent: the time `bytes` would take at `bytes_per_s`, over the
/// measured `ms_per_token`.
pub fn roofline_pct(bytes_per_token: f64, bytes_per_s: f64, ms_per_token: f64) -> f64 {
    bytes_per_token / bytes_per_s / (ms_per_token / 1e3) * 100.0
}

const COLUMNS: [&str; 11] = [
    "model",
    "size",
    "params",
    "type",
    "backend",
    "threads",
    "batch",
    "test",
    "t/s",
    "ms/token",
    "roofline %",
];

/// Columns printed right-aligned (numbers), as llama-bench does.
fn right(c: usize) -> bool {
    c >= 5 && COLUMNS[c] != "test"
}

fn cells(r: &Row) -> [String; 11] {
    [
        r.model.clone(),
        r.size.clone(),
        r.params.clone(),
        r.weight_type.clone(),
        r.backend.clone(),
        r.threads.to_string(),
        r.batch.to_string(),
        r.test.clone(),
        format!("{:.2} ± {:.2}", r.tokens_per_s, r.tokens_per_s_sd),
        format!("{:.3}", r.ms_per_token),
        format!("{:.1}", r.roofline_pct),
    ]
}

/// A Markdown table, padded so it also reads as plain text.
pub fn markdown(rows: &[Row]) -> String {
    let body: Vec<[String; 11]> = rows.iter().map(cells).collect();
    table(&COLUMNS.map(String::from), &body, right)
}

/// Renders a padded Markdown table; `right(c)` right-aligns column `c`.
pub fn table<const N: usize>(
    head: &[String; N],
    body: &[[String; N]],
    right: impl Fn(usize) -> bool,
) -> String {
    let width: Vec<usize> = (0..N)
        .map(|c| {
            body.iter()
                .map(|r| r[c].chars().count())
                .chain([head[c].chars().count(), 3])
                .max()
                .unwrap_or(3)
        })
        .collect();
    let line = |cells: &[String]| {
        let mut s = String::from("|");
        for (c, v) in cells.iter().enumerate() {
            let pad = " ".repeat(width[c] - v.chars().count());
            if right(c) {
                let _ = write!(s, " {pad}{v} |");
            } else {
                let _ = write!(s, " {v}{pad} |");
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(head);
    out.push('|');
    for (c, w) in width.iter().enumerate() {
        if right(c) {
            let _ = write!(out, " {}: |", "-".repeat(w - 1));
        } else {
            let _ = write!(out, " {} |", "-".repeat(*w));
        }
    }
    out.push('\n');
    for r in body {
        out.push_str(&line(r));
    }
    out
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

pub fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "model,size_bytes,n_params,type,backend,threads,test,n_prompt,n_gen,batch,tokens_per_s,tokens_per_s_sd,ms_per_token,bytes_per_token,bandwidth_bytes_per_s,roofline_pct,samples_ns\n",
    );
    for r in rows {
        let samples: Vec<String> = r.samples_ns.iter().map(u64::to_string).collect();
        let fields = [
            csv_field(&r.model),
            r.size_bytes.to_string(),
            r.n_params.to_string(),
            csv_field(&r.weight_type),
            csv_field(&r.backend),
            r.threads.to_string(),
            r.test.clone(),
            r.n_prompt.to_string(),
            r.n_gen.to_string(),
            r.batch.to_string(),
            format!("{:.3}", r.tokens_per_s),
            format!("{:.3}", r.tokens_per_s_sd),
            format!("{:.4}", r.ms_per_token),
            format!("{:.0}", r.bytes_per_token),
            format!("{:.0}", r.bandwidth_bytes_per_s),
            format!("{:.2}", r.roofline_pct),
            samples.join(";"),
        ];
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_is_the_ideal_time_over_the_measured_time() {
        // 2 GB per token at 2 TB/s is 1 ms; measured 1.25 ms → 80%.
        assert!((roofline_pct(2e9, 2e12, 1.25) - 80.0).abs() < 1e-9);
    }

    #[test]
    fn tables_pad_and_align() {
        let t = table(
            &["a".to_string(), "n".to_string()],
            &[["xyz".to_string(), "7".to_string()]],
            |c| c == 1,
        );
        assert_eq!(t, "| a   |   n |\n| --- | --: |\n| xyz |   7 |\n");
    }
}
