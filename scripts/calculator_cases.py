#!/usr/bin/env python3
"""Reference results for kiln's calculator tool (src/engine/calculator.rs).

Runs a faithful copy of nanochat's `use_calculator` (nanochat/engine.py, HEAD 92d63d4; the
SIGALRM timeout is left out, nothing here comes near it) on a list of expressions and prints,
as JSON, what nanochat forces into the token stream: `str(result)`, or null where
`use_calculator` returns None.

    python3 scripts/calculator_cases.py > tests/fixtures/calculator_cases.json

Measured with CPython 3.11. The random cases are deterministic (fixed seed).
"""
import json
import random
import sys
import warnings


def eval_with_timeout(formula, max_time=3):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return eval(formula, {"__builtins__": {}}, {})
    except Exception:
        return None


def use_calculator(expr):
    expr = expr.replace(",", "")
    if all([x in "0123456789*+-/.() " for x in expr]):
        if "**" in expr:
            return None
        return eval_with_timeout(expr)
    allowed_chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ "
    if not all([x in allowed_chars for x in expr]):
        return None
    dangerous_patterns = ['__', 'import', 'exec', 'eval', 'compile', 'open', 'file',
                          'input', 'raw_input', 'globals', 'locals', 'vars', 'dir',
                          'getattr', 'setattr', 'delattr', 'hasattr']
    expr_lower = expr.lower()
    if any(pattern in expr_lower for pattern in dangerous_patterns):
        return None
    if '.count(' not in expr:
        return None
    return eval_with_timeout(expr)


def forced(expr):
    r = use_calculator(expr)
    return None if r is None else str(r)


HAND = [
    # nanochat.md §6 examples
    "12*3", "1,000 * 2", "2**10", "07", "1/0", "'strawberry'.count('r')", '"hello".count("l")',
    "len('abc')", "'a'.upper()", "'b' 'c'.count('c')", "7/2", "6/3",
    # precedence, associativity, unary
    "1+2*3", "(1+2)*3", "10-4-3", "100/10/5", "100//7//2", "2*3//4", "7//2*2", "1-2+3",
    "-5", "--5", "---5", "+5", "+-+-5", "- - 5", "2*-3", "2--3", "2- -3", "-(3)", "-(-(2))",
    "-2*-2", "1 + 2", "  1+2", "1+2  ", " ( 1 + 2 ) * ( 3 + 4 ) ", "((((7))))", "(1)+(2)",
    # big ints
    "123456789123456789*987654321987654321", "99999999999999999999+1", "-99999999999999999999-1",
    "123456789012345678901234567890//987654321", "-123456789012345678901234567890//987654321",
    "123456789012345678901234567890/987654321", "10000000000000000000000/3",
    "1" + "0" * 300 + "/3", "1" + "0" * 309 + "/1", "1" + "0" * 308 + "/1", "1" + "0" * 400 + "/1" + "0" * 100,
    "1/" + "1" + "0" * 400, "1" + "0" * 400 + "*1.0", "1" + "0" * 308 + "*1.0",
    "179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497791*1.0",
    "179769313486231580793728971405303415079934132710037826936173778980444968292764750946649017977587207096330286416692887910946555547851940402630657488671505820681908902000708383676273854845817711531764475730270069855571366959622842914819860834936475292719074168444365510704342711559699508093042880177904174497792*1.0",
    "9007199254740993*1.0", "9007199254740995*1.0", "9007199254740993/1", "18014398509481987/2",
    "12345678901234567890123/1000000000000000000000000000000000000000000000000000000000000000",
    # floor division with negative operands, modulo (rejected: % is not in the math alphabet)
    "-7//2", "7//-2", "-7//-2", "7//2", "0//5", "0//-5", "-7%2", "-7%2", "7%-2", "7%2",
    "-7.5//2", "7.5//-2", "-7.5//-2", "7.5//2", "7.5%-2", "-0.0//1", "0.0//-1", "1//0.5",
    "1.0//0.1", "-1.0//0.1", "5//0.3", "-1e-300//1", "0.1//-1", "-0.1//1", "3//1.5",
    "10000000000000000000000000//0.5", "-123456789012345678901234567890//7",
    # float repr
    "0.1+0.2", "1/3", "2/3", "10000000000000000.0", "10000000000000000/1", "1000000000000000.0",
    "9999999999999998.0", "0.0001/1", "0.00001/1", "0.000123/1", "-0.0", "-0.0*1", "0*-1.0",
    "0/-5", "-0/5", "0.0/-5", "1.5*2", "1.5", "1.", ".5", "5.", "00.5", "007.5", "0.",
    "1/7", "22/7", "1/1024", "123456789.123456789", "0.30000000000000004", "2.5+2.5",
    "1" + "0" * 400 + ".0", "-1" + "0" * 400 + ".0", "1" + "0" * 400 + ".0//1",
    "1" + "0" * 400 + ".0-1" + "0" * 400 + ".0", "0." + "0" * 400 + "1", "1/3*3", "0.1*3",
    "100000000000000000000.0", "123e4", "1e16", "4.35/100", "1e-5",
    # errors
    "1/0", "1//0", "1%0", "1.0/0", "1/0.0", "1//0.0", "0/0", "0.0/0.0", "()", "1+", "(1", "1)",
    "1 2", "", " ", "1..2", "1.2.3", "...", "(...)", "-...", "...+1", "()+()", "()*3", "3*()",
    "()*-2", "-()", "()*99999999999999999999", "()*9223372036854775807", "()*9223372036854775808",
    "()*-9223372036854775808", "()*1.5", "()/1", "(1)(2)", "()()", "1(2)", "2* *3", "*()", "(*())",
    "1.__add__", "07.5", "0012", "0012.5", "00", "000", "0 0", "1 .5", "1_000", "1e5", "0x10",
    "1+2j", "1,2", "(1,2)", "1;2", "a", "1 + 2 # x",
    # string path
    "'aaaa'.count('aa')", "'abc'.count('')", "''.count('')", "''.count('a')", "'banana'.count('an')",
    "'Strawberry'.count('R')", "'a b c'.count(' ')", "'1,000'.count('0')", "'a,b'.count(',')",
    '"He said \'hi\'".count("i")', "'x'.count('x').real", "'x'.count('x') ", " 'x'.count('x')",
    "'x' .count('x')", "'x'. count('x')", "'x'.count ('x')", "('x').count('x')", "'x'.count(('x'))",
    "'x''x'.count('x')", "'x' \"x\".count('x')", "'''x'y'''.count('x')", '"""a"b""".count("a")',
    "r'aa'.count('a')", "b'aa'.count(b'a')", "b'aa'.count(97)", "b'aa'.count(0x61)", "b'aa'.count(256)",
    "b'aa'.count('a')", "'aa'.count(b'a')", "u'aa'.count('a')", "f'aa'.count('a')", "Rb'aa'.count(b'a')",
    "'a' b'a'.count('a')", "'aa'.count(1)", "'aa'.count()", "'aa'.count('a' 'a')", "().count(1)",
    "().count(())", "().count('a')", "().count()", "(()).count(0x_1f)", "().count(1e5j)", "'a'.count('a')1",
    "'a'.count('a')('b')", "'a'.count('a').count('a')", "'a'.upper().count('A')", "'A'.lower().count('a')",
    "'aBc'.upper().lower().count('b')", "'a'.count('a') if 1 else 2", "'a'.count(x)", "x.count('a')",
    "'direction'.count('d')", "'profile'.count('f')", "'openai'.count('a')", "'x__y'.count('x')",
    "'.count('", "b'.count('", "\"it's.count(\"", "'.count(' '!'", "'a'.split().count('a')",
    "'a'.count('a'.upper())", "...count('a')", "'a'.count(...)", "'a'.count", "('a'.count)('a')",
    "'abc'.count('b')+1", "'abc'.count('b')*2", "'a'.count('a')\t", "None.count(1)", "True.count(1)",
    "'hello world'.count('o')", "'Mississippi'.count('ss')", "'ab'.count('abc')", "'x' * 3 .count('x')",
    "'a'.count('a') 'b'", "'a'.count('a').bit_length()", "'a'.count('a' 'b' 'c')", "'a'.title().count('A')",
    "'ABC'.casefold().count('a')", "'%d'.count('d')", "'a-b'.count('-')", "'a?'.count('a')",
]


def rand_int(rng):
    k = rng.random()
    if k < 0.4:
        return str(rng.randint(0, 20))
    if k < 0.7:
        return str(rng.randint(0, 10**6))
    if k < 0.9:
        return str(rng.randint(0, 10**rng.randint(6, 60)))
    return "0"


def rand_float(rng):
    k = rng.random()
    a = str(rng.randint(0, 10**rng.randint(0, 8)))
    b = str(rng.randint(0, 10**rng.randint(0, 8)))
    if k < 0.2:
        return a + "."
    if k < 0.4:
        return "." + b
    return a + "." + b


def rand_expr(rng, depth):
    k = rng.random()
    if depth <= 0 or k < 0.3:
        return rand_int(rng) if rng.random() < 0.7 else rand_float(rng)
    if k < 0.4:
        return rng.choice(["-", "+", "--", "- "]) + rand_expr(rng, depth - 1)
    if k < 0.55:
        return "(" + rand_expr(rng, depth - 1) + ")"
    op = rng.choice(["+", "-", "*", "/", "//", " + ", " * ", " // ", " / "])
    return rand_expr(rng, depth - 1) + op + rand_expr(rng, depth - 1)


def rand_str_case(rng):
    alpha = rng.choice(["ab", "abc", "a", "xyz ", "aA"])
    s = "".join(rng.choice(alpha) for _ in range(rng.randint(0, 12)))
    p = "".join(rng.choice(alpha) for _ in range(rng.randint(0, 3)))
    q1 = rng.choice(["'", '"'])
    q2 = rng.choice(["'", '"'])
    return f"{q1}{s}{q1}.count({q2}{p}{q2})"


def main():
    rng = random.Random(20260703)
    cases = list(HAND)
    # float repr: quotients of random ints and floats
    for _ in range(1500):
        a, b = rng.randint(1, 10**rng.randint(1, 25)), rng.randint(1, 10**rng.randint(1, 25))
        cases.append(f"{a}/{b}")
    for _ in range(300):
        cases.append(f"{rand_float(rng)}*{rand_float(rng)}")
    for _ in range(300):
        e = rng.randint(-330, 330)
        if e >= 0:
            cases.append(f"{rng.randint(1, 999)}" + "0" * e + ".0")
        else:
            cases.append("0." + "0" * (-e) + f"{rng.randint(1, 999)}")
    # big-int true division near the float limits
    for _ in range(200):
        a = rng.randint(1, 10**rng.randint(250, 330))
        b = rng.randint(1, 10**rng.randint(1, 330))
        cases.append(f"{a}/{b}")
        cases.append(f"-{b}/{a}")
    for _ in range(3000):
        cases.append(rand_expr(rng, rng.randint(1, 6)))
    for _ in range(600):
        cases.append(rand_str_case(rng))
    # mixed int/float floor division and true division, signs included
    for _ in range(600):
        a = rng.choice([rand_int(rng), rand_float(rng)])
        b = rng.choice([rand_int(rng), rand_float(rng)])
        cases.append(f"{rng.choice(['', '-'])}{a}{rng.choice(['//', '/', '//-', '/-'])}{b}")
    # string path: prefixes, quotes, literal arguments, chained methods
    pre = ["", "r", "u", "f", "b", "B", "rb", "Rb", "bR", "fr", "U", "ub", "x"]
    args = ["'a'", "b'a'", "97", "0x61", "0o141", "0b1100001", "1_0", "1__0", "0x", "1.5", "1e3", "2j", "()", "...",
            "''", "b''", "'a' 'b'", "('a')", "256", "007", "0_0"]
    for _ in range(800):
        q = rng.choice(["'", '"', "'''", '"""'])
        body = "".join(rng.choice("aAb '") for _ in range(rng.randint(0, 6)))
        recv = rng.choice([f"{rng.choice(pre)}{q}{body}{q}", "()", "(())", "...", "1"])
        meth = rng.choice(["", ".upper()", ".lower()", ".upper().lower()"])
        cases.append(f"{recv}{meth}.count({rng.choice(args)})")
    # Python's nesting limits (measured here, CPython 3.11 at a shallow call stack)
    for n in [199, 200, 201]:
        cases.append("(" * n + "1" + ")" * n)
    for n in [100, 1000, 2000, 2900, 3500]:
        cases.append("-" * n + "1")
        cases.append("1+" * n + "1")
    for k, n in [(150, 1700), (150, 1850), (199, 350), (199, 450), (200, 300), (200, 400)]:
        cases.append("(" * k + "-" * n + "1" + ")" * k)
    out = []
    seen = set()
    for c in cases:
        if c in seen:
            continue
        seen.add(c)
        out.append({"expr": c, "expected": forced(c)})
    json.dump(out, sys.stdout, indent=0)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
