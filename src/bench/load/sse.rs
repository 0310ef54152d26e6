//! Reading a streamed completion: the server-sent events of the body, and what each one says
//! about the request (a token's text arrived, the usage, an error, the end).

use std::io::{self, BufRead, Read};
use std::time::Duration;

use serde_json::Value;

use super::LoadError;

/// The largest event accepted, in bytes (a token chunk is a few hundred).
const MAX_EVENT: usize = 1 << 20;

/// The `data` of each event in an SSE stream (`data:` lines joined by newlines; comments, `event:`
/// and `id:` lines skipped), in order.
pub struct Events<R> {
    r: R,
    line: Vec<u8>,
}

impl<R: BufRead> Events<R> {
    pub fn new(r: R) -> Events<R> {
        Events {
            r,
            line: Vec::new(),
        }
    }

    /// The next event's data; `None` once the stream ends.
    pub fn next_data(&mut self) -> io::Result<Option<String>> {
        let mut data: Option<String> = None;
        loop {
            self.line.clear();
            let n = Read::take(&mut self.r, MAX_EVENT as u64).read_until(b'\n', &mut self.line)?;
            if n == 0 {
                // A stream that ends without the blank line still delivers its last event.
                return Ok(data);
            }
            let mut l = self.line.as_slice();
            if l.last() == Some(&b'\n') {
                l = &l[..l.len() - 1];
            } else if n == MAX_EVENT {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("an event line longer than {MAX_EVENT} bytes"),
                ));
            }
            if l.last() == Some(&b'\r') {
                l = &l[..l.len() - 1];
            }
            if l.is_empty() {
                if data.is_some() {
                    return Ok(data);
                }
                continue;
            }
            let Some(rest) = l.strip_prefix(b"data:") else {
                continue;
            };
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let text = std::str::from_utf8(rest).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidData, "an event's data is not UTF-8")
            })?;
            let d = data.get_or_insert_with(String::new);
            if !d.is_empty() {
                d.push('\n');
            }
            d.push_str(text);
            if d.len() > MAX_EVENT {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("an event longer than {MAX_EVENT} bytes"),
                ));
            }
        }
    }
}

/// What one request's stream amounted to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestRecord {
    /// From sending the request to the first event carrying text.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive events carrying text.
    pub itls: Vec<Duration>,
    /// Completion tokens: the usage the server reported, else the events carrying text.
    pub tokens: usize,
    /// Whether `tokens` came from the server's usage.
    pub tokens_from_usage: bool,
    /// From sending the request to the end of the stream.
    pub total: Duration,
    pub finish_reason: Option<String>,
}

/// Folds the events of one stream, with the time each arrived (since the request was sent),
/// into a [`RequestRecord`].
#[derive(Default)]
pub struct Tally {
    first: Option<Duration>,
    last: Option<Duration>,
    itls: Vec<Duration>,
    text_events: usize,
    usage_tokens: Option<usize>,
    finish_reason: Option<String>,
    done: bool,
}

impl Tally {
    /// Takes one event's data. Returns whether the stream is finished (`[DONE]`).
    pub fn on_data(&mut self, data: &str, at: Duration) -> Result<bool, LoadError> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(true);
        }
        let v: Value = serde_json::from_str(data).map_err(|e| LoadError::Protocol {
            why: format!("an event is not JSON ({e}): {}", clip(data)),
        })?;
        if let Some(err) = v.get("error") {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| err.to_string(), str::to_string);
            return Err(LoadError::Server {
                status: None,
                message: msg,
            });
        }
        let mut has_text = false;
        for c in v
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            // /v1/completions: choices[].text; /v1/chat/completions: choices[].delta.content.
            let text = c
                .get("text")
                .or_else(|| c.get("delta").and_then(|d| d.get("content")))
                .and_then(Value::as_str)
                .unwrap_or("");
            has_text |= !text.is_empty();
            if let Some(f) = c.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(f.to_string());
            }
        }
        if let Some(n) = v
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(Value::as_u64)
        {
            self.usage_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
        }
        if has_text {
            self.text_events += 1;
            if self.first.is_none() {
                self.first = Some(at);
            }
            if let Some(prev) = self.last {
                self.itls.push(at.saturating_sub(prev));
            }
            self.last = Some(at);
        }
        Ok(false)
    }

    /// The record of a stream that ended at `total`; an error if it never said `[DONE]`.
    pub fn finish(self, total: Duration) -> Result<RequestRecord, LoadError> {
        if !self.done {
            return Err(LoadError::Protocol {
                why: format!(
                    "the stream ended without data: [DONE] after {} text events",
                    self.text_events
                ),
            });
        }
        Ok(RequestRecord {
            ttft: self.first,
            itls: self.itls,
            tokens: self.usage_tokens.unwrap_or(self.text_events),
            tokens_from_usage: self.usage_tokens.is_some(),
            total,
            finish_reason: self.finish_reason,
        })
    }
}

/// The start of a long string, for error messages.
pub fn clip(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(raw: &str) -> Vec<String> {
        let mut e = Events::new(raw.as_bytes());
        let mut out = Vec::new();
        while let Some(d) = e.next_data().unwrap() {
            out.push(d);
        }
        out
    }

    #[test]
    fn events_are_split_and_joined() {
        let raw = ": comment\r\nevent: x\r\ndata: {\"a\":1}\r\n\r\ndata:two\ndata: lines\nid: 3\n\n\n\ndata: [DONE]";
        assert_eq!(all(raw), vec!["{\"a\":1}", "two\nlines", "[DONE]"]);
        assert!(all("").is_empty());
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn tally_of_a_completion_stream() {
        let mut t = Tally::default();
        let text =
            |s: &str| format!(r#"{{"choices":[{{"index":0,"text":{s:?},"finish_reason":null}}]}}"#);
        assert!(!t.on_data(&text("Hello"), ms(100)).unwrap());
        // An event with no text (a held-back partial character) is not a token arrival.
        assert!(!t.on_data(&text(""), ms(110)).unwrap());
        assert!(!t.on_data(&text(" wor"), ms(130)).unwrap());
        assert!(!t.on_data(&text("ld"), ms(190)).unwrap());
        t.on_data(
            r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#,
            ms(191),
        )
        .unwrap();
        t.on_data(
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4}}"#,
            ms(192),
        )
        .unwrap();
        assert!(t.on_data("[DONE]", ms(193)).unwrap());
        let r = t.finish(ms(200)).unwrap();
        assert_eq!(r.ttft, Some(ms(100)));
        assert_eq!(r.itls, vec![ms(30), ms(60)]);
        assert_eq!((r.tokens, r.tokens_from_usage), (4, true));
        assert_eq!(r.finish_reason.as_deref(), Some("length"));
        assert_eq!(r.total, ms(200));
    }

    #[test]
    fn tally_of_a_chat_stream_without_usage() {
        let mut t = Tally::default();
        let delta = |s: &str| format!(r#"{{"choices":[{{"delta":{{"content":{s:?}}}}}]}}"#);
        t.on_data(
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            ms(1),
        )
        .unwrap();
        t.on_data(&delta("a"), ms(50)).unwrap();
        t.on_data(&delta("b"), ms(75)).unwrap();
        t.on_data("[DONE]", ms(76)).unwrap();
        let r = t.finish(ms(80)).unwrap();
        assert_eq!((r.ttft, r.itls.clone()), (Some(ms(50)), vec![ms(25)]));
        assert_eq!((r.tokens, r.tokens_from_usage), (2, false));
    }

    #[test]
    fn errors_and_cut_streams_are_errors() {
        let mut t = Tally::default();
        let e = t
            .on_data(
                r#"{"error":{"message":"the prompt is too long","type":"x"}}"#,
                ms(1),
            )
            .unwrap_err();
        assert!(e.to_string().contains("the prompt is too long"), "{e}");
        assert!(Tally::default().on_data("{not json", ms(1)).is_err());
        let mut t = Tally::default();
        t.on_data(r#"{"choices":[{"text":"a"}]}"#, ms(1)).unwrap();
        let e = t.finish(ms(2)).unwrap_err();
        assert!(e.to_string().contains("[DONE]"), "{e}");
    }
}
