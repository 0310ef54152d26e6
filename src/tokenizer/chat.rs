//! Hugging Face chat templates rendered with minijinja, with the Python-compatible string
//! methods (`strip`, `startswith`, ...) that real templates call.

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

pub(super) fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    let mut env = minijinja::Environment::new();
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
    tmpl.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(|e| TokenizerError::Template(e.to_string()))
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
}
