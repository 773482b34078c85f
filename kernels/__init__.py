"""Accelerator kernels next to their torch reference versions."""
