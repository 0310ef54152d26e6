//! Reading text from the user: a prompt from a file or stdin (`-f`), and the lines of a chat.
//! Both are bounded in size and checked for UTF-8, and a bad chat line is reported and skipped
//! rather than ending the conversation.

use std::io::{BufRead, Read};
use std::path::Path;

/// The largest prompt or chat line read: far more text than any model's context holds, and a
/// bound on what `-f /dev/zero` can take.
pub const MAX_TEXT_BYTES: u64 = 64 << 20;

#[derive(Debug, thiserror::Error)]
#[error("reading the prompt from {source_name}: {reason}")]
pub struct PromptFileError {
    pub source_name: String,
    pub reason: String,
}

/// Reads a prompt from `path`, or from stdin when `path` is `-`: UTF-8, at most
/// [`MAX_TEXT_BYTES`].
pub fn read_prompt(path: &Path) -> Result<String, PromptFileError> {
    let (source_name, bytes) = if path == Path::new("-") {
        ("stdin".to_string(), read_bounded(std::io::stdin().lock()))
    } else {
        let bytes = std::fs::File::open(path)
            .map_err(|e| e.to_string())
            .and_then(read_bounded);
        (path.display().to_string(), bytes)
    };
    let fail = |reason: String| PromptFileError {
        source_name: source_name.clone(),
        reason,
    };
    let bytes = bytes.map_err(fail)?;
    String::from_utf8(bytes).map_err(|e| {
        fail(format!(
            "not valid UTF-8 (at byte {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

fn read_bounded(r: impl Read) -> Result<Vec<u8>, String> {
    let mut bytes = Vec::new();
    r.take(MAX_TEXT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        return Err(format!("longer than {} MiB", MAX_TEXT_BYTES >> 20));
    }
    Ok(bytes)
}

/// One line of chat input.
#[derive(Debug, PartialEq, Eq)]
pub enum ChatLine {
    /// The line, without its line ending.
    Text(String),
    /// Not UTF-8: the byte offset of the first bad byte.
    NotUtf8(usize),
    /// Longer than [`MAX_TEXT_BYTES`] (the rest of it was skipped).
    TooLong,
    /// End of input.
    End,
}

/// Reads one line, at most `limit` bytes of it kept.
pub fn read_chat_line(r: &mut impl BufRead, limit: u64) -> std::io::Result<ChatLine> {
    let mut buf = Vec::new();
    let n = r.by_ref().take(limit + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(ChatLine::End);
    }
    if buf.len() as u64 > limit && buf.last() != Some(&b'\n') {
        skip_line(r)?;
        return Ok(ChatLine::TooLong);
    }
    while matches!(buf.last(), Some(b'\n' | b'\r')) {
        buf.pop();
    }
    Ok(match String::from_utf8(buf) {
        Ok(s) => ChatLine::Text(s),
        Err(e) => ChatLine::NotUtf8(e.utf8_error().valid_up_to()),
    })
}

/// Discards input up to and including the next newline, without holding it.
fn skip_line(r: &mut impl BufRead) -> std::io::Result<()> {
    loop {
        let chunk = r.fill_buf()?;
        if chunk.is_empty() {
            return Ok(());
        }
        match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => {
                r.consume(i + 1);
                return Ok(());
            }
            None => {
                let n = chunk.len();
                r.consume(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_files() {
        let dir = std::env::temp_dir().join(format!("kiln-prompt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("ok.txt");
        std::fs::write(&ok, "héllo\n").unwrap();
        assert_eq!(read_prompt(&ok).unwrap(), "héllo\n");
        let bad = dir.join("bad.txt");
        std::fs::write(&bad, b"ab\xffcd").unwrap();
        let e = read_prompt(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.txt") && e.contains("at byte 2"), "{e}");
        let e = read_prompt(&dir).unwrap_err().to_string();
        assert!(e.contains(&dir.display().to_string()), "{e}");
        let e = read_prompt(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("longer than 64 MiB"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chat_lines_bad_and_long_are_skipped_not_fatal() {
        let input: &[u8] = b"hi\r\n\xff\xfe\nabcdefghij\nok";
        let mut r = std::io::BufReader::with_capacity(4, input);
        let mut lines = Vec::new();
        loop {
            let l = read_chat_line(&mut r, 6).unwrap();
            if l == ChatLine::End {
                break;
            }
            lines.push(l);
        }
        assert_eq!(
            lines,
            [
                ChatLine::Text("hi".into()),
                ChatLine::NotUtf8(0),
                ChatLine::TooLong,
                ChatLine::Text("ok".into()),
            ]
        );
    }
}
