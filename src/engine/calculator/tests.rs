use super::*;
use std::time::{Duration, Instant};

fn calc(s: &str) -> Option<String> {
    use_calculator(s)
}

#[test]
fn spec_examples() {
    let table: &[(&str, Option<&str>)] = &[
        ("12*3", Some("36")),
        ("1,000 * 2", Some("2000")),
        ("2**10", None),
        ("07", None),
        ("1/0", None),
        ("'strawberry'.count('r')", Some("3")),
        ("\"hello\".count(\"l\")", Some("2")),
        ("len('abc')", None),
        ("'a'.upper()", None),
        ("'b' 'c'.count('c')", Some("1")),
        ("7/2", Some("3.5")),
        ("6/3", Some("2.0")),
        ("10000000000000000/1", Some("1e+16")),
        ("-7//2", Some("-4")),
        ("-7.5//2", Some("-4.0")),
        ("-7%2", None),
        ("0.1+0.2", Some("0.30000000000000004")),
        ("'aaaa'.count('aa')", Some("2")),
        ("'abc'.count('')", Some("4")),
        ("()", Some("()")),
        ("...", Some("Ellipsis")),
        ("-0.0", Some("-0.0")),
    ];
    for (e, want) in table {
        assert_eq!(calc(e).as_deref(), *want, "{e:?}");
    }
}

/// Cases whose expected output comes from CPython running nanochat's `use_calculator`
/// (`scripts/calculator_cases.py`).
#[test]
fn python_reference_cases() {
    // Valid Python that this evaluator deliberately does not implement (documented subset).
    let unsupported = [
        "'x'.count('x').real",
        "'a'.split().count('a')",
        "'a'.count('a') if 1 else 2",
        "'a'.count('a').bit_length()",
        "'a'.title().count('A')",
        "'ABC'.casefold().count('a')",
    ];
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/calculator_cases.json"
    );
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(cases.len() > 5000);
    let mut failures = Vec::new();
    let mut diverged = Vec::new();
    let mut over_cap = 0;
    for c in &cases {
        let expr = c["expr"].as_str().unwrap();
        let want = c["expected"].as_str();
        let got = calc(expr);
        if expr.replace(',', "").len() > MAX_EXPR_LEN {
            assert_eq!(got, None, "over the length cap");
            over_cap += 1;
            continue;
        }
        if unsupported.contains(&expr) {
            assert!(want.is_some() && got.is_none(), "{expr:?}");
            diverged.push(expr);
            continue;
        }
        if got.as_deref() != want {
            failures.push(format!(
                "{:?}: want {want:?}, got {got:?}",
                &expr[..expr.len().min(120)]
            ));
        }
    }
    assert_eq!(diverged.len(), unsupported.len());
    assert!(over_cap < 20, "{over_cap}");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn python_limits() {
    let nest = |n: usize, inner: &str| format!("{}{inner}{}", "(".repeat(n), ")".repeat(n));
    assert_eq!(calc(&nest(200, "1")).as_deref(), Some("1"));
    assert_eq!(calc(&nest(201, "1")), None);
    assert_eq!(
        calc(&format!("{}1", "-".repeat(2990))).as_deref(),
        Some("1")
    );
    assert_eq!(calc(&format!("{}1", "-".repeat(2991))), None);
    assert_eq!(
        calc(&format!("{}1", "1+".repeat(1000))).as_deref(),
        Some("1001")
    );
    // Binary chains count too: 1000 left-nested additions under 1991 unary operators.
    assert_eq!(
        calc(&format!("{}({}1)", "-".repeat(1989), "1+".repeat(1000))).as_deref(),
        Some("-1001")
    );
    assert_eq!(
        calc(&format!("{}({}1)", "-".repeat(1991), "1+".repeat(1000))),
        None
    );
    // Parser stack: 28 per parenthesis plus one per unary operator must stay below 5976.
    assert_eq!(
        calc(&nest(150, &format!("{}1", "-".repeat(1775)))).as_deref(),
        Some("-1")
    );
    assert_eq!(calc(&nest(150, &format!("{}1", "-".repeat(1776)))), None);
    assert_eq!(
        calc(&format!("{}{}", "-".repeat(375), nest(200, "1"))).as_deref(),
        Some("-1")
    );
    assert_eq!(
        calc(&format!("{}{}", "-".repeat(376), nest(200, "1"))),
        None
    );
    assert_eq!(calc(&nest(190, &format!("{}()", "+".repeat(627)))), None); // TypeError
    assert_eq!(calc(&format!("{}1", " ".repeat(MAX_EXPR_LEN))), None);
    assert_eq!(
        calc(&format!("{}1", ",".repeat(100_000))).as_deref(),
        Some("1")
    );
}

#[test]
fn bigint_against_u128() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let big = |v: u128, neg: bool| {
        BigInt::new(
            neg,
            trim(vec![
                v as u32,
                (v >> 32) as u32,
                (v >> 64) as u32,
                (v >> 96) as u32,
            ]),
        )
    };
    for _ in 0..200_000 {
        let a = rng.next() as u128 >> (rng.next() % 64)
            | ((rng.next() as u128) << 64 >> (rng.next() % 128));
        let b = (rng.next() as u128 >> (rng.next() % 64)) << (rng.next() % 60);
        let (x, y) = (big(a, false), big(b, false));
        if let Some(sum) = a.checked_add(b) {
            assert_eq!(x.add(&y), big(sum, false));
            assert_eq!(big(sum, false).add(&y.clone().neg()), x);
            assert_eq!(y.add(&big(sum, true)), big(a, true));
        }
        if let Some(p) = a.checked_mul(b & 0xffff_ffff_ffff) {
            assert_eq!(x.mul(&big(b & 0xffff_ffff_ffff, true)), big(p, true));
        }
        if let (Some(wq), Some(wr)) = (a.checked_div(b), a.checked_rem(b)) {
            let (q, r) = divmod_mag(&x.mag, &y.mag);
            assert_eq!(
                (BigInt::new(false, q), BigInt::new(false, r)),
                (big(wq, false), big(wr, false)),
                "{a} {b}"
            );
            if a < 1 << 126 && b < 1 << 126 {
                for (sa, sb) in [(false, true), (true, false), (true, true)] {
                    let num = if sa { -(a as i128) } else { a as i128 };
                    let den = if sb { -(b as i128) } else { b as i128 };
                    let (q, r) = (num / den, num % den);
                    let fl = if r != 0 && (r < 0) != (den < 0) {
                        q - 1
                    } else {
                        q
                    };
                    assert_eq!(
                        big(a, sa).floordiv(&big(b, sb)).unwrap(),
                        big(fl.unsigned_abs(), fl < 0),
                        "{num} // {den}"
                    );
                }
            }
        }
        assert_eq!(x.to_f64(), Some(a as f64), "{a}");
        if a < 1 << 53 && b < 1 << 53 && b != 0 {
            assert_eq!(x.truediv(&y), Some(a as f64 / b as f64));
        }
        assert_eq!(x.to_decimal(), a.to_string());
    }
}

#[test]
fn float_repr_round_trips() {
    let mut rng = Rng(7);
    for _ in 0..200_000 {
        let x = f64::from_bits(rng.next());
        if !x.is_finite() {
            continue;
        }
        let s = float_repr(x);
        assert_eq!(s.parse::<f64>().unwrap().to_bits(), x.to_bits(), "{s}");
    }
    assert_eq!(float_repr(1e16), "1e+16");
    assert_eq!(float_repr(1e-5), "1e-05");
    assert_eq!(float_repr(1.5e300), "1.5e+300");
    assert_eq!(float_repr(5e-324), "5e-324");
    assert_eq!(float_repr(123456.0), "123456.0");
}

/// xorshift64*; deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick(&mut self, s: &[u8]) -> u8 {
        s[self.below(s.len())]
    }
}

fn grammar_expr(rng: &mut Rng, depth: usize, out: &mut String) {
    match if depth == 0 {
        rng.below(3)
    } else {
        rng.below(9)
    } {
        0 => {
            let cap = if rng.below(20) == 0 { 400 } else { 6 };
            for _ in 0..1 + rng.below(cap) {
                out.push(rng.pick(b"0123456789") as char);
            }
        }
        1 => {
            out.push_str(&rng.below(1000).to_string());
            out.push('.');
            out.push_str(&rng.below(1000).to_string());
        }
        2 => out.push_str(
            [
                "()",
                "...",
                "'ab'.count('a')",
                "b'aa'.count(97)",
                "0x1f",
                "''",
            ][rng.below(6)],
        ),
        3 | 4 => {
            grammar_expr(rng, depth - 1, out);
            out.push_str([" + ", "-", "*", "/", "//", " // ", "%", "**"][rng.below(8)]);
            grammar_expr(rng, depth - 1, out);
        }
        5 => {
            for _ in 0..1 + rng.below(4) {
                out.push(rng.pick(b"+- ") as char);
            }
            grammar_expr(rng, depth - 1, out);
        }
        6 | 7 => {
            out.push('(');
            grammar_expr(rng, depth - 1, out);
            out.push(')');
        }
        _ => {
            out.push('\'');
            for _ in 0..rng.below(8) {
                out.push(rng.pick(b"ab c") as char);
            }
            out.push_str("'.count('");
            out.push(rng.pick(b"abc") as char);
            out.push_str("')");
        }
    }
}

/// At least 200k inputs from the filters' alphabets: nothing panics, and the work stays bounded.
#[test]
fn fuzz_never_panics_and_stays_bounded() {
    const MATH: &[u8] = b"0123456789*+-/.() ";
    const STR: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCXYZ0123456789'\"()._ ";
    let mut rng = Rng(0x5eed);
    let mut max_steps = 0u64;
    let mut slowest = Duration::ZERO;
    let mut some = 0usize;
    let mut n = 0usize;
    let mut check = |s: &str, n: &mut usize| {
        let t = Instant::now();
        let (out, steps) = evaluate(s);
        slowest = slowest.max(t.elapsed());
        max_steps = max_steps.max(steps);
        some += out.is_some() as usize;
        *n += 1;
    };
    for i in 0..210_000 {
        let mut s = String::new();
        match i % 6 {
            0 => (0..rng.below(24)).for_each(|_| s.push(rng.pick(MATH) as char)),
            1 => (0..rng.below(32)).for_each(|_| s.push(rng.pick(STR) as char)),
            2 => {
                (0..rng.below(12)).for_each(|_| s.push(rng.pick(STR) as char));
                s.push_str(".count(");
                (0..rng.below(12)).for_each(|_| s.push(rng.pick(STR) as char));
            }
            _ => {
                let depth = 1 + rng.below(7);
                grammar_expr(&mut rng, depth, &mut s)
            }
        }
        check(&s, &mut n);
    }
    // Adversarial shapes: deep nesting, long chains, long literals, big products and quotients.
    let digits = |rng: &mut Rng, k: usize| {
        (0..k)
            .map(|_| rng.pick(b"123456789") as char)
            .collect::<String>()
    };
    let mut special = vec![
        format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000)),
        format!("{}1{}", "(".repeat(200), ")".repeat(200)),
        format!("{}1", "-".repeat(4095)),
        format!("{}1", "1+".repeat(2047)),
        format!("{}()", "(".repeat(10_000)),
        format!("{}'a'.count('a')", "(".repeat(10_000)),
        "9".repeat(4096),
        format!("{}.5", "9".repeat(4000)),
        format!("0.{}1", "0".repeat(4000)),
        format!("1/{}", "7".repeat(4000)),
        format!("{}/3", "7".repeat(4000)),
        format!("{}//7", "7".repeat(4000)),
        format!("{}*1.0", "7".repeat(4000)),
        format!("'{}'.count('aa')", "a".repeat(4000)),
        format!("'{}'.count('')", "a".repeat(4000)),
        "1".repeat(1 << 20),
    ];
    for k in [1, 10, 100, 1000] {
        let a = digits(&mut rng, 2000 / k.clamp(1, 1000));
        special.push(vec![a.clone(); k.min(2000 / a.len().max(1))].join("*"));
        special.push(format!(
            "{}//{}",
            digits(&mut rng, 4000 / k),
            digits(&mut rng, 2000 / k)
        ));
        special.push(format!(
            "{}/{}",
            digits(&mut rng, 2000 / k),
            digits(&mut rng, 2000 / k)
        ));
        special.push(format!(
            "{}/-{}",
            digits(&mut rng, 100 / k.min(100)),
            digits(&mut rng, 4000 / k)
        ));
    }
    special.push(vec!["99999999"; 455].join("*"));
    special.push(format!(
        "{}{}",
        vec!["9999999"; 500].join("*"),
        "//7".repeat(40)
    ));
    for s in &special {
        check(s, &mut n);
    }
    assert!(n >= 200_000);
    assert!(some > 10_000, "{some}");
    assert!(max_steps < 5_000_000, "{max_steps}");
    assert!(slowest < Duration::from_millis(500), "{slowest:?}");
}
