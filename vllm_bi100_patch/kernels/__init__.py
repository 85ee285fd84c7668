"""Kernels layer: pure-PyTorch paged attention and the native decode dispatch.

Nothing in this package imports vLLM; everything takes plain tensors.
"""
