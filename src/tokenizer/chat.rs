//! Hugging Face chat templates rendered with minijinja, with the Python-compatible string
//! methods (`strip`, `startswith`, ...) that real templates call.
//!
//! A template is a program from the model's files, so its run is bounded: at most
//! [`TEMPLATE_FUEL`] instructions (minijinja's fuel) and [`MAX_RENDERED_BYTES`] of output. A
//! template past either bound is reported as too expensive instead of hanging or exhausting
//! memory.

use serde::Serialize;

use super::{chat_budget, TokenizerError};

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Instructions a template may run per render. SmolLM2's ChatML runs fewer than 50 per message
/// (`a_real_template_uses_little_fuel_and_a_runaway_one_is_stopped`), so this allows
/// conversations of hundreds of thousands of messages, and stops two nested 100,000-step loops
/// within their first 10^7 of 10^10 steps.
pub const TEMPLATE_FUEL: u64 = 10_000_000;

/// Bytes a template may render: far more text than any model's context holds.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

pub(super) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    render_counted(
        template,
        messages,
        add_generation_prompt,
        bos_token,
        eos_token,
    )
    .map(|(text, _)| text)
}

/// Fuel for a template whose longest run of literal text is `raw` bytes: each instruction can
/// write at most that much literal text, so the fuel also bounds the literal output by
/// [`MAX_RENDERED_BYTES`] (values written by `{{ }}` are counted as they are written).
fn fuel_for(raw: usize) -> u64 {
    let by_output = (MAX_RENDERED_BYTES / raw.max(1)) as u64;
    TEMPLATE_FUEL.min(by_output.max(1))
}

/// [`render`], and the fuel (template instructions) it used.
///
/// The template is compiled here rather than by `Environment::add_template` so its operators
/// can be rewritten into size-checked ones ([`chat_budget::rewrite`]).
fn render_counted(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<(String, u64), TokenizerError> {
    use minijinja::machinery::{parse, CodeGenerator, Instruction, Vm, WhitespaceConfig};

    let ast = parse(
        template,
        "chat",
        minijinja::syntax::SyntaxConfig,
        WhitespaceConfig::default(),
    )
    .map_err(|e| TokenizerError::Template(e.to_string()))?;
    let mut generator = CodeGenerator::new("chat", template);
    generator.compile_stmt(&ast);
    let (mut instructions, mut blocks) = generator.finish();
    chat_budget::rewrite(&mut instructions);
    for block in blocks.values_mut() {
        chat_budget::rewrite(block);
    }
    let longest_raw = std::iter::once(&instructions)
        .chain(blocks.values())
        .flat_map(|ins| {
            (0..ins.len()).filter_map(|i| match ins.get(u32::try_from(i).ok()?) {
                Some(Instruction::EmitRaw(s)) => Some(s.len()),
                _ => None,
            })
        })
        .max()
        .unwrap_or(0);
    let fuel = fuel_for(longest_raw);

    let budget = chat_budget::Budget::default();
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(fuel));
    chat_budget::install(
        &mut env,
        &budget,
        minijinja_contrib::pycompat::unknown_method_callback,
    );
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&written);
    env.set_formatter(move |out, state, value| {
        let n = chat_budget::display_len(value)?;
        let total = counter
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed)
            .saturating_add(n);
        if total > MAX_RENDERED_BYTES {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::WriteFailure,
                "output limit",
            ));
        }
        minijinja::escape_formatter(out, state, value)
    });
    let mut text = String::new();
    let rendered = Vm::new(&env).eval(
        &instructions,
        minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        },
        &blocks,
        &mut minijinja::machinery::make_string_output(&mut text),
        minijinja::AutoEscape::None,
    );
    match rendered {
        Ok((_, state)) if text.len() <= MAX_RENDERED_BYTES => {
            let used = state.fuel_levels().map_or(0, |(used, _)| used);
            Ok((text, used))
        }
        Ok(_) => Err(too_long(messages.len())),
        Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
            Err(TokenizerError::Template(format!(
                "too expensive: rendering {} message(s) ran past {fuel} template instructions",
                messages.len()
            )))
        }
        Err(e) if e.kind() == minijinja::ErrorKind::WriteFailure => Err(too_long(messages.len())),
        Err(e) => Err(TokenizerError::Template(e.to_string())),
    }
}

fn too_long(messages: usize) -> TokenizerError {
    TokenizerError::Template(format!(
        "too expensive: rendering {messages} message(s) wrote more than {} MiB",
        MAX_RENDERED_BYTES >> 20
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_with_default_system_prompt() {
        let out = render(CHATML, &[ChatMessage::new("user", "Hi")], true, "", "").unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_and_raise() {
        let t = "{{ messages[0].content.strip() }}{% if messages|length > 1 %}{{ raise_exception('too many') }}{% endif %}";
        assert_eq!(
            render(t, &[ChatMessage::new("user", "  x ")], false, "", "").unwrap(),
            "x"
        );
        let err = render(
            t,
            &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
            false,
            "",
            "",
        )
        .unwrap_err();
        assert!(err.to_string().contains("too many"), "{err}");
    }

    #[test]
    fn a_real_template_uses_little_fuel_and_a_runaway_one_is_stopped() {
        let many: Vec<ChatMessage> = (0..2000)
            .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "hi"))
            .collect();
        let (_, fuel) = render_counted(CHATML, &many, true, "", "").unwrap();
        let per_message = fuel / 2000;
        assert!(per_message < 50, "{fuel} for 2000 messages");
        let t0 = std::time::Instant::now();
        let nested =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let err = render(nested, &[ChatMessage::new("user", "a")], true, "", "").unwrap_err();
        assert!(err.to_string().contains("too expensive"), "{err}");
        assert!(t0.elapsed().as_secs() < 20, "{:?}", t0.elapsed());
        let wide = "{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}";
        let err = render(wide, &[ChatMessage::new("user", "a")], true, "", "").unwrap_err();
        assert!(err.to_string().contains("more than 64 MiB"), "{err}");
    }

    fn refused(template: &str) -> String {
        let t0 = std::time::Instant::now();
        let err = render(template, &[ChatMessage::new("user", "ab\\")], true, "", "")
            .expect_err(template)
            .to_string();
        assert!(
            t0.elapsed().as_secs() < 20,
            "{template}: {:?}",
            t0.elapsed()
        );
        err
    }

    /// Each of these doubles a string with a handful of instructions, so fuel alone lets it ask
    /// for terabytes (the allocation aborts the process); each is stopped at the size limit.
    #[test]
    fn string_doubling_templates_are_stopped_before_they_allocate() {
        let doubling = [
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s * 2 %}{% endfor %}",
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s.replace('b', 'bb') %}{% endfor %}",
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = '-'.join([ns.s, ns.s]) %}{% endfor %}",
            "{% set ns = namespace(s=messages[0].content) %}{% for i in range(64) %}{% set ns.s = ns.s|tojson %}{% endfor %}",
            "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d('ab', 60) }}",
            "{{ 'a\nb'|indent(1000000000000) }}",
            "{{ 'ab' * 100000000 }}",
        ];
        for t in doubling {
            let err = refused(t);
            assert!(err.contains("too expensive"), "{t}: {err}");
        }
        // The straight-line form, no loop: 40 statements of a few bytes each.
        let unrolled = format!(
            "{{% set s = 'ab' %}}{}{{{{ s }}}}",
            "{% set s = s ~ s %}".repeat(40)
        );
        let err = refused(&unrolled);
        assert!(err.contains("too expensive"), "{err}");
    }

    /// The checked operators keep minijinja's meaning for every type: the same template
    /// rendered by minijinja unchanged (its own operators and filters) gives the same text.
    #[test]
    fn checked_operators_keep_their_meaning() {
        let t = "{% set s = 'ab' %}{% set s = s ~ s %}{{ s }}|{{ s + 'c' }}|{{ 1 + 2 }}|{{ 1.5 + 1 }}|{{ [1] + [2] }}|{{ 2 * 3 }}|{{ 'ab' * 2 }}|{{ [0] * 2 }}|{{ 1 ~ none }}|{{ 'x'|replace('x', 'yz') }}|{{ ['a', 'b']|join('-') }}|{{ 'a b'.replace(' ', '_') }}|{{ ','.join(['p', 'q']) }}|{{ 'a\nb'|indent(2) }}|{{ messages[0].content|upper|tojson }}";
        let messages = [ChatMessage::new("user", "hi")];
        let out = render(t, &messages, false, "", "").unwrap();
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        let reference = env
            .render_str(t, minijinja::context! { messages => messages })
            .unwrap();
        assert_eq!(out, reference);
        assert!(out.starts_with("abab|ababc|3|"), "{out}");
        let err = render("{{ 'a' + 1 }}", &[], false, "", "").unwrap_err();
        assert!(err.to_string().contains("+"), "{err}");
    }
}
