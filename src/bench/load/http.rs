//! The smallest HTTP/1.1 client the load generator needs: one `POST` of a JSON body per
//! connection (`Connection: close`) over a blocking [`TcpStream`], the response's status and
//! headers, and its body read as it arrives whether it is chunked, sized or delimited by the
//! close. A blocking thread per client costs nothing while it waits, so the generator spends no
//! CPU the server under test could use, and pulls in no HTTP client crate.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use super::LoadError;

/// `http://HOST:PORT[/PREFIX]`: where the server listens (plain HTTP only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Url {
    pub host: String,
    pub port: u16,
    /// Path prefix before `/v1/...`, without a trailing slash (usually empty).
    pub prefix: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url, LoadError> {
        let bad = |why: &str| LoadError::Url {
            url: s.to_string(),
            why: why.to_string(),
        };
        let rest = s
            .strip_prefix("http://")
            .ok_or_else(|| bad("only http:// URLs are supported"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(bad("no host"));
        }
        let (host, port) = match authority.rsplit_once(':') {
            // `[::1]:8080`, `127.0.0.1:8080`, `localhost:8080`
            Some((h, p)) if !p.contains(']') => (
                h,
                p.parse::<u16>()
                    .map_err(|_| bad("the port is not a number from 0 to 65535"))?,
            ),
            _ => (authority, 80),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("no host"));
        }
        Ok(Url {
            host: host.to_string(),
            port,
            prefix: path.trim_end_matches('/').to_string(),
        })
    }

    /// `HOST:PORT` as the `Host` header writes it.
    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// A response whose status and headers have been read; the body is read from [`Response::body`].
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Body<BufReader<TcpStream>>,
}

impl Response {
    /// The first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The largest status line or header line accepted (a server is trusted, but not blindly).
const MAX_HEAD_LINE: usize = 16 << 10;
/// The most header lines accepted.
const MAX_HEADERS: usize = 128;

/// Sends `POST url.prefix + path` with a JSON `body` and reads the response head. `timeout` bounds
/// the connect and every read and write (not the whole exchange).
pub fn post_json(
    url: &Url,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<Response, LoadError> {
    let io = |e: io::Error| LoadError::Io {
        url: url.authority(),
        source: e,
    };
    let addr = (url.host.as_str(), url.port)
        .to_socket_addrs()
        .map_err(io)?
        .next()
        .ok_or_else(|| LoadError::Url {
            url: url.authority(),
            why: "the host resolves to no address".into(),
        })?;
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(io)?;
    stream.set_nodelay(true).map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let head = format!(
        "POST {}{path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Accept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        url.prefix,
        url.authority(),
        body.len()
    );
    let mut w = &stream;
    w.write_all(head.as_bytes()).map_err(io)?;
    w.write_all(body.as_bytes()).map_err(io)?;
    w.flush().map_err(io)?;
    let mut r = BufReader::new(stream);
    let (status, headers) = read_head(&mut r).map_err(io)?;
    let body = Body::new(r, &headers).map_err(io)?;
    Ok(Response {
        status,
        headers,
        body,
    })
}

fn invalid(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

/// One CRLF- (or LF-) terminated line without its terminator; `None` at end of stream.
fn read_line<R: BufRead>(r: &mut R) -> io::Result<Option<String>> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_HEAD_LINE as u64 + 2)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        return Err(invalid(format!(
            "a response line longer than {MAX_HEAD_LINE} bytes, or cut off"
        )));
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| invalid("a response line is not UTF-8"))
}

/// The status line and headers of a response.
pub fn read_head<R: BufRead>(r: &mut R) -> io::Result<(u16, Vec<(String, String)>)> {
    let line = read_line(r)?
        .ok_or_else(|| invalid("the server closed the connection without a response"))?;
    let mut parts = line.splitn(3, ' ');
    let (version, code) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if !version.starts_with("HTTP/1.") {
        return Err(invalid(format!("not an HTTP/1.x status line: {line:?}")));
    }
    let status = code
        .parse::<u16>()
        .map_err(|_| invalid(format!("no status code in {line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(|| invalid("the response ended inside its headers"))?;
        if line.is_empty() {
            return Ok((status, headers));
        }
        if headers.len() == MAX_HEADERS {
            return Err(invalid(format!("more than {MAX_HEADERS} response headers")));
        }
        let (k, v) = line
            .split_once(':')
            .ok_or_else(|| invalid(format!("a header line without ':': {line:?}")))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
}

/// A response body as it arrives: chunked, sized by `Content-Length`, or up to the close.
pub enum Body<R> {
    Chunked { r: R, left: u64, done: bool },
    Sized { r: R, left: u64 },
    UntilClose(R),
}

impl<R: BufRead> Body<R> {
    pub fn new(r: R, headers: &[(String, String)]) -> io::Result<Body<R>> {
        let get = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        if get("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
            return Ok(Body::Chunked {
                r,
                left: 0,
                done: false,
            });
        }
        match get("content-length") {
            Some(v) => {
                let left = v
                    .parse::<u64>()
                    .map_err(|_| invalid(format!("Content-Length {v:?} is not a number")))?;
                Ok(Body::Sized { r, left })
            }
            None => Ok(Body::UntilClose(r)),
        }
    }
}

impl<R: BufRead> Read for Body<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Body::UntilClose(r) => r.read(buf),
            Body::Sized { r, left } => {
                if *left == 0 {
                    return Ok(0);
                }
                let want = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                let n = r.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("the body ended {left} bytes short of its Content-Length"),
                    ));
                }
                *left -= n as u64;
                Ok(n)
            }
            Body::Chunked { r, left, done } => {
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let line = read_line(r)?
                        .ok_or_else(|| invalid("the chunked body ended without its last chunk"))?;
                    let size = line.split(';').next().unwrap_or("").trim();
                    *left = u64::from_str_radix(size, 16)
                        .map_err(|_| invalid(format!("a chunk size that is not hex: {line:?}")))?;
                    if *left == 0 {
                        // Trailers, then the blank line that ends the message.
                        while read_line(r)?.is_some_and(|l| !l.is_empty()) {}
                        *done = true;
                        return Ok(0);
                    }
                }
                let want = buf.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                let n = r.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the connection closed inside a chunk",
                    ));
                }
                *left -= n as u64;
                if *left == 0 {
                    let end = read_line(r)?;
                    if end.as_deref() != Some("") {
                        return Err(invalid("a chunk not followed by CRLF"));
                    }
                }
                Ok(n)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = Url::parse("http://127.0.0.1:8080").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("127.0.0.1", 8080, "")
        );
        let u = Url::parse("http://localhost/api/").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.prefix.as_str()),
            ("localhost", 80, "/api")
        );
        let u = Url::parse("http://[::1]:9000").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 9000));
        assert_eq!(u.authority(), "[::1]:9000");
        for bad in [
            "https://x:1",
            "127.0.0.1:8080",
            "http://:80",
            "http://h:99999",
            "http://",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    fn body_of(raw: &[u8]) -> io::Result<(u16, Vec<u8>)> {
        let mut r = io::Cursor::new(raw);
        let (status, headers) = read_head(&mut r)?;
        let mut out = Vec::new();
        Body::new(r, &headers)?.read_to_end(&mut out)?;
        Ok((status, out))
    }

    #[test]
    fn bodies_chunked_sized_and_until_close() {
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: 1\r\n\r\n";
        assert_eq!(body_of(chunked).unwrap(), (200, b"hello, world".to_vec()));
        let sized = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 3\r\n\r\nabcdef";
        assert_eq!(body_of(sized).unwrap(), (429, b"abc".to_vec()));
        let close = b"HTTP/1.0 200 OK\nContent-Type: text/plain\n\nall of it";
        assert_eq!(body_of(close).unwrap(), (200, b"all of it".to_vec()));
    }

    #[test]
    fn broken_responses_are_errors() {
        for raw in [
            &b""[..],
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        ] {
            assert!(body_of(raw).is_err(), "{:?}", String::from_utf8_lossy(raw));
        }
    }
}
