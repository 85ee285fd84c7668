"""CPU stand-in of ``xformers`` 0.0.27.post2 (the release vLLM 0.6.3 requires), for tests only.

Only what vLLM 0.6.3's XFormers attention backend (``vllm/attention/backends/xformers.py``)
uses is modelled: ``xformers.ops.memory_efficient_attention_forward`` and the attention-bias
classes of ``xformers.ops.fmha.attn_bias`` it builds (``BlockDiagonalMask``,
``BlockDiagonalCausalMask`` and its ``make_local_attention``, ``LowerTriangularMask``,
``LowerTriangularMaskWithTensorBias``).  The forward is a float32 (float64 for float64 inputs)
CPU reference that honours each bias's semantics; it is not fast and it models none of the real
kernels' numerics.

How it is made importable:

- on the CoreX 3.2.3 stand-in (``tests/harness/corex/standin.py``) it is copied into site-packages,
  like the fake ``ixformer`` (the vendor stack has xformers installed);
- elsewhere a test puts ``tests/fakes/fake_xformers`` on ``sys.path`` / ``PYTHONPATH``.
"""

__version__ = "0.0.27.post2"

#: Marks this package as the test stand-in (a test can tell it from a real xformers).
IS_CPU_STANDIN = True
