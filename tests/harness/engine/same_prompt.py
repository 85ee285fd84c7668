"""The same prompt twice through vLLM's engine: uncached, then with a prefix-cache hit.

Run as ``python same_prompt.py [driver options] SCENARIO ...`` (the driver's options: head
size, layers, dtype, compute mode).  Each scenario submits a prompt (``first``) interleaved
with another request, runs it to the end, then submits the same prompt again (``again``) with
two others: vLLM's scheduler gives ``again`` the prefix-cache hit of ``first``'s full blocks,
so the two requests compute the same (token, position) rows in different slicings:

- ``chunked_N``: chunked prefill, a token budget of ``driver.CHUNK`` per step shared with the
  other requests (chunk boundaries off the block grid, a full-hit chunk recomputing only its
  last token): vLLM gives every prompt chunk its block table, so both requests' rows come
  from ``forward_prefix`` with different contexts;
- ``whole_N``: chunked prefill off (whole prompts, CoreX 3.2.3's default below 32K tokens):
  ``first`` and its batch mate have no context and take the backend's prompt attention
  (``_run_memory_efficient_xformers_forward``), ``again`` its prefix-cache hit through
  ``forward_prefix``: the same rows from the two paths.

``compare`` puts every attention output both requests computed at the same (layer, position)
side by side, bit for bit (``torch.equal``), with the path each came from; the report
(``same_prompt`` key) holds the counts, the differing rows (first 12) and the paths.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import driver  # noqa: E402

#: Prompt lengths: shorter than a chunk and not block-aligned; block-aligned over two chunks;
#: not aligned, over three chunks; not aligned, over five chunks.
LENGTHS = (24, 64, 75, 130)
#: Whether another prompt comes before the first request (its first chunk is then 28 tokens:
#: off the chunk and block grids) or after it (its first chunk fills the token budget).
MATE_FIRST = {24: True, 64: False, 75: True, 130: False}


def compare(eng, a: str = "first", b: str = "again") -> dict:
    """Every (layer, position) both requests computed: bit-identical or not, and by which
    paths."""
    import torch

    mine = {(layer, pos): v for (req, layer, pos), v in eng.rows.items() if req == a}
    theirs = {(layer, pos): v for (req, layer, pos), v in eng.rows.items() if req == b}
    both = sorted(set(mine) & set(theirs))
    paths: Counter = Counter()
    differ = []
    for key in both:
        (x, path_a), (y, path_b) = mine[key], theirs[key]
        pair = f"{path_a} | {path_b}"
        paths[pair] += 1
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            differ.append({"layer": key[0], "position": key[1], "max_abs_diff": diff,
                           "paths": pair})
    return {"compared": len(both), "differ": len(differ), "rows": differ[:12],
            "paths": dict(paths), "paths_differ": dict(Counter(d["paths"] for d in differ)),
            "first_positions": len({p for _, p in mine}),
            "again_positions": sorted({p for _, p in theirs}),
            "layers": sorted({layer for layer, _ in both})}


def _counts():
    import vllm_bi100_patch

    return vllm_bi100_patch.status()["counts"]


def same_prompt(length: int, chunked: bool):
    before = _counts()
    eng = driver.Engine(chunked=chunked)
    prompt = driver._prompt(length, 21)
    # The first request shares its steps with another prompt of 4 tokens, then its decodes;
    # neither has context in the first step, so the batch's first chunks take the prompt
    # kernel (a batch mate with context would send them to forward_prefix).
    if MATE_FIRST[length]:
        eng.add("mate_1", driver._prompt(4, 22), 6)
    eng.add("first", prompt, 1)
    if not MATE_FIRST[length]:
        eng.add("mate_1", driver._prompt(4, 22), 6)
    eng.run()
    # Again, with the prefix-cache hit of its full blocks, scheduled first, with two others.
    eng.add("again", prompt, 1)
    eng.add("mate_2", driver._prompt(21, 23), 3)
    eng.add("mate_3", driver._prompt(57, 24), 2)
    eng.run()
    eng.extra["same_prompt"] = dict(compare(eng), length=length, chunked=chunked)
    eng.extra["counts"] = {k: v - before.get(k, 0) for k, v in _counts().items()}  # this one
    return eng


SCENARIOS = {f"{name}_{n}": (lambda n=n, c=chunked: same_prompt(n, c))
             for name, chunked in (("chunked", True), ("whole", False)) for n in LENGTHS}


if __name__ == "__main__":
    driver.main(sys.argv[1:], SCENARIOS)
