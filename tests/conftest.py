from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
T5_FIXTURES = ROOT / "weights" / "t5"
T5_CASES = sorted(p.name for p in T5_FIXTURES.glob("*") if (p / "reference.npz").is_file())


def load_reference(case: str) -> dict[str, np.ndarray]:
    with np.load(T5_FIXTURES / case / "reference.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def rel_err(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def trim_hf_ids(row, pad: int = 0, eos: int = 1) -> list[int]:
    """HF pads finished rows; minfer returns each row up to and including its eos."""
    row = [int(t) for t in row]
    out = row[:1]
    for t in row[1:]:
        out.append(t)
        if t == eos:
            break
    return out


@pytest.fixture(scope="session")
def t5_models():
    import minfer
    cache = {}

    def get(case: str):
        if case not in cache:
            cache[case] = minfer.load(T5_FIXTURES / case)
        return cache[case]
    return get
