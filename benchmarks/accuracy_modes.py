"""How close each weight format and compute mode stays to float32, on the shipped models.

    python benchmarks/accuracy_modes.py [--modes float32,int8,int8/int8,int4,int4/int8]
                                        [--int4-group 64,128] [--json OUT]
                                        [--attention own,bfloat16,int8,float32,int8-8bit]

A mode is `dtype` or `dtype/compute` (`minfer.load(..., dtype=, compute=)`). For each:
- weights/tiny-t5-dates: the share of its 800 held-out prompts whose greedy output equals
  float32's (and the share that is right);
- weights/tiny-xl-recall: the share of its 500 held-out rows whose predicted key (argmax at ASK,
  memory carried across segments) equals float32's (and the share that is right);
- weights/tiny-t5-dates' logits on its first 200 held-out prompts, teacher-forced with float32's
  outputs: the mean over prompts of the largest error relative to the prompt's largest logit
  (a continuous measure where the shares above saturate);
- the parity fixtures weights/t5/*: the largest logit error against Hugging Face's float32
  reference, relative to the largest logit (float32 itself is ~1e-5). These are random models of
  24-32 channels (one int4 group per row, each activation row rounded as a whole): the worst
  case for quantisation, not a prediction for trained models.
No timing, no torch: runs anywhere the test suite does. `--int4-group` repeats the int4 modes
with other group sizes (io/formats.py's INT4_GROUP: what the choice was measured with).
`--attention` runs the modes whose encoder attention rounds its products' inputs (compute="int8",
"bfloat16": backend.ROUNDED_ATTENTION) with each attention named: "own" (the mode's: int8 or
bfloat16 products), "bfloat16" (ops.rounded_distance_attention), "int8"
(ops.quantised_distance_attention), "float32" (ops.float_distance_attention), "int8-8bit" (an
emulation of int8 products whose softmax weights keep 8 bits, not 7: `int8_attention`): what
each attention costs in accuracy, the linear products' rounding left as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
T5_DIR, XL_DIR, FIXTURES = (ROOT / "weights" / "tiny-t5-dates", ROOT / "weights" / "tiny-xl-recall",
                            ROOT / "weights" / "t5")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def xl_predictions(model, rows: list[dict]) -> list[str]:
    """Each row's argmax word at its ASK position, the memory carried across segments."""
    S = model.config.tgt_len
    got = {}
    for seg in sorted({r["ask_position"] // S for r in rows}):
        group = [r for r in rows if r["ask_position"] // S == seg]
        ids = np.array([r["ids"][:(seg + 1) * S] for r in group])
        memory = model.new_memory(len(group))
        try:
            for k in range(seg + 1):
                log_probs, memory = model.forward(ids[:, k * S:(k + 1) * S], memory)
        finally:
            memory.release()
        pred = log_probs[np.arange(len(group)), [r["ask_position"] % S for r in group]].argmax(-1)
        got.update({id(r): model.tokenizer.id_to_token(int(p)) for p, r in zip(pred, group)})
    return [got[id(r)] for r in rows]


def parse_mode(mode: str) -> tuple[str, str | None]:
    dtype, _, compute = mode.partition("/")
    return dtype, compute or None


def int8_attention(levels: int):
    """ops.quantised_distance_attention's function emulated in float64 with `levels` for the
    softmax weights: q and k quantised per (position, head) row and v per (head, column) over
    the positions, symmetric (absmax / 127, nearest); the softmax in float; its weights as
    round(levels * e), e = exp(s - max s) <= 1, divided by their sum (levels 127: what the
    kernel's signed operand holds; 255 would need the weights as the unsigned one)."""
    from minfer import ops

    def quantised(a, axis):
        scale = np.abs(a).max(axis=axis, keepdims=True) / 127
        return np.rint(a / np.where(scale > 0, scale, 1)) * scale

    def attend(xp, qkv, bias, scores, ctx, stats=None):
        T = qkv.shape[1]
        q, k, v = (qkv[:, :, j].transpose(0, 2, 1, 3).astype(np.float64) for j in range(3))
        q, k, v = quantised(q, -1), quantised(k, -1), quantised(v, -2)      # (B, H, T, D)
        s = q @ k.swapaxes(-1, -2) + ops.toeplitz_view(np, bias.table.astype(np.float64), T)
        s += bias.key_mask[:, None, None, :]
        e = np.exp(s - s.max(-1, keepdims=True))
        w = np.rint(levels * e)
        ctx[...] = (w @ v / w.sum(-1, keepdims=True)).transpose(0, 2, 1, 3)
    return attend


OWN_ATTENTION = {}            # backend.ROUNDED_ATTENTION as minfer has it
REAL_QUANTISED = []           # ops.quantised_distance_attention as minfer has it


def use_attention(attention: str) -> None:
    """Every rounding mode's encoder attention becomes `attention` ("own": each mode's): the
    kind backend.ROUNDED_ATTENTION gives it (its scratch planned and its function chosen by
    that), and for "int8-8bit" the int8 kind's function emulated with 8-bit weights."""
    from minfer import backend, ops
    OWN_ATTENTION.update(OWN_ATTENTION or backend.ROUNDED_ATTENTION)
    REAL_QUANTISED[:] = REAL_QUANTISED or [ops.quantised_distance_attention]
    for compute, kind in OWN_ATTENTION.items():
        backend.ROUNDED_ATTENTION[compute] = (kind if attention == "own" else
                                              "int8" if attention == "int8-8bit" else attention)
    ops.quantised_distance_attention = (int8_attention(255) if attention == "int8-8bit" else
                                        REAL_QUANTISED[0])


def measure(mode: str, reference: dict, attention: str = "own") -> dict:
    import minfer
    use_attention(attention)
    dtype, compute = parse_mode(mode)
    t5 = minfer.load(T5_DIR, dtype=dtype, compute=compute)
    prompts = [r["prompt"] for r in reference["t5_rows"]]
    out = t5.generate(prompts)
    drift = []
    for (ids, dec), want in zip(reference["t5_forced"], reference["t5_logits"]):
        got = t5.forward(ids, dec)
        drift.append(float(np.abs(got - want).max() / np.abs(want).max()))
    xl = minfer.load(XL_DIR, dtype=dtype, compute=compute)
    keys = xl_predictions(xl, reference["xl_rows"])
    logits = {}
    for case in sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.npz").is_file()):
        with np.load(FIXTURES / case / "reference.npz") as z:
            ref = {k: z[k] for k in ("input_ids", "attention_mask", "decoder_input_ids", "logits")}
        got = minfer.load(FIXTURES / case, dtype=dtype, compute=compute).forward(
            ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
        logits[case] = float(np.abs(got.astype(np.float64) - ref["logits"]).max()
                             / np.abs(ref["logits"]).max())
    t5_rows, xl_rows = reference["t5_rows"], reference["xl_rows"]
    return {"mode": mode, "encoder_attention": attention, "weights": t5.backend.weight_format,
            "compute": t5.backend.compute,
            "t5_prompts": len(out),
            "t5_same_as_float32": float(np.mean([a == b for a, b in zip(out, reference["t5"])])),
            "t5_right": float(np.mean([a == r["target"] for a, r in zip(out, t5_rows)])),
            "t5_logit_error": float(np.mean(drift)),
            "xl_rows": len(keys),
            "xl_same_as_float32": float(np.mean([a == b for a, b in zip(keys, reference["xl"])])),
            "xl_right": float(np.mean([a == r["answer"] for a, r in zip(keys, xl_rows)])),
            "logit_error": logits}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="float32,int8,int8/int8,int4,int4/int8")
    p.add_argument("--int4-group", default="", help="also run the int4 modes with these groups")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--attention", default="own",
                   help="encoder attentions of the rounding modes: own, bfloat16, int8, float32, "
                        "int8-8bit (emulated)")
    args = p.parse_args()
    import minfer
    from minfer.backend import ROUNDED_ATTENTION
    from minfer.io import formats
    t5_rows = read_jsonl(T5_DIR / "heldout.jsonl")
    xl_ref = minfer.load(XL_DIR)
    xl_rows = read_jsonl(XL_DIR / "heldout.jsonl")
    for r in xl_rows:
        r["ids"] = xl_ref.tokenizer.encode(r["text"], add_eos=False)
    t5_ref = minfer.load(T5_DIR)
    reference = {"t5_rows": t5_rows, "xl_rows": xl_rows,
                 "t5": t5_ref.generate([r["prompt"] for r in t5_rows]),
                 "xl": xl_predictions(xl_ref, xl_rows), "t5_forced": [], "t5_logits": []}
    for r in t5_rows[:200]:
        ids = [t5_ref.tokenizer.encode(r["prompt"])]
        dec = [t5_ref.generate(ids, max_new_tokens=24)[0][:-1]]  # start token .. last before eos
        reference["t5_forced"].append((ids, dec))
        reference["t5_logits"].append(t5_ref.forward(ids, dec))
    runs = [(m, None, "own") for m in args.modes.split(",") if m]
    for group in (int(g) for g in args.int4_group.split(",") if g):
        runs += [(m, group, "own") for m in args.modes.split(",") if m.startswith("int4")]
    rounding = [m for m in args.modes.split(",") if parse_mode(m)[1] in ROUNDED_ATTENTION]
    runs += [(m, None, a) for a in args.attention.split(",") if a != "own" for m in rounding]
    results = []
    default_group = formats.INT4_GROUP
    for mode, group, attention in runs:
        formats.INT4_GROUP = group or default_group
        r = measure(mode, reference, attention)
        use_attention("own")
        r["int4_group"] = formats.INT4_GROUP if r["weights"] == "int4" else None
        results.append(r)
        worst = max(r["logit_error"].values())
        print(f"{mode:<10} {'group ' + str(r['int4_group']) if r['int4_group'] else '':<9} "
              f"{'' if attention == 'own' else 'attention ' + attention:<20}"
              f"t5 {r['t5_same_as_float32']:.2%} as float32 ({r['t5_right']:.2%} right, "
              f"logits {r['t5_logit_error']:.1e})  "
              f"xl {r['xl_same_as_float32']:.2%} as float32 ({r['xl_right']:.2%} right)  "
              f"logits max rel. error {worst:.2e}", flush=True)
    formats.INT4_GROUP = default_group
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
