"""Split a compute-only IR program's ops into MoE parts (no torch needed).

A stop-gap for tests and the GPU smoke script until schedc's own ``--moe`` lowering (issue 10)
is on main: the same orders, written from its documentation.
"""

from __future__ import annotations

import re


def split_moe(ir_text: str) -> str:
    """Splits every F, B, BW of a compute-only IR program into the four MoE parts, in the
    order of schedc's ``--moe`` lowering: a plain forward attn, dispatch, mlp, combine; a
    backward the reverse; an overlapped pair in the order of DeepSeek-V3's Figure 4
    (B.combine F.attn F.dispatch B.mlp B.dispatch F.mlp F.combine B.attn); W whole."""
    fwd, bwd = ["attn", "dispatch", "mlp", "combine"], ["combine", "mlp", "dispatch", "attn"]
    op = re.compile(r"(F|BW|B|W)\((\d+),(\d+)\)")

    def plain(tok: str) -> list[str]:
        m = op.fullmatch(tok)
        if m is None or m.group(1) == "W":
            return [tok]
        return [f"{tok}.{p}" for p in (fwd if m.group(1) == "F" else bwd)]

    out_lines = []
    for line in ir_text.splitlines():
        if not line.startswith("rank "):
            out_lines.append(line)
            continue
        head, body = line.split(":", 1)
        toks = []
        for tok in body.split():
            if "&" in tok:
                f, b = tok.split("&")
                mf, mb_ = op.fullmatch(f), op.fullmatch(b)
                if (mf.group(2), mf.group(3)) == (mb_.group(2), mb_.group(3)):
                    toks += plain(f) + plain(b)
                else:
                    toks += [f"{b}.combine", f"{f}.attn", f"{f}.dispatch", f"{b}.mlp",
                             f"{b}.dispatch", f"{f}.mlp", f"{f}.combine", f"{b}.attn"]
            else:
                toks += plain(tok)
        out_lines.append(f"{head}: {' '.join(toks)}")
    return "\n".join(out_lines) + "\n"
