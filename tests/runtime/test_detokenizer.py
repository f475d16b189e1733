"""The incremental detokenizer: its text is the tokenizer's decode of the same tokens,
whether it calls the Rust backend directly (plain fast tokenizers) or goes through
transformers (anything that changes decoding)."""
import random

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from compress.runtime.sequence import IncrementalDetokenizer, _decoder


def embedded_tokenizer(repo_root):
    return AutoTokenizer.from_pretrained(str(repo_root / "models" / "pydoc-llama"))


def test_backend_decoder_equals_tokenizer_decode(repo_root, tokenizer):
    for tok in (embedded_tokenizer(repo_root), tokenizer):
        rng = random.Random(0)
        fast = _decoder(tok)
        assert fast.__code__ is not _decoder(object()).__code__  # took the backend path
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))]
            assert fast(ids) == tok.decode(ids, skip_special_tokens=True), ids


def test_incremental_text_is_the_decoded_sequence(repo_root):
    tok = embedded_tokenizer(repo_root)
    prompt = tok("def parse(path):")["input_ids"]
    out = tok("\n    \"\"\"Return the rows of the CSV file at path — or raise ValueError.\"\"\"\n")["input_ids"][1:]
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add(t) for t in out)
    want = tok.decode(prompt[-6:] + out, skip_special_tokens=True)[len(tok.decode(prompt[-6:], skip_special_tokens=True)):]
    assert text == want


def test_tokenizers_that_change_decoding_keep_transformers_decode(repo_root):
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    tok = embedded_tokenizer(repo_root)
    shouting = Shouting(tokenizer_object=tok.backend_tokenizer, clean_up_tokenization_spaces=False)
    ids = tok("return the rows")["input_ids"][1:]
    assert _decoder(shouting)(ids) == shouting.decode(ids, skip_special_tokens=True) == "RETURN THE ROWS"
    tok.clean_up_tokenization_spaces = True  # transformers' clean-up: through transformers too
    assert _decoder(tok)(ids) == tok.decode(ids, skip_special_tokens=True)


def test_a_sequence_cut_inside_a_character_keeps_its_bytes_as_decode_does(repo_root):
    """A length cut (or a stop token) after part of a character's bytes: the text ends as
    ``tokenizer.decode`` ends it (U+FFFD), not without those tokens' text."""
    from compress.runtime import SamplingParams
    from compress.runtime.sequence import Sequence

    tok = embedded_tokenizer(repo_root)
    prompt = tok("x = ")["input_ids"]
    out = tok(" café é", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(out) + 1) if tok.decode(out[:i]).endswith("\ufffd"))
    want = tok.decode(prompt + out[:cut], skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
    for stop_ids, n, reason in (((), cut, "length"), ((7,), cut + 1, "stop")):
        seq = Sequence("r", None, prompt, SamplingParams(max_tokens=n if reason == "length" else 50,
                                                          stop_token_ids=list(stop_ids)), set(), tok)
        for t in out[:cut] + ([7] if reason == "stop" else []):
            seq.append(t)
        assert seq.finish_reason == reason and seq.text == want and seq.text.endswith("\ufffd")
        assert seq.take_delta() == want
