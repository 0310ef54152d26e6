//! Bounds on the strings a chat template builds while it renders.
//!
//! minijinja's fuel counts instructions, not bytes: `{% set s = s ~ s %}` doubles a string with
//! a handful of instructions, so thirty of them ask for gigabytes and the allocation aborts the
//! process. The operators and filters that build strings are therefore routed through checks
//! that size the result *before* it is allocated (or, for filters whose output is a small
//! multiple of their input, right after) against two limits: [`MAX_VALUE_BYTES`] for any one
//! value and [`MAX_BUILT_BYTES`] for everything one render builds. A template past either is
//! refused as too expensive.
//!
//! The operators cannot be hooked through minijinja's public interface, so the template's
//! compiled instructions are rewritten one for one: `~`, `+` and `*` become calls of the filters
//! registered here (same stack effect, so no jump target moves).

use std::fmt::{self, Write as _};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use minijinja::machinery::{Instruction, Instructions};
use minijinja::value::{Rest, Value};
use minijinja::{Environment, Error, ErrorKind, State};

/// Largest string one operation of a template may build. A prompt this long is millions of
/// tokens, past any model's context; a message longer than this cannot be rendered.
pub const MAX_VALUE_BYTES: usize = 16 << 20;

/// Bytes all string-building operations of one render may build together (each result
/// counted when it is made, so this also bounds what is alive at once).
pub const MAX_BUILT_BYTES: usize = 256 << 20;

/// Filter names the rewritten operators call.
const CONCAT: &str = "__kiln_concat";
const ADD: &str = "__kiln_add";
const MUL: &str = "__kiln_mul";

/// Built-in filters whose result is a new string: wrapped so the result is counted. Their
/// output is at most a few times their input (escaping, case mapping, JSON), except those
/// [`estimate`] sizes before they run.
const STRING_FILTERS: [&str; 15] = [
    "escape",
    "e",
    "upper",
    "lower",
    "title",
    "capitalize",
    "replace",
    "join",
    "string",
    "indent",
    "pprint",
    "format",
    "tojson",
    "trim",
    "default",
];

/// What one render has built so far.
#[derive(Clone, Default)]
pub(super) struct Budget(Arc<AtomicUsize>);

fn too_expensive(what: String) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("too expensive: {what}"),
    )
}

impl Budget {
    /// Counts `bytes` about to be built, refusing past either limit.
    fn charge(&self, bytes: usize) -> Result<(), Error> {
        if bytes > MAX_VALUE_BYTES {
            return Err(too_expensive(format!(
                "a string of {bytes} bytes would pass the limit of {} MiB for one value",
                MAX_VALUE_BYTES >> 20
            )));
        }
        let total = self
            .0
            .fetch_add(bytes, Ordering::Relaxed)
            .saturating_add(bytes);
        if total > MAX_BUILT_BYTES {
            return Err(too_expensive(format!(
                "the template built more than {} MiB of strings",
                MAX_BUILT_BYTES >> 20
            )));
        }
        Ok(())
    }

    /// Counts a value just made (strings only; other values are built lazily or small).
    fn charge_value(&self, v: &Value) -> Result<(), Error> {
        match v.as_str() {
            Some(s) => self.charge(s.len()),
            None => Ok(()),
        }
    }
}

/// A `fmt::Write` that stops at [`MAX_VALUE_BYTES`], so displaying a value (a lazily repeated
/// list can display as terabytes) never allocates past it.
struct Capped(String);

impl fmt::Write for Capped {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.0.len().saturating_add(s.len()) > MAX_VALUE_BYTES {
            return Err(fmt::Error);
        }
        self.0.push_str(s);
        Ok(())
    }
}

/// `value` as text, refused if it would be longer than [`MAX_VALUE_BYTES`].
fn display_capped(v: &Value) -> Result<String, Error> {
    if let Some(s) = v.as_str() {
        return Ok(s.to_string());
    }
    let mut out = Capped(String::new());
    write!(out, "{v}").map_err(|_| {
        too_expensive(format!(
            "a value displays as more than {} MiB",
            MAX_VALUE_BYTES >> 20
        ))
    })?;
    Ok(out.0)
}

/// Length of `value` as text, without building text longer than the limit.
pub(super) fn display_len(v: &Value) -> Result<usize, Error> {
    match v.as_str() {
        Some(s) => Ok(s.len()),
        None => display_capped(v).map(|s| s.len()),
    }
}

/// `a ~ b`: minijinja's string concatenation (`format!("{a}{b}")`), sized first.
fn concat(budget: &Budget, a: &Value, b: &Value) -> Result<Value, Error> {
    let len = display_len(a)?.saturating_add(display_len(b)?);
    budget.charge(len)?;
    let mut s = String::with_capacity(len);
    write!(s, "{a}{b}").map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))?;
    Ok(Value::from(s))
}

/// An environment with no limits, only to evaluate one operator on values already checked
/// (minijinja's arithmetic is not public; its expressions are).
fn plain_env() -> &'static Environment<'static> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    ENV.get_or_init(Environment::new)
}

fn binop(expr: &'static str, a: Value, b: Value) -> Result<Value, Error> {
    plain_env()
        .compile_expression(expr)?
        .eval(minijinja::context! { a => a, b => b })
}

/// `a + b`: two strings concatenate (sized first); anything else is minijinja's own `+`
/// (numbers, and lists, which it joins lazily).
fn add(budget: &Budget, a: Value, b: Value) -> Result<Value, Error> {
    if a.as_str().is_some() && b.as_str().is_some() {
        return concat(budget, &a, &b);
    }
    binop("a + b", a, b)
}

/// `a * b`: a string repeated is sized first; anything else is minijinja's own `*`.
fn mul(budget: &Budget, a: Value, b: Value) -> Result<Value, Error> {
    let repeat = match (a.as_str(), b.as_str()) {
        (Some(s), None) => Some((s.len(), &b)),
        (None, Some(s)) => Some((s.len(), &a)),
        _ => None,
    };
    if let Some((len, n)) = repeat {
        if let Ok(n) = usize::try_from(n.clone()) {
            budget.charge(len.saturating_mul(n))?;
        }
    }
    let rv = binop("a * b", a, b)?;
    Ok(rv)
}

/// Occurrences `replace` would substitute (Python's `str.replace`: an empty pattern matches
/// between every character and at both ends).
fn matches(s: &str, from: &str) -> usize {
    if from.is_empty() {
        s.chars().count().saturating_add(1)
    } else {
        s.matches(from).count()
    }
}

fn arg_str(args: &[Value], i: usize) -> Option<&str> {
    args.get(i).and_then(|v| v.as_str())
}

/// Size of what a filter or method whose output is not bounded by a multiple of its input
/// would build: `replace` (by a longer string), `join`, `indent`. `None` for the others.
fn estimate(name: &str, args: &[Value]) -> Result<Option<usize>, Error> {
    let Some(input) = args.first() else {
        return Ok(None);
    };
    Ok(match name {
        "replace" => match (arg_str(args, 1), arg_str(args, 2)) {
            (Some(from), Some(to)) => {
                let s = display_capped(input)?;
                Some(
                    s.len()
                        .saturating_add(matches(&s, from).saturating_mul(to.len())),
                )
            }
            _ => None,
        },
        "join" => {
            let sep = args.get(1).map(display_len).transpose()?.unwrap_or(0);
            let mut total = 0usize;
            if let Ok(items) = input.try_iter() {
                for item in items {
                    total = total
                        .saturating_add(display_len(&item)?)
                        .saturating_add(sep);
                    if total > MAX_VALUE_BYTES {
                        break;
                    }
                }
            }
            Some(total)
        }
        "indent" => {
            let width = args.get(1).map_or(Ok(0), |w| {
                usize::try_from(w.clone())
                    .or_else(|_| display_len(w))
                    .map_err(|e| too_expensive(e.to_string()))
            })?;
            let s = display_capped(input)?;
            let lines = s.lines().count().saturating_add(1);
            Some(s.len().saturating_add(lines.saturating_mul(width)))
        }
        _ => None,
    })
}

/// Rewrites `~`, `+` and `*` in `instructions` into calls of the checked filters registered by
/// [`install`]. Each takes two values and leaves one, like the operator it replaces.
pub(super) fn rewrite(instructions: &mut Instructions<'_>) {
    for i in 0..instructions.len() {
        let Ok(i) = u32::try_from(i) else { break };
        if let Some(ins) = instructions.get_mut(i) {
            let name = match ins {
                Instruction::StringConcat => CONCAT,
                Instruction::Add => ADD,
                Instruction::Mul => MUL,
                _ => continue,
            };
            // `!0` is minijinja's "no cache slot": the filter is looked up by name each time.
            *ins = Instruction::ApplyFilter(name, Some(2), !0);
        }
    }
}

/// Registers the checked operators, wraps the string-building filters of `env`, and wraps
/// `methods` (the callback for Python string methods) the same way; all charge `budget`.
pub(super) fn install(
    env: &mut Environment<'_>,
    budget: &Budget,
    methods: fn(&State, &Value, &str, &[Value]) -> Result<Value, Error>,
) {
    let b = budget.clone();
    env.add_filter(CONCAT, move |a: Value, c: Value| concat(&b, &a, &c));
    let b = budget.clone();
    env.add_filter(ADD, move |a: Value, c: Value| add(&b, a, c));
    let b = budget.clone();
    env.add_filter(MUL, move |a: Value, c: Value| mul(&b, a, c));
    for name in STRING_FILTERS {
        let Some(builtin) = builtin_filter(name) else {
            continue;
        };
        let b = budget.clone();
        env.add_filter(name, move |state: &State, args: Rest<Value>| {
            if let Some(n) = estimate(name, &args)? {
                b.charge(n)?;
            }
            let rv = builtin.call(state, &args)?;
            b.charge_value(&rv)?;
            Ok(rv)
        });
    }
    let b = budget.clone();
    env.set_unknown_method_callback(move |state, value, method, args| {
        let mut all = Vec::with_capacity(args.len() + 1);
        all.push(value.clone());
        all.extend_from_slice(args);
        // `sep.join(items)` builds from its argument, not from the string it is called on.
        let sized = match method {
            "join" => match args.first() {
                Some(items) => estimate("join", &[items.clone(), value.clone()])?,
                None => None,
            },
            _ => estimate(method, &all)?,
        };
        if let Some(n) = sized {
            b.charge(n)?;
        }
        let rv = methods(state, value, method, args)?;
        b.charge_value(&rv)?;
        Ok(rv)
    });
}

/// minijinja's own filter `name`, as a callable value.
fn builtin_filter(name: &str) -> Option<Value> {
    use minijinja::filters as f;
    Some(match name {
        "escape" | "e" => Value::from_function(f::escape),
        "upper" => Value::from_function(f::upper),
        "lower" => Value::from_function(f::lower),
        "title" => Value::from_function(f::title),
        "capitalize" => Value::from_function(f::capitalize),
        "replace" => Value::from_function(f::replace),
        "join" => Value::from_function(f::join),
        "string" => Value::from_function(f::string),
        "indent" => Value::from_function(f::indent),
        "pprint" => Value::from_function(f::pprint),
        "format" => Value::from_function(f::format),
        "tojson" => Value::from_function(f::tojson),
        "trim" => Value::from_function(f::trim),
        "default" => Value::from_function(f::default),
        _ => return None,
    })
}
