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
