//! The server's counters and latency histograms, rendered in the Prometheus text format
//! beside the scheduler's own counters (queue, memory, cache).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use crate::engine::SchedulerStats;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A cumulative histogram with [`BUCKETS`].
#[derive(Debug, Default, Clone)]
pub struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        for (c, &b) in self.counts.iter_mut().zip(BUCKETS.iter()) {
            if s <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += s;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(BUCKETS.iter()) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Responses by HTTP status.
    requests: BTreeMap<u16, u64>,
    ttft: Histogram,
    itl: Histogram,
}

/// Shared by every handler (a short lock per update).
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn count_response(&self, status: u16) {
        *self.lock().requests.entry(status).or_default() += 1;
    }

    /// Time from a request's arrival to its first generated token.
    pub fn time_to_first_token(&self, d: Duration) {
        self.lock().ttft.observe(d);
    }

    /// Time between two successive steps of one request's tokens.
    pub fn inter_token(&self, d: Duration) {
        self.lock().itl.observe(d);
    }

    /// The Prometheus text exposition of the server's and the scheduler's counters.
    pub fn render(&self, s: &SchedulerStats) -> String {
        let inner = self.lock();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP kiln_requests_total HTTP responses by status.\n# TYPE kiln_requests_total counter"
        );
        for (status, n) in &inner.requests {
            let _ = writeln!(out, "kiln_requests_total{{status=\"{status}\"}} {n}");
        }
        let gauges: [(&str, &str, u64); 5] = [
            (
                "kiln_queue_waiting",
                "Sequences waiting for a slot.",
                s.waiting as u64,
            ),
            (
                "kiln_running_sequences",
                "Sequences being generated.",
                s.running as u64,
            ),
            (
                "kiln_kv_blocks_used",
                "KV pool blocks in use (prefix-cache blocks included).",
                s.blocks_total.saturating_sub(s.blocks_free) as u64,
            ),
            (
                "kiln_kv_blocks_free",
                "KV pool blocks free.",
                s.blocks_free as u64,
            ),
            (
                "kiln_prefix_cache_blocks",
                "KV blocks held by the prefix cache.",
                s.prefix_blocks as u64,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        let counters: [(&str, &str, u64); 11] = [
            (
                "kiln_prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
                s.prefix_hit_tokens,
            ),
            (
                "kiln_prompt_tokens_total",
                "Prompt tokens received.",
                s.prompt_tokens,
            ),
            (
                "kiln_generation_tokens_total",
                "Tokens generated.",
                s.generated_tokens,
            ),
            (
                "kiln_preemptions_total",
                "Sequences preempted for memory.",
                s.preemptions,
            ),
            (
                "kiln_spec_proposed_tokens_total",
                "Tokens proposed by speculative decoding.",
                s.spec_proposed_tokens,
            ),
            (
                "kiln_spec_accepted_tokens_total",
                "Proposed tokens the model agreed with.",
                s.spec_accepted_tokens,
            ),
            (
                "kiln_spec_verify_passes_total",
                "Decode passes of speculating sequences (each verifies its proposals, or none).",
                s.spec_verify_passes,
            ),
            (
                "kiln_spec_draft_passes_total",
                "Forward passes of draft models (each over every sequence a draft proposes for).",
                s.spec_draft_passes,
            ),
            (
                "kiln_graph_steps_total",
                "Scheduler steps that consumed a decode-graph (megakernel) replay.",
                s.graph_steps,
            ),
            (
                "kiln_graph_starts_total",
                "Times the scheduler started a decode graph.",
                s.graph_starts,
            ),
            (
                "kiln_device_draw_steps_total",
                "Kernel-by-kernel steps whose tokens were drawn on the device.",
                s.device_draw_steps,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        inner.ttft.render(
            &mut out,
            "kiln_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        );
        inner.itl.render(
            &mut out,
            "kiln_inter_token_latency_seconds",
            "Time between successive tokens of a request.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let mut h = Histogram::default();
        h.observe(Duration::from_millis(20));
        h.observe(Duration::from_secs(60));
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.01\"} 0\n"));
        assert!(out.contains("x_bucket{le=\"0.025\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"30\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 2\n"));
        assert!(out.contains("x_count 2\n"));
    }
}
