"""KV block moves: swapped out and back in bit-identical, copy-on-write, bounded chunks, errors."""

from __future__ import annotations

import pytest
import torch

from vllm_bi100_patch.attention.kernels import blocks


def _cache(num_blocks, dtype, seed, width=2 * 16 * 64):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:  # an fp8 cache: arbitrary bytes, NaN patterns included
        return torch.randint(0, 256, (2, num_blocks, width), generator=g, dtype=torch.uint8)
    return torch.randn(2, num_blocks, width, generator=g).to(dtype)


def _bits(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("chunk_bytes", [blocks.CHUNK_BYTES, 1, 3000])
def test_swap_out_and_back_in_is_bit_identical(dtype, chunk_bytes):
    gpu = _cache(12, dtype, 0)
    original = gpu.clone()
    host = torch.zeros(2, 9, gpu.shape[2], dtype=dtype)
    out_map = torch.tensor([[3, 0], [7, 5], [11, 8], [0, 2]])
    blocks.swap_blocks(gpu, host, out_map, chunk_bytes=chunk_bytes)
    for s, d in out_map.tolist():
        assert torch.equal(_bits(host[:, d]), _bits(original[:, s]))
    untouched = [b for b in range(9) if b not in (0, 5, 8, 2)]
    assert torch.count_nonzero(_bits(host[:, untouched])) == 0
    gpu[:, [3, 7, 11, 0]] = 0  # the blocks were freed and reused while swapped out
    in_map = torch.tensor([[0, 4], [5, 6], [8, 9], [2, 10]])  # back in, at new places
    blocks.swap_blocks(host, gpu, in_map, chunk_bytes=chunk_bytes)
    for (s_out, _), (_, d_in) in zip(out_map.tolist(), in_map.tolist()):
        assert torch.equal(_bits(gpu[:, d_in]), _bits(original[:, s_out]))


def test_copy_blocks_in_every_layer():
    layers = [_cache(6, torch.float16, s) for s in range(3)]
    before = [c.clone() for c in layers]
    blocks.copy_blocks(layers, torch.tensor([[1, 4], [2, 5]], dtype=torch.int64))
    for now, was in zip(layers, before):
        assert torch.equal(now[:, 4], was[:, 1]) and torch.equal(now[:, 5], was[:, 2])
        assert torch.equal(now[:, :4], was[:, :4])


def test_empty_mapping_moves_nothing():
    a, b = _cache(3, torch.float16, 1), torch.zeros(2, 3, 2048, dtype=torch.float16)
    blocks.swap_blocks(a, b, torch.zeros(0, 2, dtype=torch.int64))
    assert torch.count_nonzero(b) == 0


@pytest.mark.parametrize("mapping, match", [
    (torch.tensor([[0, 9]]), "outside the caches"),
    (torch.tensor([[-1, 0]]), "outside the caches"),
    (torch.tensor([0, 1]), r"\[n, 2\] integer tensor"),
    (torch.tensor([[0.0, 1.0]]), r"\[n, 2\] integer tensor"),
    ({0: 1}, r"\[n, 2\] integer tensor, got dict"),
])
def test_bad_mappings_are_refused(mapping, match):
    with pytest.raises(ValueError, match=match):
        blocks.swap_blocks(_cache(3, torch.float16, 0), _cache(3, torch.float16, 1), mapping)


def test_mismatched_caches_are_refused():
    with pytest.raises(ValueError, match="differ in block shape or dtype"):
        blocks.swap_blocks(_cache(3, torch.float16, 0), _cache(3, torch.bfloat16, 1),
                           torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match=r"\[2, num_blocks, \.\.\.\]"):
        blocks.swap_blocks(torch.zeros(3, 4), _cache(3, torch.float16, 1), torch.tensor([[0, 0]]))


CHUNKS = [1, 3000, 2 * 16 * 64 * 2 * 2, blocks.CHUNK_BYTES]  # 1 block, 1, 2 and all per chunk


@pytest.mark.parametrize("chunk_bytes", CHUNKS)
@pytest.mark.parametrize("mapping, match", [
    ([[1, 2], [2, 3]], "block 2 is both a source and a destination"),  # chained
    ([[2, 1], [1, 2]], "block 1 is both a source and a destination"),  # a swap of two
    ([[1, 3], [2, 3], [4, 5]], "block 3 is the destination of 2 pairs"),
])
def test_chained_or_duplicate_destinations_are_refused(mapping, match, chunk_bytes):
    """vLLM's copy kernel applies the pairs in parallel (a chain or a repeated destination
    races); here they are refused for every chunk size, before anything is moved."""
    layers = [_cache(6, torch.float16, s) for s in range(2)]
    before = [c.clone() for c in layers]
    with pytest.raises(ValueError, match=match):
        blocks.copy_blocks(layers, torch.tensor(mapping), chunk_bytes=chunk_bytes)
    assert all(torch.equal(a, b) for a, b in zip(layers, before))
    if "destination of" in match:  # a repeated destination is refused by swap_blocks too
        dst = _cache(6, torch.float16, 9)
        with pytest.raises(ValueError, match=match.replace("pairs", "pairs of src_to_dst")):
            blocks.swap_blocks(layers[0], dst, torch.tensor(mapping), chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("chunk_bytes", CHUNKS)
def test_copy_result_does_not_depend_on_the_chunk_size(chunk_bytes):
    """One source copied to several destinations, in every layer: parallel semantics (every
    source read before any write), whatever the chunk size."""
    layers = [_cache(8, torch.bfloat16, s) for s in range(2)]
    before = [c.clone() for c in layers]
    mapping = torch.tensor([[1, 4], [1, 5], [2, 6], [0, 7]])
    blocks.copy_blocks(layers, mapping, chunk_bytes=chunk_bytes)
    for now, was in zip(layers, before):
        for s, d in mapping.tolist():
            assert torch.equal(now[:, d], was[:, s])
        assert torch.equal(now[:, :4], was[:, :4])


def test_copy_block_id_missing_in_a_later_layer_is_named_before_moving():
    layers = [_cache(8, torch.float16, 0), _cache(8, torch.float16, 1),
              _cache(5, torch.float16, 2)]
    before = [c.clone() for c in layers]
    with pytest.raises(ValueError, match=r"kv_caches\[2\] has 5 blocks"):
        blocks.copy_blocks(layers, torch.tensor([[1, 6]]))
    assert all(torch.equal(a, b) for a, b in zip(layers, before))
