"""Triton kernels and their launchers, installed as ``grpo_fast.kernels`` (never a top-level ``kernels``)."""
