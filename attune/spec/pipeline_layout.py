"""Megatron-LM's explicit pipeline layout (``--pipeline-model-parallel-layout``) and the embedding / loss
accounting of the even split (``--account-for-embedding-in-pipeline-split``,
``--account-for-loss-in-pipeline-split``).

A layout string lists the virtual pipeline stages in order, separated by ``|``: ``E`` the input embedding,
``t`` one transformer (decoder) layer, ``L`` the output layer and loss. ``X*N`` repeats one symbol and
``(...)*N`` a group, so ``Et*15|(t*16|)*6t*15L`` is Llama-3.1-405B's 126 layers on PP 8 with the
embedding and the loss each standing in for one layer. Virtual stage ``i`` sits on pipeline rank
``i % PP`` as its chunk ``i // PP`` (Megatron's interleaved order), so a string of ``PP x VPP`` stages
also sets uneven virtual chunks.

Sources: reference megatron-memory-and-performance.md section 2.3, and megatron-core 0.16.1 as installed
here (not the 1dcf0daf slime pins; the same feature): ``transformer/pipeline_parallel_layer_layout.py``
``parse_str_to_list`` (commas are cosmetic, ``(...)*N`` and ``X*N`` unrolled, symbols E, t, L, m),
``__init__`` (stage count divisible by PP, VPP = stages / PP, virtual stage ``v * PP + r`` on rank ``r``),
``validate_layer_layout`` (first symbol E, last L, each exactly once, ``t`` count = num_layers);
``transformer_config.py`` ``__post_init__`` (the layout excludes the first/last counts and the account-for
flags, a given VPP must equal the detected one; account-for excludes the first/last counts and needs
layers + E + L divisible by PP, and the per-rank count by VPP); ``transformer_block.py``
``get_num_layers_to_build`` (account-for: one layer fewer on the first / last virtual stage). ``m``
(multi-token-prediction layers) is refused: attune models no MTP.
"""

from __future__ import annotations

from attune.errors import LayoutError

SYMBOLS = {"E": "input embedding", "t": "transformer layer", "L": "output layer and loss"}
"""What each layout symbol stands for."""
_MAX_EXPANDED = 100_000  # characters of an expanded string; guards against "(t*1000)*1000"-style input


def _expand(text: str, pos: int, depth: int) -> tuple[str, int]:
    """Expand ``text[pos:]`` up to a closing parenthesis (depth > 0) or the end; returns (string, next pos)."""
    out: list[str] = []
    while pos < len(text):
        c = text[pos]
        if c == ")":
            if depth == 0:
                raise LayoutError(f"pipeline layout {text!r}: unmatched ')' at position {pos}")
            return "".join(out), pos + 1
        if c == "(":
            unit, pos = _expand(text, pos + 1, depth + 1)
            if pos > len(text) or text[pos - 1] != ")":
                raise LayoutError(f"pipeline layout {text!r}: unmatched '('")
        elif c in SYMBOLS or c == "|":
            unit, pos = c, pos + 1
        elif c.isspace() or c == ",":  # commas are cosmetic (megatron-core parse_str_to_list)
            pos += 1
            continue
        else:
            raise LayoutError(f"pipeline layout {text!r}: symbol {c!r} at position {pos}; allowed: "
                              f"E (embedding), t (transformer layer), L (loss), | (stage break), X*N, (...)*N")
        if pos < len(text) and text[pos] == "*":
            j = pos + 1
            while j < len(text) and text[j].isdigit():
                j += 1
            if j == pos + 1:
                raise LayoutError(f"pipeline layout {text!r}: '*' at position {pos} needs a repeat count")
            unit, pos = unit * int(text[pos + 1:j]), j
        out.append(unit)
        if sum(map(len, out)) > _MAX_EXPANDED:
            raise LayoutError(f"pipeline layout {text!r}: expands past {_MAX_EXPANDED:,} symbols")
    if depth > 0:
        raise LayoutError(f"pipeline layout {text!r}: unmatched '('")
    return "".join(out), pos


def expand(text: str) -> tuple[str, ...]:
    """The virtual stages of a layout string, repetitions expanded (``"Et*2|tL"`` -> ``("Ett", "tL")``)."""
    if not isinstance(text, str) or not text.strip():
        raise LayoutError("pipeline layout must be a non-empty string of E, t, L and |")
    flat, _ = _expand(text, 0, 0)
    return tuple(flat.split("|"))


def check_layout_string(text: str, pp: int, vpp: int, num_layers: int) -> list[str]:
    """Every Megatron rule the layout string breaks for PP x VPP stages and ``num_layers`` layers."""
    try:
        stages = expand(text)
    except LayoutError as e:
        return [str(e)]
    e: list[str] = []
    if len(stages) != pp * vpp:
        e.append(f"pipeline layout {text!r} has {len(stages)} stage(s); PP {pp} x VPP {vpp} needs {pp * vpp}")
    n_t = sum(s.count("t") for s in stages)
    if n_t != num_layers:
        e.append(f"pipeline layout {text!r} places {n_t} transformer layers; the model has {num_layers}")
    flat = "|".join(stages)
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        e.append(f"pipeline layout {text!r}: exactly one E, at the start of the first stage")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        e.append(f"pipeline layout {text!r}: exactly one L, at the end of the last stage")
    return e


def layout_stage_counts(text: str, pp: int, vpp: int, num_layers: int) -> list[int]:
    """Transformer layers per virtual stage (length PP x VPP, virtual-stage order) of a valid string."""
    errs = check_layout_string(text, pp, vpp, num_layers)
    if errs:
        raise LayoutError("; ".join(errs))
    return [s.count("t") for s in expand(text)]


def accounted_stage_counts(num_layers: int, pp: int, vpp: int, embedding: bool, loss: bool) -> list[int]:
    """Layers per virtual stage of the even split with the embedding and / or the loss counted as a layer.

    Megatron (``get_num_layers_to_build``): (layers + E + L) / (PP x VPP) per virtual stage, the first
    virtual stage one fewer with the embedding, the last one fewer with the loss; the sum must divide.
    """
    stages = pp * vpp
    total = num_layers + int(embedding) + int(loss)
    if total % stages:
        what = " + ".join(["layers"] + (["embedding"] if embedding else []) + (["loss"] if loss else []))
        raise LayoutError(f"{what} = {total} must divide evenly over PP x VPP = {stages} virtual stages "
                          f"(--account-for-embedding/loss-in-pipeline-split)")
    per = total // stages
    counts = [per] * stages
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    if min(counts) < 0:
        raise LayoutError(f"{num_layers} layers are too few for {stages} virtual stages with the embedding/loss accounted")
    return counts


def layout_string(counts: list[int]) -> str:
    """A layout string for these transformer layers per virtual stage (``E`` first, ``L`` last), runs of
    equal middle stages folded into ``(t*N|)*K``: ``[15, 16, 16, 15]`` -> ``Et*15|(t*16|)*2t*15L``."""
    if not counts:
        raise LayoutError("a pipeline layout needs at least one stage")

    def body(n: int) -> str:
        return f"t*{n}" if n > 1 else "t" * n

    if len(counts) == 1:
        return f"E{body(counts[0])}L"
    parts = [f"E{body(counts[0])}|"]
    mid = counts[1:-1]
    i = 0
    while i < len(mid):
        j = i
        while j < len(mid) and mid[j] == mid[i]:
            j += 1
        run = j - i
        parts.append(f"({body(mid[i])}|)*{run}" if run > 1 else f"{body(mid[i])}|")
        i = j
    parts.append(f"{body(counts[-1])}L")
    return "".join(parts)


def pattern_counts(num_layers: int, pp: int, shift_first: int, shift_last: int) -> list[int] | None:
    """Per-stage layers (PP > 2, no VPP): the even split with ``shift_first`` / ``shift_last`` layers moved
    off the first / last stage and spread over the middle stages, the earlier middle stages taking the
    remainder. None when the pattern does not apply (PP < 3 or a stage would be empty)."""
    if pp < 3:
        return None
    base, rem = divmod(num_layers, pp)
    counts = [base + (1 if r < rem else 0) for r in range(pp)]
    counts[0] -= shift_first
    counts[-1] -= shift_last
    moved = shift_first + shift_last
    n_mid = pp - 2
    add, extra = divmod(moved, n_mid)
    for k in range(n_mid):
        counts[1 + k] += add + (1 if k < extra else 0)
    if min(counts) < 1:
        return None
    return counts
