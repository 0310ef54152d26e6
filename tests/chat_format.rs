//! nanochat's conversation rendering (spec §7) on a tokenizer carrying nanochat's nine special
//! tokens; expected layouts are written out from the spec.

mod common;

use common::{fixtures, nanochat_tokenizer};
use kiln::tokenizer::nanochat::{
    render_conversation, render_for_completion, Content, Message, NanochatTokens, Part,
};

#[test]
fn conversation_ids_and_training_mask_follow_the_spec() {
    let tok = nanochat_tokenizer();
    let s = NanochatTokens::of(&tok).unwrap();
    assert_eq!((s.bos, s.output_end), (400, 408));
    let e = |t: &str| tok.encode_ordinary(t).unwrap();
    let conv = vec![
        Message::text("system", "Be brief."),
        Message::text("user", "What is 1+1?"),
        Message {
            role: "assistant".into(),
            content: Content::Parts(vec![
                Part::Text("Let me check.".into()),
                Part::Python("1+1".into()),
                Part::PythonOutput("2".into()),
                Part::Text("It is 2.".into()),
            ]),
        },
        Message::text("user", "Thanks"),
        Message::text("assistant", "Sure."),
    ];
    let (ids, mask) = render_conversation(&tok, &conv, 10_000).unwrap();
    let mut want: Vec<(Vec<u32>, u8)> = vec![
        (vec![s.bos], 0),
        (vec![s.user_start], 0),
        (e("Be brief.\n\nWhat is 1+1?"), 0),
        (vec![s.user_end], 0),
        (vec![s.assistant_start], 0),
        (e("Let me check."), 1),
        (vec![s.python_start], 1),
        (e("1+1"), 1),
        (vec![s.python_end], 1),
        (vec![s.output_start], 0),
        (e("2"), 0),
        (vec![s.output_end], 0),
        (e("It is 2."), 1),
        (vec![s.assistant_end], 1),
        (vec![s.user_start], 0),
        (e("Thanks"), 0),
        (vec![s.user_end], 0),
        (vec![s.assistant_start], 0),
        (e("Sure."), 1),
        (vec![s.assistant_end], 1),
    ];
    let want_ids: Vec<u32> = want.iter().flat_map(|(i, _)| i.clone()).collect();
    let want_mask: Vec<u8> = want
        .iter_mut()
        .flat_map(|(i, m)| std::iter::repeat_n(*m, i.len()))
        .collect();
    assert_eq!(ids, want_ids);
    assert_eq!(mask, want_mask);

    let (short, m) = render_conversation(&tok, &conv, 7).unwrap();
    assert_eq!((short.as_slice(), m.len()), (&want_ids[..7], 7));

    let prompt = render_for_completion(&tok, &conv).unwrap();
    let cut = want_ids.len() - e("Sure.").len() - 2;
    let mut expected = want_ids[..cut].to_vec();
    expected.push(s.assistant_start);
    assert_eq!(prompt, expected);
}

#[test]
fn special_token_text_in_messages_is_ordinary_text() {
    let tok = nanochat_tokenizer();
    let ids = tok.encode_ordinary("<|bos|> hi").unwrap();
    assert!(!ids.contains(&400), "{ids:?}");
    assert_eq!(tok.encode("<|bos|>").unwrap(), vec![400]);
    let (ids, _) =
        render_conversation(&tok, &[Message::text("user", "<|assistant_end|>")], 100).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 404).count(), 0);
}

#[test]
fn malformed_conversations_are_rejected() {
    let tok = nanochat_tokenizer();
    let err = render_conversation(&tok, &[Message::text("assistant", "hi")], 100).unwrap_err();
    assert!(err.to_string().contains("alternate"), "{err}");
    let err = render_conversation(
        &tok,
        &[Message::text("user", "a"), Message::text("user", "b")],
        100,
    )
    .unwrap_err();
    assert!(err.to_string().contains("message 1"), "{err}");
    assert!(render_conversation(&tok, &[], 100).is_err());
    let plain = kiln::model::Model::load(fixtures().join("llama_tied")).unwrap();
    let err = render_for_completion(&plain.tokenizer, &[Message::text("user", "x")]).unwrap_err();
    assert!(err.to_string().contains("<|bos|>"), "{err}");
}
