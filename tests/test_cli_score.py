"""`minfer score`: a text the vocabulary mostly lacks is warned about, and the progress bar redraws
at a bounded rate, not once per segment (issue 30, item 16)."""
import contextlib
import io
import json
import time

import pytest

from test_cli import XL_BIN
from test_fuzz_inputs import run_cli

pytestmark = pytest.mark.skipif(not (XL_BIN / "pytorch_model.bin").is_file(),
                                reason="no XL .bin fixture")


@pytest.fixture(scope="module")
def xl():
    import minfer
    return minfer.load(XL_BIN)


def known_words(model, n):
    """Words of the model's vocabulary (not <unk>, <eos> or other <...> symbols)."""
    words = []
    for i in range(model.tokenizer.vocab_size):
        word = model.tokenizer.decode([i]).strip()
        if word and " " not in word and not word.startswith("<") and \
                model.tokenizer.encode(word, add_eos=False) == [i]:
            words.append(word)
        if len(words) == n:
            return words
    raise AssertionError("the fixture's vocabulary has too few words")


def score(path, *args):
    return run_cli(["score", "-m", str(XL_BIN), str(path), *args])


def test_a_text_of_unknown_words_is_warned_about_with_the_fraction(tmp_path, xl):
    from minfer_cli.score import UNKNOWN_WARNING
    words = known_words(xl, 6)
    made_up = ["zorblax", "quinterph", "vlorn", "smeek"]
    text = "".join(" ".join(words[:2] + made_up) + "\n" for _ in range(5))
    path = tmp_path / "text.txt"
    path.write_text(text)
    code, out, err = score(path, "--json")
    assert code == 0, err
    got = json.loads(out)
    want = xl.score(text)                              # the API's reading of the same text
    assert got["tokens"] == want["tokens"] and abs(got["perplexity"] - want["perplexity"]) < 1e-6 * want["perplexity"]
    unk = xl.tokenizer.unk_id
    ids = [t for line in text.splitlines() for t in xl.tokenizer.encode(line, add_eos=True)]
    assert got["unknown_tokens"] == sum(t == unk for t in ids[1:]) == 20
    fraction = 20 / got["tokens"]
    assert fraction > UNKNOWN_WARNING
    assert err == (f"minfer: warning: 20 of the {got['tokens']} scored tokens ({fraction:.0%}) are "
                   "<unk>, words the vocabulary lacks: the perplexity says little about this "
                   "text\n")
    # known words only: no warning, and the plain output says how many were unknown
    path.write_text(" ".join(words) + "\n")
    code, out, err = score(path)
    assert code == 0 and err == "" and "unknown tokens  0\n" in out


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_bar_redraws_at_a_bounded_rate(tmp_path, xl):
    from minfer_cli.main import main
    from minfer_cli.score import PROGRESS_SECONDS
    words = known_words(xl, 8)
    path = tmp_path / "text.txt"
    path.write_text((" ".join(words) + "\n") * 40)
    err, out = Terminal(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        main(["score", "-m", str(XL_BIN), str(path), "--segment-len", "2"])
    elapsed = time.perf_counter() - start
    segments = 40 * 9 // 2
    redraws = err.getvalue().count("\r")
    assert "scoring" in err.getvalue() and "perplexity" in out.getvalue()
    # one redraw per PROGRESS_SECONDS at most (and the first and last), not one per segment
    assert 0 < redraws <= elapsed / PROGRESS_SECONDS + 3 < segments, (redraws, elapsed)
