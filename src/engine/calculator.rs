//! nanochat's calculator tool, without a Python interpreter.
//!
//! [`use_calculator`] returns the text nanochat forces into the token stream after a
//! `<|python_start|>expr<|python_end|>` block: `str(eval(expr))` after nanochat's filters
//! (see `nanochat.md` §6), or `None` where nanochat's `use_calculator` returns `None`.
//!
//! The filters are copied exactly. What is evaluated is a faithful subset of Python 3.11:
//!
//! * Math path (`0123456789*+-/.() `, no `**`): the whole language those characters can spell.
//!   Int literals (leading zeros rejected, `00` allowed), float literals (`1.5`, `.5`, `5.`,
//!   `007.5`; overflowing literals are `inf`), `+ - * / //` with Python precedence and left
//!   associativity, unary `+`/`-` chains, parentheses, `()` (the empty tuple: `()+()`,
//!   `()*n`), `...` (`Ellipsis`). Ints are exact (own arbitrary-precision ints); `/` is
//!   correctly rounded like CPython's `int/int`; int→float conversion is correctly rounded and
//!   overflow is an error; float `//` follows CPython's `float_floor_div`. Any call (`(1)(2)`)
//!   fails, as in Python. `%` never reaches eval (nanochat's filter rejects it).
//! * String path: string and bytes literals (prefixes `r u f b br rb fr rf`, any case; single,
//!   double and triple quotes; implicit concatenation), numeric literals (hex/octal/binary,
//!   underscores, exponents, imaginary), parentheses, `()`, `...`, and the method calls
//!   `str.count(str)`, `bytes.count(bytes | int)`, `tuple.count(x)` (always 0 for `()`),
//!   `str/bytes.upper()`, `str/bytes.lower()`, chained (`'a'.upper().count('A')`). A string
//!   result prints as itself (`'.count('` → `.count(`), bytes as their repr.
//!   Not implemented (returns `None` although Python evaluates them): other attributes and
//!   methods (`.real`, `.bit_length()`, `.split()`, `.title()`, ...), names bound by
//!   comprehensions, keywords (`if`/`else`, `and`/`or`/`not`, `in`, `is`, `True`/`False`/
//!   `None`). Everything else that passes the filters is a Python error, so `None`.
//! * CPython's own limits (3.11, measured): more than 200 nested parentheses is a
//!   `SyntaxError`; the PEG parser overflows when 28 × (enclosing parentheses, `()` counting
//!   as one) + (enclosing unary operators) reaches 5976 (`MemoryError`); an expression tree
//!   deeper than 2991 is a `RecursionError` during compilation (the exact limit is
//!   3000 − 3 × the Python frames below `eval`, so nanochat's may be a few lower).
//!
//! Bounds: expressions longer than [`MAX_EXPR_LEN`] bytes (after the comma strip) give
//! `None` (nanochat has no length limit, only its 3 s alarm). Within that length no int can
//! exceed ~4096 digits (below CPython's 4300-digit `str()` limit, past which nanochat itself
//! raises); ints over 4300 digits are refused anyway. Parsing recursion is bounded by the
//! 200-parenthesis limit (unary and binary chains are loops) and the work by the length cap.

use std::cmp::Ordering;

/// Longest expression evaluated, in bytes after removing commas.
pub const MAX_EXPR_LEN: usize = 4096;
const MAX_PAREN_LEVEL: usize = 200;
const PARSER_STACK: usize = 5976;
const PAREN_COST: usize = 28;
const MAX_AST_DEPTH: usize = 2991;
/// 447 limbs hold at most 4306 decimal digits.
const MAX_LIMBS: usize = 447;

const DANGEROUS: [&str; 17] = [
    "__",
    "import",
    "exec",
    "eval",
    "compile",
    "open",
    "file",
    "input",
    "raw_input",
    "globals",
    "locals",
    "vars",
    "dir",
    "getattr",
    "setattr",
    "delattr",
    "hasattr",
];

/// What nanochat forces into the stream for the calculator call `expr`, or `None`.
pub fn use_calculator(expr: &str) -> Option<String> {
    evaluate(expr).0
}

/// [`use_calculator`] plus the work it did (tokens, operations and limb operations), for tests.
pub(crate) fn evaluate(expr: &str) -> (Option<String>, u64) {
    let expr = expr.replace(',', "");
    if expr.len() > MAX_EXPR_LEN {
        return (None, 0);
    }
    let b = expr.as_bytes();
    if b.iter().all(|c| b"0123456789*+-/.() ".contains(c)) {
        if expr.contains("**") {
            return (None, 0);
        }
        return run(b);
    }
    if !b
        .iter()
        .all(|&c| c.is_ascii_alphanumeric() || b"'\"()._ ".contains(&c))
    {
        return (None, 0);
    }
    let lower = expr.to_ascii_lowercase();
    if DANGEROUS.iter().any(|p| lower.contains(p)) || !expr.contains(".count(") {
        return (None, 0);
    }
    run(b)
}

fn run(b: &[u8]) -> (Option<String>, u64) {
    let mut steps = 0u64;
    let out = (|| {
        let toks = tokenize(b)?;
        steps += toks.len() as u64;
        let mut p = Parser {
            toks,
            pos: 0,
            steps: 0,
        };
        let r = p.expr(0);
        steps += p.steps;
        let (v, _) = r?;
        if p.pos != p.toks.len() {
            return None;
        }
        v.to_python_str()
    })();
    (out, steps)
}

// ---------------------------------------------------------------------------------------------
// Arbitrary-precision integers: sign and magnitude, little-endian u32 limbs, no high zero limbs.

#[derive(Clone, Debug, PartialEq, Eq)]
struct BigInt {
    neg: bool,
    mag: Vec<u32>,
}

fn trim(mut v: Vec<u32>) -> Vec<u32> {
    while v.last() == Some(&0) {
        v.pop();
    }
    v
}

fn cmp_mag(a: &[u32], b: &[u32]) -> Ordering {
    a.len()
        .cmp(&b.len())
        .then_with(|| a.iter().rev().cmp(b.iter().rev()))
}

fn add_mag(a: &[u32], b: &[u32]) -> Vec<u32> {
    let (a, b) = if a.len() >= b.len() { (a, b) } else { (b, a) };
    let mut out = Vec::with_capacity(a.len() + 1);
    let mut carry = 0u64;
    for (i, &x) in a.iter().enumerate() {
        let s = x as u64 + *b.get(i).unwrap_or(&0) as u64 + carry;
        out.push(s as u32);
        carry = s >> 32;
    }
    out.push(carry as u32);
    trim(out)
}

/// `a - b` for `a >= b`.
fn sub_mag(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len());
    let mut borrow = 0i64;
    for (i, &x) in a.iter().enumerate() {
        let mut t = x as i64 - *b.get(i).unwrap_or(&0) as i64 - borrow;
        borrow = (t < 0) as i64;
        if t < 0 {
            t += 1 << 32;
        }
        out.push(t as u32);
    }
    trim(out)
}

fn mul_mag(a: &[u32], b: &[u32]) -> Vec<u32> {
    if a.is_empty() || b.is_empty() {
        return Vec::new();
    }
    let mut out = vec![0u32; a.len() + b.len()];
    for (i, &x) in a.iter().enumerate() {
        let mut carry = 0u64;
        for (j, &y) in b.iter().enumerate() {
            let t = x as u64 * y as u64 + out[i + j] as u64 + carry;
            out[i + j] = t as u32;
            carry = t >> 32;
        }
        out[i + b.len()] = carry as u32;
    }
    trim(out)
}

fn mul_small_add(a: &mut Vec<u32>, m: u32, add: u32) {
    let mut carry = add as u64;
    for x in a.iter_mut() {
        let t = *x as u64 * m as u64 + carry;
        *x = t as u32;
        carry = t >> 32;
    }
    if carry != 0 {
        a.push(carry as u32);
    }
}

fn divmod_small(a: &[u32], d: u32) -> (Vec<u32>, u32) {
    let mut q = vec![0u32; a.len()];
    let mut r = 0u64;
    for i in (0..a.len()).rev() {
        let cur = (r << 32) | a[i] as u64;
        q[i] = (cur / d as u64) as u32;
        r = cur % d as u64;
    }
    (trim(q), r as u32)
}

fn bitlen(a: &[u32]) -> usize {
    match a.last() {
        None => 0,
        Some(&top) => a.len() * 32 - top.leading_zeros() as usize,
    }
}

fn shl_mag(a: &[u32], bits: usize) -> Vec<u32> {
    if a.is_empty() {
        return Vec::new();
    }
    let (limbs, s) = (bits / 32, bits % 32);
    let mut out = vec![0u32; limbs];
    if s == 0 {
        out.extend_from_slice(a);
    } else {
        let mut carry = 0u32;
        for &x in a {
            out.push((x << s) | carry);
            carry = x >> (32 - s);
        }
        out.push(carry);
    }
    trim(out)
}

/// `(a >> bits, whether any shifted-out bit was set)`.
fn shr_mag(a: &[u32], bits: usize) -> (Vec<u32>, bool) {
    let (limbs, s) = (bits / 32, bits % 32);
    if limbs >= a.len() {
        return (Vec::new(), !a.is_empty());
    }
    let mut lost = a[..limbs].iter().any(|&x| x != 0);
    if s != 0 {
        lost |= a[limbs] & ((1u32 << s) - 1) != 0;
    }
    let mut out = Vec::with_capacity(a.len() - limbs);
    for i in limbs..a.len() {
        let lo = a[i] >> s;
        let hi = if s != 0 {
            a.get(i + 1).map_or(0, |&h| h << (32 - s))
        } else {
            0
        };
        out.push(lo | hi);
    }
    (trim(out), lost)
}

/// Knuth's algorithm D: `(a / b, a % b)` for `b != 0`.
fn divmod_mag(a: &[u32], b: &[u32]) -> (Vec<u32>, Vec<u32>) {
    if cmp_mag(a, b) == Ordering::Less {
        return (Vec::new(), a.to_vec());
    }
    if b.len() == 1 {
        let (q, r) = divmod_small(a, b[0]);
        return (q, trim(vec![r]));
    }
    let s = b[b.len() - 1].leading_zeros() as usize;
    let vn = shl_mag(b, s);
    let mut un = shl_mag(a, s);
    un.resize(a.len() + 1, 0);
    let n = vn.len();
    let m = a.len() - n;
    let mut q = vec![0u32; m + 1];
    const BASE: u64 = 1 << 32;
    for j in (0..=m).rev() {
        let num = ((un[j + n] as u64) << 32) | un[j + n - 1] as u64;
        let mut qhat = num / vn[n - 1] as u64;
        let mut rhat = num % vn[n - 1] as u64;
        while qhat >= BASE || qhat * vn[n - 2] as u64 > ((rhat << 32) | un[j + n - 2] as u64) {
            qhat -= 1;
            rhat += vn[n - 1] as u64;
            if rhat >= BASE {
                break;
            }
        }
        let mut borrow = 0i64;
        let mut carry = 0u64;
        for i in 0..n {
            let p = qhat * vn[i] as u64 + carry;
            carry = p >> 32;
            let t = un[i + j] as i64 - borrow - (p & 0xffff_ffff) as i64;
            un[i + j] = t as u32;
            borrow = (t < 0) as i64;
        }
        let t = un[j + n] as i64 - borrow - carry as i64;
        un[j + n] = t as u32;
        if t < 0 {
            qhat -= 1;
            let mut c = 0u64;
            for i in 0..n {
                let s = un[i + j] as u64 + vn[i] as u64 + c;
                un[i + j] = s as u32;
                c = s >> 32;
            }
            un[j + n] = un[j + n].wrapping_add(c as u32);
        }
        q[j] = qhat as u32;
    }
    un.truncate(n);
    let (r, _) = shr_mag(&trim(un), s);
    (trim(q), r)
}

/// The f64 nearest `(m + f) * 2^e` (ties to even), where `0 < f < 1` iff `sticky`; `sticky`
/// needs `m` to have at least 55 bits. `None` when it overflows.
fn make_f64(m: u64, e: i64, sticky: bool) -> Option<f64> {
    if m == 0 {
        return Some(0.0);
    }
    let nb = 64 - m.leading_zeros() as i64;
    let drop = (nb - 53).max(-1074 - e);
    let (mut mant, mut unit) = if drop <= 0 {
        debug_assert!(!sticky);
        (m << (-drop) as u32, e + drop)
    } else if drop >= 128 {
        (0, e + drop)
    } else {
        let wide = m as u128;
        let rem = wide & ((1u128 << drop) - 1);
        let half = 1u128 << (drop - 1);
        let mut q = (wide >> drop) as u64;
        if rem > half || (rem == half && (sticky || q & 1 == 1)) {
            q += 1;
        }
        (q, e + drop)
    };
    if mant == 0 {
        return Some(0.0);
    }
    if mant >= 1 << 53 {
        mant >>= 1;
        unit += 1;
    }
    let bits = (((unit + 1074) as u64) << 52) + mant;
    if bits >= 0x7ff0_0000_0000_0000 {
        return None;
    }
    Some(f64::from_bits(bits))
}

impl BigInt {
    fn new(neg: bool, mag: Vec<u32>) -> BigInt {
        let mag = trim(mag);
        BigInt {
            neg: neg && !mag.is_empty(),
            mag,
        }
    }

    fn from_digits(digits: &[u8], radix: u32) -> BigInt {
        let mut mag = Vec::new();
        for &d in digits {
            let v = (d as char).to_digit(radix).unwrap_or(0);
            mul_small_add(&mut mag, radix, v);
        }
        BigInt::new(false, mag)
    }

    fn neg(self) -> BigInt {
        BigInt::new(!self.neg, self.mag)
    }

    fn add(&self, o: &BigInt) -> BigInt {
        if self.neg == o.neg {
            return BigInt::new(self.neg, add_mag(&self.mag, &o.mag));
        }
        match cmp_mag(&self.mag, &o.mag) {
            Ordering::Less => BigInt::new(o.neg, sub_mag(&o.mag, &self.mag)),
            _ => BigInt::new(self.neg, sub_mag(&self.mag, &o.mag)),
        }
    }

    fn mul(&self, o: &BigInt) -> BigInt {
        BigInt::new(self.neg != o.neg, mul_mag(&self.mag, &o.mag))
    }

    /// Python's `//` (floor division); `None` for division by zero.
    fn floordiv(&self, o: &BigInt) -> Option<BigInt> {
        if o.mag.is_empty() {
            return None;
        }
        let (mut q, r) = divmod_mag(&self.mag, &o.mag);
        let neg = self.neg != o.neg;
        if neg && !r.is_empty() {
            q = add_mag(&q, &[1]);
        }
        Some(BigInt::new(neg, q))
    }

    /// Python's `int.__float__`: correctly rounded, `None` (OverflowError) when too large.
    fn to_f64(&self) -> Option<f64> {
        let n = bitlen(&self.mag);
        let v = if n <= 64 {
            let m = self
                .mag
                .iter()
                .rev()
                .fold(0u64, |acc, &x| (acc << 32) | x as u64);
            make_f64(m, 0, false)?
        } else {
            let (top, lost) = shr_mag(&self.mag, n - 64);
            let m = top
                .iter()
                .rev()
                .fold(0u64, |acc, &x| (acc << 32) | x as u64);
            make_f64(m, (n - 64) as i64, lost)?
        };
        Some(if self.neg { -v } else { v })
    }

    /// Python's `int / int`: correctly rounded; `None` for division by zero or overflow.
    fn truediv(&self, o: &BigInt) -> Option<f64> {
        if o.mag.is_empty() {
            return None;
        }
        let neg = self.neg != o.neg;
        if self.mag.is_empty() {
            return Some(if neg { -0.0 } else { 0.0 });
        }
        let (na, nb) = (bitlen(&self.mag) as i64, bitlen(&o.mag) as i64);
        let s = 63 - na + nb;
        let (num, den) = if s >= 0 {
            (shl_mag(&self.mag, s as usize), o.mag.clone())
        } else {
            (self.mag.clone(), shl_mag(&o.mag, (-s) as usize))
        };
        let (q, r) = divmod_mag(&num, &den);
        debug_assert!(q.len() <= 2);
        let m = q.iter().rev().fold(0u64, |acc, &x| (acc << 32) | x as u64);
        let v = make_f64(m, -s, !r.is_empty())?;
        Some(if neg { -v } else { v })
    }

    fn to_i64(&self) -> Option<i64> {
        if bitlen(&self.mag) > 64 {
            return None;
        }
        let m = self
            .mag
            .iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 32) | x as u64);
        if self.neg {
            (m <= 1 << 63).then(|| (m as i64).wrapping_neg())
        } else {
            i64::try_from(m).ok()
        }
    }

    fn to_decimal(&self) -> String {
        if self.mag.is_empty() {
            return "0".into();
        }
        let mut chunks = Vec::new();
        let mut cur = self.mag.clone();
        while !cur.is_empty() {
            let (q, r) = divmod_small(&cur, 1_000_000_000);
            chunks.push(r);
            cur = q;
        }
        let mut s = String::new();
        if self.neg {
            s.push('-');
        }
        s.push_str(&chunks.last().unwrap().to_string());
        for c in chunks.iter().rev().skip(1) {
            s.push_str(&format!("{c:09}"));
        }
        s
    }
}

// ---------------------------------------------------------------------------------------------
// Values and their Python semantics.

#[derive(Clone, Debug)]
enum Val {
    Int(BigInt),
    Float(f64),
    Complex,
    /// The empty tuple (no commas survive the filter, so no other tuple can be built).
    Tuple,
    Ellipsis,
    Str(Vec<u8>),
    Bytes(Vec<u8>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
    FloorDiv,
}

/// CPython's `float_floor_div` (via `_float_div_mod`).
fn float_floordiv(vx: f64, wx: f64) -> Option<f64> {
    if wx == 0.0 {
        return None;
    }
    let m = vx % wx;
    let mut div = (vx - m) / wx;
    // A remainder (NaN included) whose sign differs from the divisor's moves the quotient down.
    if m != 0.0 && (wx < 0.0) != (m < 0.0) {
        div -= 1.0;
    }
    if div != 0.0 {
        let mut fd = div.floor();
        if div - fd > 0.5 {
            fd += 1.0;
        }
        Some(fd)
    } else {
        Some(0.0f64.copysign(vx / wx))
    }
}

fn as_f64(v: &Val) -> Option<f64> {
    match v {
        Val::Int(i) => i.to_f64(),
        Val::Float(f) => Some(*f),
        _ => None,
    }
}

fn check_int(i: BigInt) -> Option<Val> {
    (i.mag.len() <= MAX_LIMBS).then_some(Val::Int(i))
}

fn binop(op: Op, a: Val, b: Val, steps: &mut u64) -> Option<Val> {
    match (&a, &b) {
        (Val::Int(x), Val::Int(y)) => {
            *steps += (x.mag.len() as u64 + 1) * (y.mag.len() as u64 + 1);
            match op {
                Op::Add => check_int(x.add(y)),
                Op::Sub => check_int(x.add(&y.clone().neg())),
                Op::Mul => check_int(x.mul(y)),
                Op::Div => x.truediv(y).map(Val::Float),
                Op::FloorDiv => check_int(x.floordiv(y)?),
            }
        }
        (Val::Int(_) | Val::Float(_), Val::Int(_) | Val::Float(_)) => {
            let (x, y) = (as_f64(&a)?, as_f64(&b)?);
            match op {
                Op::Add => Some(Val::Float(x + y)),
                Op::Sub => Some(Val::Float(x - y)),
                Op::Mul => Some(Val::Float(x * y)),
                Op::Div => (y != 0.0).then(|| Val::Float(x / y)),
                Op::FloorDiv => float_floordiv(x, y).map(Val::Float),
            }
        }
        (Val::Tuple, Val::Tuple) if op == Op::Add => Some(Val::Tuple),
        (Val::Tuple, Val::Int(n)) | (Val::Int(n), Val::Tuple) if op == Op::Mul => {
            n.to_i64().map(|_| Val::Tuple)
        }
        _ => None,
    }
}

fn unary(neg: bool, v: Val) -> Option<Val> {
    match v {
        Val::Int(i) => Some(Val::Int(if neg { i.neg() } else { i })),
        Val::Float(f) => Some(Val::Float(if neg { -f } else { f })),
        _ => None,
    }
}

fn count_bytes(hay: &[u8], needle: &[u8]) -> usize {
    if needle.is_empty() {
        return hay.len() + 1;
    }
    let (mut i, mut n) = (0, 0);
    while i + needle.len() <= hay.len() {
        if &hay[i..i + needle.len()] == needle {
            n += 1;
            i += needle.len();
        } else {
            i += 1;
        }
    }
    n
}

fn method(obj: Val, name: &str, arg: Option<Val>) -> Option<Val> {
    let int = |n: usize| {
        Some(Val::Int(BigInt::new(
            false,
            trim(vec![n as u32, (n >> 32) as u32]),
        )))
    };
    match (obj, name, arg) {
        (Val::Str(s), "count", Some(Val::Str(p))) => int(count_bytes(&s, &p)),
        (Val::Bytes(s), "count", Some(Val::Bytes(p))) => int(count_bytes(&s, &p)),
        (Val::Bytes(s), "count", Some(Val::Int(i))) => {
            let b = u8::try_from(i.to_i64()?).ok()?;
            int(s.iter().filter(|&&c| c == b).count())
        }
        (Val::Tuple, "count", Some(_)) => int(0),
        (Val::Str(s), "upper", None) => Some(Val::Str(s.to_ascii_uppercase())),
        (Val::Str(s), "lower", None) => Some(Val::Str(s.to_ascii_lowercase())),
        (Val::Bytes(s), "upper", None) => Some(Val::Bytes(s.to_ascii_uppercase())),
        (Val::Bytes(s), "lower", None) => Some(Val::Bytes(s.to_ascii_lowercase())),
        _ => None,
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below 1e-4 or from 1e16.
fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if x.is_infinite() {
        return format!("{sign}inf");
    }
    if x == 0.0 {
        return format!("{sign}0.0");
    }
    // Rust gives the shortest round-trip digit count; among the strings of that length Python
    // prints the one nearest the value, which Rust's exact (correctly rounded) mode gives.
    let shortest = format!("{:e}", x.abs());
    let k = shortest
        .split_once('e')
        .unwrap()
        .0
        .chars()
        .filter(char::is_ascii_digit)
        .count();
    let nearest = format!("{:.*e}", k - 1, x.abs());
    let sci = if nearest.parse::<f64>() == Ok(x.abs()) {
        nearest
    } else {
        shortest
    };
    let (mant, exp) = sci.split_once('e').unwrap();
    let exp: i64 = exp.parse().unwrap();
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let decpt = exp + 1;
    let body = if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{first}{frac}e{esign}{:02}", exp.abs())
    } else if decpt <= 0 {
        format!("0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(decpt as usize - digits.len()))
    } else {
        let (a, b) = digits.split_at(decpt as usize);
        format!("{a}.{b}")
    };
    format!("{sign}{body}")
}

fn bytes_repr(b: &[u8]) -> String {
    let quote = if b.contains(&b'\'') && !b.contains(&b'"') {
        '"'
    } else {
        '\''
    };
    let mut s = format!("b{quote}");
    for &c in b {
        if c as char == quote {
            s.push('\\');
        }
        s.push(c as char);
    }
    s.push(quote);
    s
}

impl Val {
    fn to_python_str(&self) -> Option<String> {
        Some(match self {
            Val::Int(i) => i.to_decimal(),
            Val::Float(f) => float_repr(*f),
            Val::Tuple => "()".into(),
            Val::Ellipsis => "Ellipsis".into(),
            Val::Str(s) => String::from_utf8(s.clone()).ok()?,
            Val::Bytes(b) => bytes_repr(b),
            Val::Complex => return None,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Tokenizer and parser.

#[derive(Clone, Debug)]
enum Tok {
    Num(Val),
    Str { bytes: bool, text: Vec<u8> },
    Name(String),
    Op(Op),
    Plus,
    Minus,
    LPar,
    RPar,
    Dot,
    Ellipsis,
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Reads `digit ('_'? digit)*` from `i`; `None` on a misplaced underscore, `Some(i)` if no digit.
fn digit_run(b: &[u8], mut i: usize, out: &mut Vec<u8>, radix: u32) -> Option<usize> {
    let ok = |c: u8| (c as char).is_digit(radix);
    if i >= b.len() || !ok(b[i]) {
        return Some(i);
    }
    loop {
        out.push(b[i]);
        i += 1;
        if i < b.len() && b[i] == b'_' {
            if i + 1 < b.len() && ok(b[i + 1]) {
                i += 1;
                continue;
            }
            return None;
        }
        if i >= b.len() || !ok(b[i]) {
            return Some(i);
        }
    }
}

fn lex_number(b: &[u8], start: usize) -> Option<(Val, usize)> {
    let mut i = start;
    if b[i] == b'0' && i + 1 < b.len() && b"xXoObB".contains(&b[i + 1]) {
        let radix = match b[i + 1] | 0x20 {
            b'x' => 16,
            b'o' => 8,
            _ => 2,
        };
        i += 2;
        if i < b.len() && b[i] == b'_' {
            i += 1;
        }
        let mut digits = Vec::new();
        i = digit_run(b, i, &mut digits, radix)?;
        if digits.is_empty() || (i < b.len() && is_ident(b[i])) {
            return None;
        }
        return Some((Val::Int(BigInt::from_digits(&digits, radix)), i));
    }
    let mut int = Vec::new();
    i = digit_run(b, i, &mut int, 10)?;
    let mut frac = Vec::new();
    let mut exp = Vec::new();
    let mut exp_neg = false;
    let mut float = false;
    if i < b.len() && b[i] == b'.' {
        float = true;
        i = digit_run(b, i + 1, &mut frac, 10)?;
    }
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    if i < b.len() && (b[i] | 0x20) == b'e' {
        let mut j = i + 1;
        if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
            exp_neg = b[j] == b'-';
            j += 1;
        }
        if j >= b.len() || !b[j].is_ascii_digit() {
            return None; // an error, or a keyword such as `else` (unsupported)
        }
        i = digit_run(b, j, &mut exp, 10)?;
        float = true;
    }
    if i < b.len() && (b[i] | 0x20) == b'j' {
        i += 1;
        if i < b.len() && is_ident(b[i]) {
            return None;
        }
        return Some((Val::Complex, i));
    }
    if i < b.len() && is_ident(b[i]) {
        return None;
    }
    if !float {
        if int[0] == b'0' && int.iter().any(|&c| c != b'0') {
            return None; // leading zeros in decimal integer literals are not permitted
        }
        return Some((Val::Int(BigInt::from_digits(&int, 10)), i));
    }
    let mut s = String::with_capacity(int.len() + frac.len() + exp.len() + 4);
    s.push_str(if int.is_empty() {
        "0"
    } else {
        std::str::from_utf8(&int).ok()?
    });
    s.push('.');
    s.push_str(if frac.is_empty() {
        "0"
    } else {
        std::str::from_utf8(&frac).ok()?
    });
    if !exp.is_empty() {
        s.push('e');
        if exp_neg {
            s.push('-');
        }
        // Exponents beyond any f64 saturate; cap the digits so the parse stays cheap.
        let e = std::str::from_utf8(&exp).ok()?.trim_start_matches('0');
        s.push_str(if e.is_empty() {
            "0"
        } else if e.len() > 6 {
            "999999"
        } else {
            e
        });
    }
    Some((Val::Float(s.parse().ok()?), i))
}

fn lex_string(b: &[u8], start: usize) -> Option<(Vec<u8>, usize)> {
    let q = b[start];
    if start + 2 < b.len() && b[start + 1] == q && b[start + 2] == q {
        let body = start + 3;
        let end = (body..b.len().saturating_sub(2))
            .find(|&k| b[k] == q && b[k + 1] == q && b[k + 2] == q)?;
        return Some((b[body..end].to_vec(), end + 3));
    }
    let end = (start + 1..b.len()).find(|&k| b[k] == q)?;
    Some((b[start + 1..end].to_vec(), end + 1))
}

fn tokenize(b: &[u8]) -> Option<Vec<Tok>> {
    let mut toks = Vec::new();
    let mut level = 0usize;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            b' ' => i += 1,
            b'0'..=b'9' => {
                let (v, j) = lex_number(b, i)?;
                toks.push(Tok::Num(v));
                i = j;
            }
            b'.' if i + 1 < b.len() && b[i + 1].is_ascii_digit() => {
                let (v, j) = lex_number(b, i)?;
                toks.push(Tok::Num(v));
                i = j;
            }
            b'.' if b[i..].starts_with(b"...") => {
                toks.push(Tok::Ellipsis);
                i += 3;
            }
            b'.' => {
                toks.push(Tok::Dot);
                i += 1;
            }
            b'(' => {
                level += 1;
                if level > MAX_PAREN_LEVEL {
                    return None;
                }
                toks.push(Tok::LPar);
                i += 1;
            }
            b')' => {
                level = level.checked_sub(1)?;
                toks.push(Tok::RPar);
                i += 1;
            }
            b'+' => {
                toks.push(Tok::Plus);
                i += 1;
            }
            b'-' => {
                toks.push(Tok::Minus);
                i += 1;
            }
            b'*' => {
                toks.push(Tok::Op(Op::Mul));
                i += 1;
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                toks.push(Tok::Op(Op::FloorDiv));
                i += 2;
            }
            b'/' => {
                toks.push(Tok::Op(Op::Div));
                i += 1;
            }
            b'\'' | b'"' => {
                let (text, j) = lex_string(b, i)?;
                toks.push(Tok::Str { bytes: false, text });
                i = j;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let mut j = i;
                while j < b.len() && is_ident(b[j]) {
                    j += 1;
                }
                let word = std::str::from_utf8(&b[i..j]).ok()?.to_ascii_lowercase();
                let prefix = ["r", "u", "f", "b", "br", "rb", "fr", "rf"].contains(&word.as_str());
                if prefix && j < b.len() && (b[j] == b'\'' || b[j] == b'"') {
                    let (text, k) = lex_string(b, j)?;
                    toks.push(Tok::Str {
                        bytes: word.contains('b'),
                        text,
                    });
                    i = k;
                } else {
                    toks.push(Tok::Name(std::str::from_utf8(&b[i..j]).ok()?.to_string()));
                    i = j;
                }
            }
            _ => return None,
        }
    }
    Some(toks)
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    steps: u64,
}

type Node = Option<(Val, usize)>;

fn deeper(d: usize) -> Option<usize> {
    (d < MAX_AST_DEPTH).then_some(d + 1)
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }

    fn bump(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        self.steps += 1;
        t
    }

    fn expect_rpar(&mut self) -> Option<()> {
        matches!(self.bump()?, Tok::RPar).then_some(())
    }

    /// `sum`; `cost` is CPython's parser stack depth at this point.
    fn expr(&mut self, cost: usize) -> Node {
        let (mut v, mut d) = self.term(cost)?;
        while let Some(op) = match self.peek() {
            Some(Tok::Plus) => Some(Op::Add),
            Some(Tok::Minus) => Some(Op::Sub),
            _ => None,
        } {
            self.bump();
            let (r, rd) = self.term(cost)?;
            v = binop(op, v, r, &mut self.steps)?;
            d = deeper(d.max(rd))?;
        }
        Some((v, d))
    }

    fn term(&mut self, cost: usize) -> Node {
        let (mut v, mut d) = self.factor(cost)?;
        while let Some(Tok::Op(op)) = self.peek() {
            let op = *op;
            self.bump();
            let (r, rd) = self.factor(cost)?;
            v = binop(op, v, r, &mut self.steps)?;
            d = deeper(d.max(rd))?;
        }
        Some((v, d))
    }

    fn factor(&mut self, cost: usize) -> Node {
        let mut signs = Vec::new();
        while let Some(t @ (Tok::Plus | Tok::Minus)) = self.peek() {
            signs.push(matches!(t, Tok::Minus));
            self.bump();
        }
        let (mut v, mut d) = self.primary(cost + signs.len())?;
        for &neg in signs.iter().rev() {
            v = unary(neg, v)?;
            d = deeper(d)?;
        }
        Some((v, d))
    }

    fn primary(&mut self, cost: usize) -> Node {
        let (mut v, mut d) = self.atom(cost)?;
        loop {
            match self.peek() {
                Some(Tok::Dot) => {
                    self.bump();
                    let Some(Tok::Name(name)) = self.bump() else {
                        return None;
                    };
                    if !matches!(self.bump()?, Tok::LPar) {
                        return None; // attribute access without a call: unsupported
                    }
                    let (arg, ad) = if matches!(self.peek(), Some(Tok::RPar)) {
                        (None, 0)
                    } else {
                        let (a, ad) = self.expr(cost + PAREN_COST)?;
                        (Some(a), ad)
                    };
                    self.expect_rpar()?;
                    v = method(v, &name, arg)?;
                    d = deeper(deeper(d)?.max(ad))?;
                }
                Some(Tok::LPar) => return None, // nothing here is callable
                _ => return Some((v, d)),
            }
        }
    }

    fn atom(&mut self, cost: usize) -> Node {
        let leaf = |v: Val| (cost < PARSER_STACK).then_some((v, 1));
        match self.bump()? {
            Tok::Num(v) => leaf(v),
            Tok::Ellipsis => leaf(Val::Ellipsis),
            Tok::Str { bytes, mut text } => {
                while let Some(Tok::Str {
                    bytes: b2,
                    text: t2,
                }) = self.peek()
                {
                    if *b2 != bytes {
                        return None;
                    }
                    text.extend_from_slice(t2);
                    self.bump();
                }
                leaf(if bytes {
                    Val::Bytes(text)
                } else {
                    Val::Str(text)
                })
            }
            Tok::LPar => {
                if matches!(self.peek(), Some(Tok::RPar)) {
                    self.bump();
                    return (cost + PAREN_COST < PARSER_STACK).then_some((Val::Tuple, 1));
                }
                let r = self.expr(cost + PAREN_COST)?;
                self.expect_rpar()?;
                Some(r)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;
