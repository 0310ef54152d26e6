//! Hugging Face chat templates rendered with minijinja, with the Python-compatible string
//! methods (`strip`, `startswith`, ...) that real templates call.
//!
//! A template is a program from the model's files, so its run is bounded: at most
//! [`TEMPLATE_FUEL`] instructions (minijinja's fuel) and [`MAX_RENDERED_BYTES`] of output. A
//! template past either bound is reported as too expensive instead of hanging or exhausting
//! memory.

use serde::Serialize;

use super::TokenizerError;

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

/// Collects rendered text, failing once it passes [`MAX_RENDERED_BYTES`].
struct Bounded(Vec<u8>);

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len().saturating_add(buf.len()) > MAX_RENDERED_BYTES {
            return Err(std::io::Error::other("output limit"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

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

/// [`render`], and the fuel (template instructions) it used.
fn render_counted(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<(String, u64), TokenizerError> {
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| TokenizerError::Template(e.to_string()))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| TokenizerError::Template(e.to_string()))?;
    let mut out = Bounded(Vec::new());
    let rendered = tmpl.render_captured_to(
        minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        },
        &mut out,
    );
    match rendered {
        Ok(captured) => {
            let fuel = captured.state().fuel_levels().map_or(0, |(used, _)| used);
            let text = String::from_utf8(out.0)
                .map_err(|e| TokenizerError::Template(format!("rendered invalid UTF-8: {e}")))?;
            Ok((text, fuel))
        }
        Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
            Err(TokenizerError::Template(format!(
                "too expensive: rendering {} message(s) ran past {TEMPLATE_FUEL} template \
                 instructions",
                messages.len()
            )))
        }
        Err(e) if e.kind() == minijinja::ErrorKind::WriteFailure => {
            Err(TokenizerError::Template(format!(
                "too expensive: rendering {} message(s) wrote more than {} MiB",
                messages.len(),
                MAX_RENDERED_BYTES >> 20
            )))
        }
        Err(e) => Err(TokenizerError::Template(e.to_string())),
    }
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
}
