"""vLLM's own engine code meets the rows ``stream_delta`` and ``mrope_positions``.

``python killers.py SCENARIO [SCENARIO ...]`` prints one report line per scenario
(``helpers.probes.report``); run in a venv with a real vLLM (0.6.x/0.7.x, V0 engine) and the
shim, like ``driver.py``, whose ``Engine`` (vLLM's ``Scheduler`` with chunked prefill of 32
tokens and prefix caching, the real ``ModelInputForGPUBuilder``) it uses.

- ``stream_delta*``: a streamed request (``RequestOutputKind.DELTA``) whose prompt takes three
  chunks; after every engine step, what ``LLMEngine._process_model_outputs`` does for each
  scheduled group: ``RequestOutputFactory.create`` (with and without the engine's cached
  outputs).  Reported: each step's delta token ids.
- ``mrope_*``: an MRoPE model (Qwen2-VL-style configuration: image tokens, three position
  axes, spatial merge 2) with images in a prompt prefilled in chunks, and a second prompt that
  shares its cached prefix (a full and a partial prefix-cache hit inside chunks).  Each step's
  model input goes through vLLM's ``MRotaryEmbedding.forward`` (the model's rotary layer) and
  is compared with the rotation at the request's true positions, computed here independently
  (the Qwen2-VL rule: text advances by one, an image's tokens take their t/h/w grid indices,
  the text after it starts past the largest position so far).

What it cannot model: the model, the sampler (next tokens are a fixed function of the step),
detokenization, the vision encoder (only the positions it implies).
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

from driver import HEAD_SIZE, HEADS, KV_HEADS, Engine, _fake_xformers  # noqa: E402
from helpers.probes import report  # noqa: E402

IMAGE, VIDEO, START, END = 990, 991, 992, 993
GRID = (1, 4, 8)  # t, h, w of one image; merged 2x2: 1 x 2 x 4 = 8 tokens
MERGE = 2
IMAGE_TOKENS = GRID[0] * (GRID[1] // MERGE) * (GRID[2] // MERGE)


def _text(n, seed):
    return [(seed * 7919 + 31 * i) % 900 for i in range(n)]


def _image():
    return [START] + [IMAGE] * IMAGE_TOKENS + [END]


def _add(eng, request_id, prompt, max_tokens, images=0, delta=False):
    """A request as the engine adds it: one sequence, greedy sampling, multimodal data when
    the prompt has images."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.sequence import Sequence, SequenceGroup

    try:
        from vllm.inputs import token_inputs
        inputs = token_inputs(list(prompt), multi_modal_data={"image": images} if images else None)
    except ImportError:
        inputs = {"prompt_token_ids": list(prompt)}
        if images:
            inputs["multi_modal_data"] = {"image": images}
    seq = Sequence(eng.next_seq_id, inputs, 16)
    eng.next_seq_id += 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA if delta
                            else RequestOutputKind.CUMULATIVE)
    group = SequenceGroup(request_id, [seq], time.time(), params)
    eng.seqs[seq.seq_id] = (seq, max_tokens)
    eng.scheduler.add_seq_group(group)
    return seq, group


def _outputs(groups):
    """What ``_process_model_outputs`` makes of each scheduled group, per release."""
    from vllm.outputs import RequestOutputFactory

    params = inspect.signature(RequestOutputFactory.create).parameters
    out = []
    for group, use_cache in groups:
        if "seq_id_to_seq_group" in params:  # 0.7+
            out.append(RequestOutputFactory.create(group, {}, use_cache=use_cache))
        else:
            out.append(RequestOutputFactory.create(group, use_cache=use_cache))
    return out


def stream_delta(use_cache: bool):
    eng = Engine()
    prompt = _text(80, 1)  # chunks of 32, 32, 16: two steps without a new token
    seq, group = _add(eng, "stream", prompt, 4, delta=True)
    steps = []
    for _ in range(20):
        if eng.finished():
            break
        metas, outputs = eng.schedule()
        eng._advance(metas, outputs)
        for out in _outputs([(s.seq_group, use_cache) for s in outputs.scheduled_seq_groups]):
            if out is None:
                continue
            ids = list(out.outputs[0].token_ids)
            steps.append({"chunks": [m.token_chunk_size for m in metas], "token_ids": ids,
                          "prompt_given": out.prompt_token_ids is not None,
                          "finished": out.finished})
    return {"steps": steps, "output_ids": list(seq.get_output_token_ids()),
            "prompt_len": len(prompt)}


def _true_positions(tokens):
    """The Qwen2-VL position map of ``tokens`` (three axes), and its delta."""
    axes = [[], [], []]
    nxt = 0
    i = 0
    t, h, w = GRID[0], GRID[1] // MERGE, GRID[2] // MERGE
    while i < len(tokens):
        if tokens[i] == IMAGE:
            for ti in range(t):
                for hi in range(h):
                    for wi in range(w):
                        for axis, v in zip(axes, (ti, hi, wi)):
                            axis.append(nxt + v)
            nxt += max(t, h, w)
            i += IMAGE_TOKENS
            continue
        for axis in axes:
            axis.append(nxt)
        nxt += 1
        i += 1
    return axes, nxt - len(tokens)


class _Mapper:
    """The multimodal input mapper: the image grids the vision processor would report."""

    def __call__(self, data, mm_processor_kwargs=None, *args):
        import torch

        return {"image_grid_thw": torch.tensor([list(GRID)] * int(data["image"]))}


def _mrope_engine():
    import torch
    from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding

    eng = Engine()
    cfg = types.SimpleNamespace(image_token_id=IMAGE, video_token_id=VIDEO,
                                vision_start_token_id=START, vision_end_token_id=END,
                                vision_config=types.SimpleNamespace(spatial_merge_size=MERGE),
                                rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    eng.runner.model_is_mrope = True  # 0.6.x reads this, 0.7 the model config's uses_mrope
    eng.runner.multi_modal_input_mapper = _Mapper()
    # 0.7: no merged processor for this model, so the builder calls the mapper
    eng.runner.mm_registry = types.SimpleNamespace(has_processor=lambda model_config: False)
    eng.runner.model_config = types.SimpleNamespace(
        is_encoder_decoder_model=False, is_encoder_decoder=False, enforce_eager=True,
        hf_config=cfg, uses_mrope=True)
    rope = MRotaryEmbedding(HEAD_SIZE, HEAD_SIZE, 4096, 10000, True, torch.float32,
                            mrope_section=[8, 12, 12])
    return eng, rope


def _mrope_steps(eng, rope, request, max_steps=60):
    """Engine steps through the real builder and vLLM's MRotaryEmbedding, each checked:
    whether the positions are the true ones, the rotation's error against the rotation at
    the true positions, or what the rotary layer raised (the step is advanced anyway)."""
    import torch

    g = torch.Generator().manual_seed(5)
    q_tok = torch.randn(1000, HEADS * HEAD_SIZE, generator=g)
    k_tok = torch.randn(1000, KV_HEADS * HEAD_SIZE, generator=g)
    steps = []
    for _ in range(max_steps):
        if eng.finished():
            return steps
        metas, outputs = eng.schedule()
        model_input = eng.build(metas)
        tokens, positions = model_input.input_tokens, model_input.input_positions
        step = {"request": request, "step": eng.step_no, "tokens": int(tokens.shape[0]),
                "positions": list(positions.shape), "query_lens": list(model_input.query_lens),
                "seq_lens": list(model_input.seq_lens)}
        steps.append(step)
        q, k = q_tok[tokens], k_tok[tokens]
        want = _expected(eng, metas, model_input)
        step["positions_ok"] = bool(positions.shape == want.shape and torch.equal(positions, want))
        try:  # the model's rotary layer
            got_q, got_k = rope.forward(positions, q.clone(), k.clone())
        except RuntimeError as exc:
            step["error"] = f"{type(exc).__name__}: {exc}"
        else:
            ref_q, ref_k = rope.forward(want, q.clone(), k.clone())
            step["err"] = float(max((got_q - ref_q).abs().max(), (got_k - ref_k).abs().max()))
        eng._advance(metas, outputs)
    raise RuntimeError(f"requests not finished after {max_steps} steps")


def _expected(eng, metas, model_input):
    """The true positions of this step's tokens: the request's map for prompt tokens, the
    request's delta for generated ones."""
    import torch

    cols = [[], [], []]
    for meta, qlen, slen in zip(metas, model_input.query_lens, model_input.seq_lens):
        for seq_id in meta.seq_data:
            seq = eng.seqs[seq_id][0]
            prompt = list(seq.get_prompt_token_ids())
            full, delta = _true_positions(prompt)
            for idx in range(slen - qlen, slen):
                for axis in range(3):
                    cols[axis].append(full[axis][idx] if idx < len(prompt) else idx + delta)
    return torch.tensor(cols, dtype=torch.long)


def mrope_chunked():
    eng, rope = _mrope_engine()
    prompt = _text(20, 3) + _image() + _text(30, 4) + _image() + _text(30, 5)  # 100 tokens
    _add(eng, "images", prompt, 3, images=2)
    return {"steps": _mrope_steps(eng, rope, "images")}


def mrope_prefix_hit():
    """A first request caches a prefix with two images; a second prompt shares 48 tokens of it
    (three blocks) and goes on: its chunk [0, 32) is a full hit, [32, 64) a partial one."""
    eng, rope = _mrope_engine()
    shared = _text(6, 6) + _image() + _text(12, 7) + _image() + _text(10, 8)  # 48 tokens
    _add(eng, "warm", shared + _text(16, 9), 1, images=2)
    steps = _mrope_steps(eng, rope, "warm")
    _add(eng, "hit", shared + _text(40, 10), 3, images=2)
    return {"steps": steps + _mrope_steps(eng, rope, "hit")}


SCENARIOS = {
    "stream_delta": lambda: stream_delta(use_cache=False),
    "stream_delta_cached": lambda: stream_delta(use_cache=True),
    "mrope_chunked": mrope_chunked,
    "mrope_prefix_hit": mrope_prefix_hit,
}


def main(names) -> None:
    _fake_xformers()
    import vllm_bi100_patch

    for name in names:
        try:
            result = SCENARIOS[name]()
            report(scenario=name, ok=True, status=vllm_bi100_patch.status(), **result)
        except Exception as exc:
            report(scenario=name, ok=False, error=f"{type(exc).__name__}: {exc}",
                   trace=traceback.format_exc()[-3000:], status=vllm_bi100_patch.status())


if __name__ == "__main__":
    main(sys.argv[1:] or list(SCENARIOS))
