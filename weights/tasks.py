"""Synthetic tasks for the small trained checkpoints in weights/ (dev only; plain Python).

Two families of data live here, both generated from a seeded `random.Random`, so a seed gives the
same examples on every machine:

* T5 (`train_tiny_t5.py` -> weights/tiny-t5-dates/): text-to-text pairs with T5-style prefixes.
  - `date: <a date in one of DATE_FORMS>` -> `YYYY-MM-DD`
  - `spell: <integer>` -> English words ("one thousand two hundred thirty-four")
* Transformer-XL (`train_tiny_xl.py` -> weights/tiny-xl-recall/): word sequences that state a key
  early (`KEY k7`) and ask for it segments later (`ASK` -> `k7`), over the word list XL_VOCAB.

Held-out sets are split off *by construction*: `T5Split` sets aside whole calendar dates (in
every surface form) and whole integers, and training samples never draw from them; the XL
held-out sequences come from a different random stream and `train_tiny_xl.py` checks that none of
them occurs in training.
"""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass

# =====================================================================================================
# Dates
# =====================================================================================================
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
MONTH_ABBR = [m[:3] for m in MONTHS]                  # Jan Feb Mar ... (Sep, not Sept)
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
FIRST_DAY, LAST_DAY = datetime.date(1900, 1, 1), datetime.date(2099, 12, 31)


def ordinal(day: int) -> str:
    """1 -> 1st, 2 -> 2nd, 3 -> 3rd, 11 -> 11th, 22 -> 22nd."""
    if 11 <= day % 100 <= 13:
        return f"{day}th"
    return f"{day}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(day % 10, 'th') }"


# Every surface form names the month in words or puts the year first or uses dots, so none is
# ambiguous between day-first and month-first readings. The dotted form is day-first (European).
DATE_FORMS = {
    "month_d_y": lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}",              # March 5, 2021
    "d_month_y": lambda d: f"{d.day} {MONTHS[d.month - 1]} {d.year}",               # 5 March 2021
    "ord_of_month_y": lambda d: f"{ordinal(d.day)} of {MONTHS[d.month - 1]} {d.year}",  # 4th of July 1976
    "month_ord_y": lambda d: f"{MONTHS[d.month - 1]} {ordinal(d.day)}, {d.year}",   # July 4th, 1976
    "abbr_d_y": lambda d: f"{MONTH_ABBR[d.month - 1]} {d.day} {d.year}",            # Mar 5 2021
    "y_slash_m_d": lambda d: f"{d.year}/{d.month:02d}/{d.day:02d}",                 # 2021/03/05
    "d_dot_m_y": lambda d: f"{d.day:02d}.{d.month:02d}.{d.year}",                   # 05.03.2021
    "weekday_month_d_y": lambda d: (f"{WEEKDAYS[d.weekday()]}, {MONTHS[d.month - 1]} {d.day}, "
                                    f"{d.year}"),                                   # Friday, March 5, 2021
    "the_ord_of_month_y": lambda d: f"the {ordinal(d.day)} of {MONTHS[d.month - 1]}, {d.year}",
    "d_abbr_y_dashed": lambda d: f"{d.day}-{MONTH_ABBR[d.month - 1]}-{d.year}",     # 5-Mar-2021
}


def iso(d: datetime.date) -> str:
    return f"{d.year:04d}-{d.month:02d}-{d.day:02d}"


def date_example(d: datetime.date, form: str) -> tuple[str, str]:
    return f"date: {DATE_FORMS[form](d)}", iso(d)


# =====================================================================================================
# Numbers in words
# =====================================================================================================
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
SPELL_MAX = 9999


def spell(n: int) -> str:
    """0 <= n <= 9999 in English words: hyphenated tens, no "and" (1234 -> one thousand two
    hundred thirty-four, 1000 -> one thousand, 90 -> ninety)."""
    if not 0 <= n <= SPELL_MAX:
        raise ValueError(n)
    if n < 20:
        return ONES[n]
    words = []
    if n >= 1000:
        words.append(f"{ONES[n // 1000]} thousand")
        n %= 1000
    if n >= 100:
        words.append(f"{ONES[n // 100]} hundred")
        n %= 100
    if n >= 20:
        words.append(TENS[n // 10] + (f"-{ONES[n % 10]}" if n % 10 else ""))
    elif n > 0 or not words:
        words.append(ONES[n])
    return " ".join(words)


def spell_example(n: int) -> tuple[str, str]:
    return f"spell: {n}", spell(n)


# =====================================================================================================
# The T5 train / held-out split
# =====================================================================================================
QUICKSTART_DATE = datetime.date(1976, 7, 4)   # "date: 4th of July 1976" -> 1976-07-04 (README)


@dataclass
class T5Split:
    """Held-out dates and integers, and a sampler of training pairs that never touches them.

    Held out: `n_dates` calendar dates (always including QUICKSTART_DATE), each in one surface
    form (the forms taken in turn, so every form is tested), and `n_numbers` integers from
    20..9999. 0..19 are always trained: they are the atoms of every spelling and cannot be
    inferred from other numbers.
    """
    seed: int = 0
    n_dates: int = 400
    n_numbers: int = 400

    def __post_init__(self) -> None:
        rng = random.Random(f"heldout-{self.seed}")
        n_days = (LAST_DAY - FIRST_DAY).days + 1
        days = set(rng.sample(range(n_days), self.n_dates - 1))
        days.discard((QUICKSTART_DATE - FIRST_DAY).days)
        while len(days) < self.n_dates - 1:
            days.add(rng.randrange(n_days))
        dates = [QUICKSTART_DATE] + sorted(FIRST_DAY + datetime.timedelta(k) for k in days)
        forms = list(DATE_FORMS)
        self.heldout_dates = dates
        self.heldout_date_pairs = [date_example(QUICKSTART_DATE, "ord_of_month_y")] + [
            date_example(d, forms[i % len(forms)]) for i, d in enumerate(dates[1:])]
        self.heldout_numbers = sorted(rng.sample(range(20, SPELL_MAX + 1), self.n_numbers))
        self.heldout_spell_pairs = [spell_example(n) for n in self.heldout_numbers]
        self._n_days = n_days
        self._held_days = {(d - FIRST_DAY).days for d in dates}
        held = set(self.heldout_numbers)
        self._train_numbers = {
            digits: [n for n in range(lo, hi) if n not in held]
            for digits, (lo, hi) in {1: (0, 10), 2: (10, 100), 3: (100, 1000),
                                     4: (1000, SPELL_MAX + 1)}.items()}

    def heldout(self) -> list[tuple[str, str]]:
        return self.heldout_date_pairs + self.heldout_spell_pairs

    def train_date(self, rng: random.Random) -> tuple[str, str]:
        while True:
            k = rng.randrange(self._n_days)
            if k not in self._held_days:
                break
        return date_example(FIRST_DAY + datetime.timedelta(k), rng.choice(list(DATE_FORMS)))

    def train_spell(self, rng: random.Random) -> tuple[str, str]:
        # Short numbers are rare among 0..9999, so lengths are drawn first: 1-2 digits 15%,
        # 3 digits 25%, 4 digits 60%.
        r = rng.random()
        digits = 1 if r < 0.05 else 2 if r < 0.15 else 3 if r < 0.40 else 4
        return spell_example(rng.choice(self._train_numbers[digits]))

    def train_pair(self, rng: random.Random) -> tuple[str, str]:
        return self.train_date(rng) if rng.random() < 0.5 else self.train_spell(rng)


# =====================================================================================================
# Transformer-XL: recall a key across segments
# =====================================================================================================
N_KEYS, N_FILLER = 16, 32
XL_VOCAB = (["<eos>", "KEY", "ASK"] + [f"k{i}" for i in range(N_KEYS)]
            + [f"f{i}" for i in range(N_FILLER)])
XL_IDS = {w: i for i, w in enumerate(XL_VOCAB)}
KEY_IDS = [XL_IDS[f"k{i}"] for i in range(N_KEYS)]
FILLER_IDS = [XL_IDS[f"f{i}"] for i in range(N_FILLER)]


@dataclass(frozen=True)
class RecallLayout:
    """Where things go in one recall sequence of `n_segments` segments of `seg_len` tokens.

    `KEY k` sits in segment 0, the `ASK` token in segment `ask_segment` (its answer is the token
    after it, in the same segment); everything else is random filler. The key (positions 1 ..
    seg_len - 1) therefore lies (ask_segment - 1) * seg_len + 1 to (ask_segment + 1) * seg_len - 3
    tokens before the question (17..61 for the defaults): out of reach of a model that only
    sees the question's segment.
    """
    seg_len: int = 16
    n_segments: int = 4
    ask_segments: tuple[int, ...] = (2, 3)


def recall_sequence(rng: random.Random, layout: RecallLayout) -> tuple[list[int], int, int]:
    """One sequence of ids; returns (ids, ask_position, key_id). ids[ask_position + 1] == key_id."""
    S = layout.seg_len
    ids = [rng.choice(FILLER_IDS) for _ in range(S * layout.n_segments)]
    key = rng.choice(KEY_IDS)
    at = rng.randrange(0, S - 1)                     # KEY and the key both in segment 0
    ids[at], ids[at + 1] = XL_IDS["KEY"], key
    seg = rng.choice(layout.ask_segments)
    ask = seg * S + rng.randrange(0, S - 1)          # the answer stays in the ASK's segment
    ids[ask], ids[ask + 1] = XL_IDS["ASK"], key
    return ids, ask, key


def words(ids: list[int]) -> str:
    return " ".join(XL_VOCAB[i] for i in ids)
