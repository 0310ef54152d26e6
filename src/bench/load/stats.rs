//! One concurrency level's figures from its requests' records: aggregate tokens/s and
//! requests/s over the level's wall time, and time-to-first-token and inter-token latency
//! percentiles.

use std::time::Duration;

use serde::Serialize;

use super::sse::RequestRecord;

/// The nearest-rank percentile `p` (0 < p ≤ 100) of sorted values; `None` for none.
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// One row of the serving benchmark's table.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LevelStats {
    /// The server under test, as labelled on the command line.
    pub server: String,
    pub concurrency: usize,
    /// Requests that completed (streamed to `[DONE]`).
    pub requests: usize,
    /// Requests that failed (HTTP error, error event, cut stream).
    pub errors: usize,
    /// Completed requests whose completion was not exactly `max_tokens` tokens long.
    pub short: usize,
    pub max_tokens: usize,
    /// Completion tokens of the completed requests.
    pub tokens: usize,
    /// From the first request sent to the last stream ended.
    pub wall_s: f64,
    pub tokens_per_s: f64,
    pub requests_per_s: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    /// Whether every completed request's token count came from the server's `usage`.
    pub tokens_from_usage: bool,
}

impl LevelStats {
    pub fn new(
        server: &str,
        concurrency: usize,
        max_tokens: usize,
        records: &[RequestRecord],
        errors: usize,
        wall: Duration,
    ) -> LevelStats {
        let tokens: usize = records.iter().map(|r| r.tokens).sum();
        let mut ttft: Vec<Duration> = records.iter().filter_map(|r| r.ttft).collect();
        ttft.sort();
        let mut itl: Vec<Duration> = records
            .iter()
            .flat_map(|r| r.itls.iter().copied())
            .collect();
        itl.sort();
        let secs = wall.as_secs_f64();
        let rate = |n: usize| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
        LevelStats {
            server: server.to_string(),
            concurrency,
            requests: records.len(),
            errors,
            short: records.iter().filter(|r| r.tokens != max_tokens).count(),
            max_tokens,
            tokens,
            wall_s: secs,
            tokens_per_s: rate(tokens),
            requests_per_s: rate(records.len()),
            ttft_p50_ms: ms(percentile(&ttft, 50.0)),
            ttft_p99_ms: ms(percentile(&ttft, 99.0)),
            itl_p50_ms: ms(percentile(&itl, 50.0)),
            itl_p99_ms: ms(percentile(&itl, 99.0)),
            tokens_from_usage: records.iter().all(|r| r.tokens_from_usage),
        }
    }
}

/// The levels as a Markdown table.
pub fn markdown(rows: &[LevelStats]) -> String {
    let f = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
    let mut s = String::from(
        "| server | clients | requests | tokens | tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors | short |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.2} | {} | {} | {} | {} | {} | {} |\n",
            r.server,
            r.concurrency,
            r.requests,
            r.tokens,
            r.tokens_per_s,
            r.requests_per_s,
            f(r.ttft_p50_ms),
            f(r.ttft_p99_ms),
            f(r.itl_p50_ms),
            f(r.itl_p99_ms),
            r.errors,
            r.short
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<Duration> = (1..=100).map(ms).collect();
        assert_eq!(percentile(&v, 50.0), Some(ms(50)));
        assert_eq!(percentile(&v, 99.0), Some(ms(99)));
        assert_eq!(percentile(&v, 100.0), Some(ms(100)));
        assert_eq!(percentile(&[ms(7)], 99.0), Some(ms(7)));
        assert_eq!(percentile(&[ms(1), ms(2), ms(3)], 50.0), Some(ms(2)));
        assert_eq!(percentile(&[ms(1), ms(9)], 99.0), Some(ms(9)));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn level_figures() {
        let rec = |ttft: u64, itls: &[u64], tokens: usize| RequestRecord {
            ttft: Some(ms(ttft)),
            itls: itls.iter().map(|&i| ms(i)).collect(),
            tokens,
            tokens_from_usage: true,
            total: ms(1000),
            finish_reason: Some("length".into()),
        };
        let records = [
            rec(100, &[10, 20, 30], 4),
            rec(300, &[40, 50, 60], 4),
            rec(200, &[5], 2),
        ];
        let s = LevelStats::new("kiln", 3, 4, &records, 1, Duration::from_secs(2));
        assert_eq!((s.requests, s.errors, s.short, s.tokens), (3, 1, 1, 10));
        assert_eq!(s.tokens_per_s, 5.0);
        assert_eq!(s.requests_per_s, 1.5);
        assert_eq!(s.ttft_p50_ms, Some(200.0));
        assert_eq!(s.ttft_p99_ms, Some(300.0));
        // ITLs pooled over requests: 5 10 20 30 40 50 60.
        assert_eq!(s.itl_p50_ms, Some(30.0));
        assert_eq!(s.itl_p99_ms, Some(60.0));
        assert!(s.tokens_from_usage);
        let table = markdown(&[s]);
        assert!(
            table.contains(
                "| kiln | 3 | 3 | 10 | 5.0 | 1.50 | 200.0 | 300.0 | 30.0 | 60.0 | 1 | 1 |"
            ),
            "{table}"
        );
        let none = LevelStats::new("x", 1, 4, &[], 2, Duration::ZERO);
        assert_eq!((none.tokens_per_s, none.ttft_p50_ms), (0.0, None));
    }
}
