from pagedllm.engine.detokenizer import IncrementalDetokenizer


def stream(tokenizer, prompt_ids, output_ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = []
    for i, t in enumerate(output_ids):
        stop = detok.add_token(t)
        deltas.append(detok.take_delta(finished=stop is not None or i == len(output_ids) - 1))
        if stop is not None:
            return deltas, detok, stop
    return deltas, detok, None


def test_deltas_concatenate_to_the_full_decode(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    text = " Numbers like 12345, émigrés, naïve cafés and 😀 emojis appear."
    prompt = tok("Tell me:").input_ids
    ids = tok(text).input_ids
    deltas, detok, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert "\ufffd" not in "".join(deltas)
    assert deltas[0].startswith(" ")  # the leading space survives


def test_multibyte_characters_are_never_split(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok("😀").input_ids
    assert len(ids) > 1  # the emoji spans several byte tokens in this tiny vocabulary
    deltas, _, _ = stream(tok, [], ids)
    assert [d for d in deltas if d] == ["😀"]


def test_a_sequence_ending_mid_character_ends_as_the_full_decode(tiny_llama):
    """Cut by max_tokens inside a character: the text ends with U+FFFD, as the tokenizer's decode of the tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok(" ok 😀").input_ids[:-1]
    deltas, detok, _ = stream(tok, [], ids)
    assert "".join(deltas) == detok.text == tok.decode(ids) and detok.text.endswith("\ufffd")


def test_stop_string_cuts_the_text_and_is_not_streamed(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok("Paris is the capital of France; Berlin").input_ids
    deltas, detok, stop = stream(tok, [], ids, stop=["; Ber", "xyz"])
    assert stop == "; Ber"
    assert detok.text == "".join(deltas) == "Paris is the capital of France"
    deltas, detok, stop = stream(tok, [], ids, stop=["capital"], include_stop_str_in_output=True)
    assert detok.text == "".join(deltas) == "Paris is the capital"


def test_earliest_stop_string_wins(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok("The quick brown fox").input_ids
    _, detok, stop = stream(tok, [], ids, stop=["fox", "quick"])
    assert detok.text == "The " and stop == "quick"


def test_the_direct_decode_gives_the_text_transformers_gives(tiny_llama):
    from transformers import AutoTokenizer

    from pagedllm.engine.detokenizer import _decoder

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok(" Hi there , naïve 😀 .").input_ids + [tok.eos_token_id]
    expected = {skip: tok.decode(ids, skip_special_tokens=skip) for skip in (True, False)}
    wrapper = tok.decode
    tok.decode = None  # the direct path must not need transformers' decode
    for skip in (True, False):
        assert _decoder(tok, skip)(ids) == expected[skip]
    tok.decode = wrapper
    tok.clean_up_tokenization_spaces = True  # transformers then tidies " ," and " ." itself: it must stay in the loop
    assert _decoder(tok, True)(ids) == tok.decode(ids, skip_special_tokens=True) == " Hi there, naïve 😀."
